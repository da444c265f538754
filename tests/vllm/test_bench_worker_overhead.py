"""bench_worker_overhead.py runs end to end on 2 gloo workers and gives every
column, at tiny repetitions. No timing is judged here: the machines that run
the tests are noisy; `make vllm-bench` measures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_worker_overhead import COLUMNS, main

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
