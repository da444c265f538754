"""The drop-in against the real SGLang 0.5.23: same inputs, same answers.

Each case calls SGLang's own function and ours (``field.utils``) on the same
pollers, requests, metadata rows and staging handler, on one gloo rank and on
two, over many drawn calls, and compares the agreed lists. The differences
docs/compat.md lists are drawn separately and checked against their rule. A
negative control breaks our metadata gate and shows the comparison catches it.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.distributed as dist

import field.utils as ours
from lifecycle.testing.spawn import run_ranks

DEBUG = False
HOST = "10.0.0.1"  # a real (non-fake) bootstrap host: both gates read the row


class Poller:
    def __init__(self, room: int, value: int) -> None:
        self.bootstrap_room = room
        self.value = value
        self.require_staging = False

    def poll(self) -> int:
        return self.value


class Handler:
    """A staging handler: done after ``need`` advances; failed rooms time out."""

    def __init__(self, need: dict[int, int], failed: set[int]) -> None:
        self.need, self.failed, self.calls = need, failed, {}

    def is_done(self, dr) -> bool:
        room = dr.req.bootstrap_room
        return self.calls.get(room, 0) >= self.need.get(room, 0)

    def advance_scatter(self, dr) -> None:
        room = dr.req.bootstrap_room
        self.calls[room] = self.calls.get(room, 0) + 1

    def is_failed(self, dr) -> bool:
        return dr.req.bootstrap_room in self.failed


def _queue(rng: random.Random, n: int, rows: int, first: int = 0):
    """``n`` requests; each has its own metadata row (rows are not shared: a row
    holding another request's room is the documented difference, drawn apart)."""
    reqs = []
    for i in range(first, first + n):
        room = 5000 + i
        p = Poller(room, rng.choice([0, 1, 2, 3, 4, 4]))
        p.require_staging = rng.random() < 0.3
        reqs.append(
            types.SimpleNamespace(
                req=types.SimpleNamespace(bootstrap_room=room, bootstrap_host=HOST),
                metadata_buffer_index=i % rows,  # rows > requests ever made
                kv_receiver=p,
            )
        )
    return reqs


def _script(seed: int, rank: int, group, calls: int = 30) -> list[tuple[str, list, list]]:
    """Drawn calls of the three functions; (kind, SGLang's answer, ours) per call."""
    from sglang.srt.disaggregation import utils as sgl

    rng = random.Random(seed)  # the same list on every rank
    local = random.Random(seed * 31 + rank)  # this rank's own poll values
    rows = 64
    meta = ours.MetadataBuffers(rows, 16, torch.float32)
    reqs = _queue(rng, rng.randint(1, 12), rows)
    made = len(reqs)
    out = []
    for _ in range(calls):
        for dr in reqs:  # this rank's transfer progresses on its own
            dr.kv_receiver.value = local.choice([0, 1, 2, 3, 4, 4, 4])
        for r in range(rows):  # rows land (with the right room) or are cleared
            owner = [dr for dr in reqs if dr.metadata_buffer_index == r]
            meta.bootstrap_room[r, 0] = (
                owner[0].req.bootstrap_room if owner and rng.random() < 0.6 else 0
            )
        if rng.random() < 0.2 and len(reqs) > 1:  # some leave, some arrive
            del reqs[rng.randrange(len(reqs))]
        if rng.random() < 0.2:
            reqs += _queue(rng, 1, rows, made)
            made += 1
            reqs[-1].req.bootstrap_room = reqs[-1].kv_receiver.bootstrap_room = rng.randrange(
                10**6, 10**7
            )
        pollers = [dr.kv_receiver for dr in reqs]
        kind = rng.choice(["plain", "gated", "staging", "staging_gated", "cp_tp"])
        if kind == "plain":
            a = sgl.poll_and_all_reduce(pollers, group)
            b = ours.poll_and_all_reduce(pollers, group)
        elif kind == "gated":
            a = sgl.poll_and_all_reduce(pollers, group, decode_reqs=reqs, metadata_buffers=meta)
            b = ours.poll_and_all_reduce(pollers, group, decode_reqs=reqs, metadata_buffers=meta)
        elif kind == "cp_tp":
            a = sgl.poll_and_all_reduce_attn_cp_tp_group(pollers, group, group)
            b = ours.poll_and_all_reduce_attn_cp_tp_group(pollers, group, group)
        else:
            need = {dr.req.bootstrap_room: rng.randint(0, 2) for dr in reqs}
            failed = {dr.req.bootstrap_room for dr in reqs if rng.random() < 0.1}
            m = meta if kind == "staging_gated" else None
            a = sgl.poll_and_all_reduce_with_staging(reqs, Handler(need, failed), group, m)
            b = ours.poll_and_all_reduce_with_staging(reqs, Handler(need, failed), group, m)
        out.append((kind, [int(x) for x in a], [int(x) for x in b]))
        if a != b and DEBUG:
            import field.step.consensus

            print(
                kind,
                a,
                b,
                field.step.consensus.last_failures(),
                [
                    (dr.req.bootstrap_room, dr.kv_receiver.require_staging, dr.kv_receiver.value)
                    for dr in reqs
                ],
            )
    return out


def _differences(script) -> list[str]:
    return [f"call {i} ({k}): SGLang {a} ours {b}" for i, (k, a, b) in enumerate(script) if a != b]


@pytest.mark.parametrize("seed", range(12))
def test_one_rank_same_answers(world_of_one, seed):
    assert _differences(_script(seed, 0, world_of_one)) == []


def _two_ranks(rank: int, world: int, seed: int):
    import warnings

    warnings.simplefilter("ignore")
    return _script(seed, rank, dist.group.WORLD)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_gloo_ranks_same_answers_and_agreement():
    for seed in (1, 2, 3):
        r0, r1 = run_ranks(_two_ranks, 2, seed, timeout=180)
        assert _differences(r0) == [] and _differences(r1) == []
        assert [b for _, _, b in r0] == [b for _, _, b in r1]  # every rank got the same


def test_a_row_carrying_another_rooms_id_fails_here_and_passes_there(world_of_one):
    """The difference docs/compat.md lists: ours is stricter, by this rule."""
    from sglang.srt.disaggregation import utils as sgl

    meta = ours.MetadataBuffers(2, 16, torch.float32)
    reqs = _queue(random.Random(0), 1, 2)
    reqs[0].kv_receiver.value = 4
    meta.bootstrap_room[0, 0] = 999  # another request's row
    pollers = [reqs[0].kv_receiver]
    assert sgl.poll_and_all_reduce(pollers, world_of_one, reqs, meta) == [4]
    assert ours.poll_and_all_reduce(pollers, world_of_one, reqs, meta) == [0]


def test_negative_control_a_wrong_gate_is_caught(world_of_one, monkeypatch):
    import numpy as np

    from field.step.gates import RoomGate

    def always(self, slots, rooms):
        return np.ones(slots.size, dtype=bool), np.zeros(slots.size, dtype=bool)

    monkeypatch.setattr(RoomGate, "landed", always)
    found = [d for seed in range(12) for d in _differences(_script(seed, 0, world_of_one))]
    assert found, "a metadata gate that never holds went unnoticed"


@pytest.mark.parametrize("seed", range(40))
def test_pure_helpers_give_the_same_answers(seed):
    """Page placement, state writers, PP verdicts and the layout signature."""
    import numpy as np
    from sglang.srt.disaggregation import utils as sgl
    from sglang.srt.disaggregation.base.conn import KVArgs as SglKVArgs

    rng = random.Random(seed)
    size = rng.randint(1, 4)
    pages = np.array(rng.sample(range(100), rng.randint(0, 12)), dtype=np.int64)
    start = rng.randint(0, 5)
    kw = {"kv_indices": pages, "index_slice": slice(start, start + pages.size)}
    for rank in range(size):
        a = sgl.filter_kv_indices_for_shard_rank(**kw, shard_rank=rank, shard_size=size)
        b = ours.filter_kv_indices_for_shard_rank(**kw, shard_rank=rank, shard_size=size)
        assert [x.tolist() for x in a] == [x.tolist() for x in b]
    src, dst = rng.choice([(1, 2), (2, 1), (4, 2), (2, 4), (8, 2), (3, 3)])
    for r in range(src):
        kw2 = {"src_attn_tp_size": src, "dst_attn_tp_size": dst, "local_tp_rank_in_group": r}
        assert sgl.should_send_replicated_state(**kw2) == ours.should_send_replicated_state(**kw2)
    rids = [f"r{i}" for i in range(8)]
    good, bad = rng.sample(rids, 3), rng.sample(rids, 2)
    assert sgl.poll_and_all_reduce_pp(rids, 2, good, bad) == ours.poll_and_all_reduce_pp(
        rids, 2, good, bad
    )
    args = SglKVArgs()
    args.page_size = rng.choice([1, 16, 64])
    args.kv_cache_dtype_str = rng.choice(["bfloat16", "float16", "fp8_e4m3"])
    args.kv_layout = rng.choice([None, "nhd"])
    args.swa_kv_cache_layout = None
    args.state_types = []
    args.kv_item_lens = [rng.randint(1, 9) * 1024 for _ in range(rng.randint(1, 4))]
    args.state_item_lens = []
    assert sgl.kv_layout_signature(args) == ours.kv_layout_signature(args)


def test_flags_reduce_the_same(world_of_one):
    from sglang.srt.disaggregation import utils as sgl

    for op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.SUM):
        for flags in ([3, 0, 7, 1], [True, False]):  # decode.py passes bools
            assert sgl.all_reduce_flags(list(flags), world_of_one, op) == ours.all_reduce_flags(
                list(flags), world_of_one, op
            )


def _bool_flags(rank: int, world: int):
    from sglang.srt.disaggregation import utils as sgl

    flags = [rank == 1, False, True]  # as pop_transferred's hold flags
    return [
        f.all_reduce_flags(list(flags), dist.group.WORLD, op)
        for f in (sgl, ours)
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN)
    ]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bool_flags_reduce_the_same_on_two_ranks():
    for got in run_ranks(_bool_flags, 2, timeout=100):
        assert got == [[1, 0, 1], [0, 0, 1], [1, 0, 1], [0, 0, 1]]
