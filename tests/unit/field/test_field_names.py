"""field.utils: the pipeline, flag, layout-signature and abort names of 0.5.23."""

import types

import numpy as np
import pytest
import torch.distributed as dist

from field.checksum import kv_layout_signature
from field.engine import FinishAbort
from field.step.abort import is_aborted, is_unadmitted_reject, prepare_abort
from field.step.pp import (
    all_reduce_flags,
    poll_and_all_reduce_pp,
    poll_and_all_reduce_prefill_pp,
    pp_sync_polls,
)


def test_flags_on_one_rank_come_back_unchanged_and_bad_flags_are_refused(world_of_one):
    assert all_reduce_flags([3, 1, 2], world_of_one, dist.ReduceOp.MIN) == [3, 1, 2]
    assert all_reduce_flags([], world_of_one, dist.ReduceOp.MAX) == []
    # the field's decode transfer queue reduces its hold and ready flags as bools
    assert all_reduce_flags([True, False], world_of_one, dist.ReduceOp.MAX) == [True, False]
    assert all_reduce_flags([np.bool_(True)], world_of_one, dist.ReduceOp.MIN) == [True]
    with pytest.raises(TypeError, match=r"flags\[1\]"):
        all_reduce_flags([1, 2.5], world_of_one, dist.ReduceOp.MIN)
    with pytest.raises(TypeError, match=r"flags\[0\]"):
        all_reduce_flags(["1"], world_of_one, dist.ReduceOp.MIN)
    with pytest.raises(ValueError, match="int32"):
        all_reduce_flags([1 << 40], world_of_one, dist.ReduceOp.MIN)


def test_pp_verdicts_map_without_polling():
    got = poll_and_all_reduce_pp(["a", "b", "c"], 2, pp_good_rids=["a", "c"], pp_bad_rids=["c"])
    assert got == [2, None, 0]  # bad wins over good
    with pytest.raises(ValueError, match="PP consensus is required"):
        poll_and_all_reduce_pp(["a"], 2)


class Pipe:
    """Three stages' PP group in one process: a mailbox per destination stage."""

    def __init__(self):
        self.box = {}
        self.sent = []

    def send_object(self, obj, dst, async_send=False, **_):
        self.box.setdefault(dst, []).append(list(obj))
        w = types.SimpleNamespace(work=types.SimpleNamespace(wait=lambda: self.sent.append(dst)))
        return [w]

    def recv_object(self, src, **_):
        return self.box[src + 1].pop(0)


def test_every_stage_applies_pp_rank_0s_polls():
    pipe, works = Pipe(), [[], [], []]
    got = [pp_sync_polls([4, 0, 2], pipe, 0, 3, works[0])]
    got += [pp_sync_polls(None, pipe, r, 3, works[r]) for r in (1, 2)]
    assert got == [[4, 0, 2]] * 3
    assert len(works[0]) == len(works[1]) == 1 and works[2] == []
    pp_sync_polls([1], pipe, 0, 3, works[0])  # the next call waits for the last forward
    assert pipe.sent == [1]
    assert pp_sync_polls([3], None, 0, 1, []) == [3]
    with pytest.raises(ValueError, match="only pipeline stage"):
        pp_sync_polls(None, None, 0, 1, [])


def test_prefill_pp_polls_pp_consensus_on_stage_0_and_forwards(world_of_one):
    class Sender:
        def __init__(self, room, value):
            self.bootstrap_room, self.value = room, value

        def poll(self):
            raise AssertionError("stage 0 asks poll_pp_consensus, not poll")

        def poll_pp_consensus(self):
            return self.value

    pipe = Pipe()
    senders = [Sender(11, 4), Sender(12, 1)]
    got0 = poll_and_all_reduce_prefill_pp(senders, world_of_one, world_of_one, pipe, 0, 2, [])
    got1 = poll_and_all_reduce_prefill_pp([], world_of_one, world_of_one, pipe, 1, 2, [])
    assert got0 == got1 == [4, 1]


def test_the_layout_signature_is_positive_nonzero_and_follows_the_layout():
    a = types.SimpleNamespace(page_size=16, kv_cache_dtype_str="bf16", kv_item_lens=[4096])
    b = types.SimpleNamespace(page_size=32, kv_cache_dtype_str="bf16", kv_item_lens=[4096])
    sa, sb = kv_layout_signature(a), kv_layout_signature(b)
    assert 0 < sa < 1 << 63 and 0 < sb < 1 << 63
    assert sa != sb
    assert sa == kv_layout_signature(types.SimpleNamespace(**vars(a)))


def test_abort_is_recognised_and_an_intake_reject_is_told_apart():
    r = types.SimpleNamespace(return_logprob=False, metadata_buffer_index=-1, kv=None)
    assert not is_aborted(r) and not is_unadmitted_reject(r)
    prepare_abort(r, "bad request", 400)
    assert r.finished_reason == FinishAbort("bad request", 400)  # SGLang is not importable here
    assert is_aborted(r) and is_unadmitted_reject(r)
    r.metadata_buffer_index = 3  # it holds a row: its queue releases it
    assert not is_unadmitted_reject(r)


def test_sharded_pages_and_replicated_state_writers():
    import numpy as np

    from field.data.placement import filter_kv_indices_for_shard_rank, should_send_replicated_state

    local, pos = filter_kv_indices_for_shard_rank(
        kv_indices=np.array([0, 1, 2, 3, 4, 5]),
        index_slice=slice(10, 16),
        shard_rank=1,
        shard_size=2,
    )
    assert local.tolist() == [0, 1, 2] and pos.tolist() == [11, 13, 15]
    assert should_send_replicated_state(
        src_attn_tp_size=1, dst_attn_tp_size=4, local_tp_rank_in_group=0
    )
    writers = [
        should_send_replicated_state(
            src_attn_tp_size=4, dst_attn_tp_size=2, local_tp_rank_in_group=r
        )
        for r in range(4)
    ]
    assert writers == [True, False, True, False]
    with pytest.raises(ValueError, match="one must divide the other"):
        should_send_replicated_state(
            src_attn_tp_size=3, dst_attn_tp_size=2, local_tp_rank_in_group=0
        )
    with pytest.raises(ValueError, match="local_tp_rank_in_group"):
        should_send_replicated_state(
            src_attn_tp_size=2, dst_attn_tp_size=2, local_tp_rank_in_group=2
        )
    with pytest.raises(TypeError, match="shard_size"):
        filter_kv_indices_for_shard_rank(
            kv_indices=np.array([0]), index_slice=slice(0, 1), shard_rank=0, shard_size=1.5
        )


def test_every_0_5_23_state_type_is_named_and_the_unmoved_are_refused_by_name():
    from buffers.kv_args import StateType as Core
    from field.data.state_types import StateType, UnsupportedStateType, core_state_type

    assert len({m.value for m in StateType}) == 13
    assert StateType.DSV4_REQUEST_STATE is StateType.C128_STATE
    assert StateType.SWA == "swa"  # a str enum, as 0.5.23's
    assert core_state_type(StateType.MAMBA) is Core.MAMBA
    assert core_state_type("c128_state") is Core.C128_STATE
    with pytest.raises(UnsupportedStateType, match="qsa_pending"):
        core_state_type(StateType.QSA_PENDING)
