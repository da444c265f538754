"""bench_worker_overhead.py runs end to end on 2 gloo workers and gives every
column, at tiny repetitions. No timing is judged here: the machines that run
the tests are noisy; `make vllm-bench` measures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from bench_worker_overhead import COLUMNS, main

from lifecycle import SingleRank

pytestmark = pytest.mark.timeout(300)


def test_every_column_comes_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["--reps", "3", "--warmup", "3", "--n", "8", "64", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [row["n"] for row in doc["rows"]] == [8, 64]
    for row in doc["rows"]:
        missing = [c for c in COLUMNS if c not in row]
        assert not missing, missing
        assert row["samples"] == 3
        for c in ("ours_us", "vllm_us", "allreduce_us", "ratio"):
            assert row[c] > 0, (c, row[c])
        assert row["reduce_bytes"] > 0 and row["reduces_per_step"] >= 1
        assert row["fence_violations"] == 0  # no load wrote into another's pages
    printed = capsys.readouterr().out
    assert "ratio" in printed and "vLLM" in printed


def test_one_worker_times_each_side_without_a_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--reps", "3", "--warmup", "3", "--n", "8", "--workers", "1", "--json", str(out)]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["world"] == 1 and len(doc["samples"]) == 1
    row = doc["rows"][0]
    assert row["ours_us"] > 0 and row["vllm_us"] > 0 and row["fence_violations"] == 0
    # the step still hands its collective one reduce per iteration (a no-op over one rank)
    assert row["reduces_per_step"] >= 1


class _Counted(SingleRank):
    """A group of one that counts like the bench's collective."""

    reduces, seconds, sent = 0, 0.0, ("uint8", 0)

    def all_reduce_min(self, buf):  # type: ignore[no-untyped-def]
        self.reduces += 1


@pytest.mark.parametrize("n", [8, 64])
def test_the_floor_finds_the_moves_the_step_makes_and_leaves_the_table_alone(n: int) -> None:
    # the floor, on the loop's table just before ours steps it, finds as many
    # moves as the step then reports (ready, ended), every one legal, the
    # header intact, and changes nothing of the table
    from overhead_floor import NumpyFloor
    from overhead_subjects import OursLoop

    loop = OursLoop(n, 4, 0, _Counted())
    floor = NumpyFloor(loop, _Counted())
    moved = 0
    for it in range(12):
        loop.prepare()
        t = loop.decode.agreement.table
        before = (t.order().copy(), t.state.copy())
        assert floor.iterate() > 0
        assert np.array_equal(t.order(), before[0]) and np.array_equal(t.state, before[1])
        agreed = dict(zip(t.rooms().tolist(), t.state[t.order()].tolist()))
        ended = loop.decode.agreement.step()
        after = dict(zip(t.rooms().tolist(), t.state[t.order()].tolist()))
        whole, moves, legal = floor.last
        assert whole and legal, it
        # the rows the step moved: ended (gone from the table) or agreed anew
        assert moves == sum(after.get(room) != s for room, s in agreed.items()), it
        assert moves >= len(ended.ready) + len(ended.ids), it
        moved += moves
        loop.decode.ready.extend((rid, loop.decode.live[rid]) for rid in sorted(ended.ready))
        for rid in ended.ids:
            loop.decode.live.pop(rid)
        loop.to_start = len(ended.ids)
    assert moved > 0
