"""The simulator's topology and byte patterns: which heads a rank holds, what
its pages, state rows and metadata rows must contain, and that a check of
them reports a wrong head range or a single flipped byte."""

import numpy as np
import pytest
import torch

from pdlife.cluster.config import SimConfig, Workload
from pdlife.cluster.faults import dp_faults, primary_of
from pdlife.cluster.plan_doc import FaultPlan, TargetedFault
from pdlife.cluster.topology import HEAD_BYTES, heads_of, place, topology_problem
from pdlife.sim.kv_bytes import (
    RankBytes,
    kv_difference,
    kv_pattern,
    row_difference,
    state_pattern,
)


@pytest.mark.parametrize(
    ("tp", "heads", "want"),
    [
        (1, 4, [range(0, 4)]),
        (2, 4, [range(0, 2), range(2, 4)]),
        (4, 4, [range(i, i + 1) for i in range(4)]),
        (4, 2, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # replicated
        (2, 1, [range(0, 1), range(0, 1)]),
    ],
)
def test_heads_split_evenly_or_replicate(tp, heads, want):
    assert [heads_of(tp, r, heads) for r in range(tp)] == want


def test_the_split_agrees_with_the_transport():
    from transport.topology import head_range

    for tp, heads in ((1, 4), (2, 4), (4, 4), (4, 2), (8, 2), (2, 8), (2, 1)):
        for r in range(tp):
            assert list(head_range(tp, r, heads)) == list(heads_of(tp, r, heads))


@pytest.mark.parametrize(
    ("p", "d", "heads", "mla", "bad"),
    [
        (2, 4, 8, False, False),
        (2, 4, 2, False, False),  # decode replicates
        (4, 2, 3, False, True),
        (2, 3, 4, False, True),
        (2, 1, 1, True, False),
        (2, 1, 2, True, True),
    ],
)
def test_topology_problems_are_named(p, d, heads, mla, bad):
    problem = topology_problem(p, d, heads, mla)
    assert (problem is not None) == bad
    if bad and not mla:
        assert "--kv-heads" in problem


def test_places_of_prefill_dp_groups_and_decode():
    ps = [place(r, 2, 2, 3) for r in range(7)]
    assert [(p.side, p.dp_rank, p.tp_rank) for p in ps] == [
        ("prefill", 0, 0),
        ("prefill", 0, 1),
        ("prefill", 1, 0),
        ("prefill", 1, 1),
        ("decode", 0, 0),
        ("decode", 0, 1),
        ("decode", 0, 2),
    ]
    assert ps[2].group == (2, 3) and ps[5].group == (4, 5, 6)
    assert [p.name for p in ps[1:5]] == ["prefill/0", "prefill/1", "prefill/1", "decode"]
    assert place(0, 2, 1, 2).name == "prefill"
    with pytest.raises(ValueError, match="rank 7 is not in a cluster of 7"):
        place(7, 2, 2, 3)


def test_the_kv_pattern_is_keyed_by_room_layer_token_and_head():
    full = kv_pattern(7, 0, 0, 5, 2, range(4))
    assert full.shape == (5, 2, 4, HEAD_BYTES)
    # head slices and later pages are cut from the same pattern
    assert np.array_equal(kv_pattern(7, 0, 0, 5, 2, range(2, 4)), full[:, :, 2:4])
    assert np.array_equal(kv_pattern(7, 0, 2, 3, 2, range(4)), full[2:])
    # a page of size 2 holds the tokens of two pages of size 1
    assert np.array_equal(kv_pattern(7, 0, 0, 10, 1, range(4)).reshape(5, 2, 4, -1), full)
    for other in (
        kv_pattern(8, 0, 0, 5, 2, range(4)),
        kv_pattern(7, 1, 0, 5, 2, range(4)),
    ):
        assert not np.array_equal(other, full)
    tokens = full.reshape(10, 4, HEAD_BYTES)
    assert len({tokens[t, h].tobytes() for t in range(10) for h in range(4)}) == 40


def test_a_wrong_head_range_or_a_flipped_byte_is_reported():
    got = kv_pattern(11, 1, 0, 3, 2, range(2, 4))
    assert kv_difference(got, 11, 1, 0, range(2, 4)) is None
    wrong = kv_difference(got, 11, 1, 0, range(0, 2))  # another rank's heads
    assert wrong is not None and "head 0" in wrong and "layer 1" in wrong
    flipped = got.copy()
    flipped[2, 1, 1, 77] ^= 0x10
    what = kv_difference(flipped, 11, 1, 0, range(2, 4))
    assert what is not None and "page 2 token 5 head 3 byte 77" in what
    assert "expected" in kv_difference(got[:, :, :1], 11, 1, 0, range(2, 4))


def test_state_rows_differ_by_room_and_tensor_and_shares_tile_the_row():
    a = state_pattern(5, 0)
    assert a.shape == (64,) and np.array_equal(a, state_pattern(5, 0))
    assert not np.array_equal(a, state_pattern(6, 0))
    assert state_pattern(5, 1).shape == (192,)
    assert not np.array_equal(a, state_pattern(5, 1)[:64])
    for tp in (1, 2, 4):
        shares = [state_pattern(5, 1, (r, tp)) for r in range(tp)]
        assert np.array_equal(np.concatenate(shares), state_pattern(5, 1))


def _buffers(rank):
    cfg = SimConfig(prefill=2, decode=4, backend="fake", state=True, page_size=2)
    where = place(rank, cfg.prefill, cfg.prefill_dp, cfg.decode)
    # check bytes as a byte-moving backend's run does
    return RankBytes(cfg, where, moves_bytes=True)


def _land(prefills, decode, slot, row, n_pages, d_pages):
    """What the connector should do: each decode head from the prefill rank that holds it."""
    for layer, t in enumerate(decode.kv):
        for j, h in enumerate(decode.heads):
            src = next(p for p in prefills if h in p.heads)
            k = list(src.heads).index(h)
            t.numpy()[d_pages, :, j] = src.kv[layer].numpy()[np.arange(n_pages), :, k]
    for i, t in enumerate(decode.state_tensors):
        t.numpy()[row] = prefills[0].state_tensors[i].numpy()[0]
    for name, tensor in decode.meta.tensors.items():
        tensor[slot] = prefills[0].meta.tensors[name][0]


def test_decode_checks_its_heads_state_and_row_and_reports_a_flipped_byte():
    prefills = [_buffers(r) for r in range(2)]
    decode = _buffers(3)  # decode TP rank 1 of 4: heads 2 and 3 of 8
    assert list(decode.heads) == [2, 3] and [list(p.heads) for p in prefills] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    room, n = 99, 3
    for p in prefills:
        p.fill_pages(room, np.arange(n))
        p.write_first_token(room, 0, None)
        p.fill_state(room, 0)
    d_pages, slot = np.array([7, 3, 5]), 4
    row = decode.state_row(slot)
    assert row != slot  # state rows are not metadata slots
    _land(prefills, decode, slot, row, n, d_pages)
    problem, checked = decode.verify(room, d_pages, slot, row)
    assert problem is None and checked > n * 2 * 2 * 2 * HEAD_BYTES
    for buf, at, where in (
        (decode.kv[1].numpy(), (5, 1, 0, 3), "layer 1 page 2 token 5 head 2"),
        (decode.state_tensors[1].numpy(), (row, 9), f"state tensor 1 row {row} byte 9"),
        (
            decode.meta.tensors["output_hidden_states"].view(torch.uint8).numpy(),
            (4, 2),
            "metadata field output_hidden_states byte 2",
        ),
    ):
        _land(prefills, decode, slot, row, n, d_pages)
        buf[at] ^= 1
        problem, checked = decode.verify(room, d_pages, slot, row)
        assert problem is not None and problem.startswith(where), problem
        assert checked == 0  # a bad request counts nothing verified
    assert row_difference(decode.meta, 4, room + 1) is not None


def test_a_prefill_rank_draws_no_fault_for_another_dp_groups_request():
    from pdlife.cluster.phase_draws import phase_decisions
    from pdlife.cluster.plan_doc import FaultPlan

    rooms = np.arange(1, 401, dtype=np.uint64)
    group = np.arange(400) % 2
    plan = FaultPlan(seed=3, prob=0.2)
    # ranks 0, 1: prefill DP groups 0 and 1 (TP 1); rank 2: decode, sees all
    owner = {0: 0, 1: 1, 2: None}

    def serves(rank):
        return np.ones(400, bool) if owner[rank] is None else group == owner[rank]

    full = phase_decisions(plan, 0.05, 9, 3, rooms)
    masked = phase_decisions(plan, 0.05, 9, 3, rooms, serves)
    index = {int(r): i for i, r in enumerate(rooms)}
    assert masked and all(
        d.rank in (-1, 2) or group[index[d.room]] == owner[d.rank] for d in masked
    )
    # a rank's draws for the requests it serves are the ones it made unmasked
    kept = {
        (d.room, d.rank, d.phase) for d in full if d.rank == -1 or serves(d.rank)[index[d.room]]
    }
    assert {(d.room, d.rank, d.phase) for d in masked} == kept
    assert len(masked) < len(full)


def test_a_prefill_rank_carries_the_metadata_faults_of_the_decode_ranks_it_is_primary_of():
    def who(p, d, **kw):
        cfg = SimConfig(prefill=p, decode=d, **kw)
        return [primary_of(cfg, place(r, p, cfg.prefill_dp, d)) for r in range(cfg.world)]

    assert who(2, 2) == [[2], [3], [2], [3]]  # TP peers
    assert who(1, 2) == [[1, 2], [1], [2]]  # one prefill rank writes both rows
    assert who(2, 1) == [[2], [], [2]]  # prefill 1 is no decode rank's primary
    assert who(2, 4, kv_heads=8) == [[2, 3], [4, 5], [2], [3], [4], [5]]
    assert who(2, 2, prefill_dp=2) == [[4], [5], [4], [5], [4], [5]]  # each group alike


def test_under_prefill_dp_a_group_carries_only_the_metadata_faults_of_its_own_requests():
    # request i is served by group i % 2: the other group never writes its row, so
    # holding the fault there reported it unfired and failed a run where it fired
    rooms = Workload(SimConfig(requests=24)).all_rooms(24)
    faults = (
        TargetedFault("corrupt_metadata", 2, request=7),
        TargetedFault("drop_metadata", 3, room=rooms[4]),
        TargetedFault("drop_metadata", 3, room=12345),  # no request's: reported once, by group 0
    )
    cfg = SimConfig(prefill=1, decode=2, prefill_dp=2, requests=24, plan=FaultPlan(faults=faults))
    mine = [dp_faults(cfg, place(r, 1, 2, 2)).faults for r in range(cfg.world)]
    assert mine[0] == faults[1:] and mine[1] == faults[:1]
    assert mine[2] == mine[3] == faults  # decode ranks see every request
    assert dp_faults(SimConfig(plan=cfg.plan), place(0, 2, 1, 2)) == cfg.plan


def test_a_soak_under_prefill_dp_places_a_fault_named_by_room_without_listing_every_room(
    monkeypatch,
):
    # a soak's workload has 2**31-1 requests: listing their rooms to find a
    # fault's group asked for tens of GB before the first step
    def bounded(self, n):
        assert n <= 10**6, f"listed the rooms of {n} requests"
        return Workload.rooms_of(self.seed, np.arange(n, dtype=np.int64)).tolist()

    monkeypatch.setattr(Workload, "all_rooms", bounded)
    rooms = Workload.rooms_of(3, np.arange(8, dtype=np.int64)).tolist()
    faults = (
        TargetedFault("drop_metadata", 2, room=rooms[5]),
        TargetedFault("corrupt_metadata", 2, room=rooms[6]),
    )
    cfg = SimConfig(
        prefill=1, decode=1, prefill_dp=2, soak=5.0, requests=2**31 - 1, seed=3,
        plan=FaultPlan(faults=faults),
    )  # fmt: skip
    assert dp_faults(cfg, place(0, 1, 2, 1)).faults == faults[1:]
    assert dp_faults(cfg, place(1, 1, 2, 1)).faults == faults[:1]
    assert [Workload.index_of(3, r) for r in rooms] == list(range(8))
