"""Pipeline parallelism's consensus and the field's flag reduce.

With pipeline parallelism only PP rank 0 polls and agrees (TP, then CP);
every later stage takes PP rank 0's agreed list from the stage before it and
forwards it to the next, so every stage applies the same statuses.
:func:`pp_sync_polls` does the forwarding through the engine's own PP group
coordinator (its ``send_object`` / ``recv_object``), as the field does.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from field.step.consensus import run_consensus
from lifecycle.drive import lent
from lifecycle.status import KVPoll

__all__ = [
    "all_reduce_flags",
    "pp_sync_polls",
    "poll_and_all_reduce_pp",
    "poll_and_all_reduce_prefill_pp",
]

_INT32 = (-(1 << 31), (1 << 31) - 1)


def all_reduce_flags(flags: list[int], group: Any, op: Any) -> list[int]:
    """Reduce one small int per entry across ``group`` with ``op``; every rank must
    pass the same number of entries in the same order. Empty, or a group of
    one rank: returned unchanged. Entries must be integers that fit in int32,
    or bools (0 and 1: the field's decode transfer queue passes its hold and
    ready flags as bools); checked before anything is sent, so no rank enters
    the collective with a value the others would read differently."""
    import torch.distributed as dist

    if not isinstance(flags, (list, tuple)):
        raise TypeError(
            f"all_reduce_flags: flags must be a list of ints, not {type(flags).__name__}"
        )
    for i, f in enumerate(flags):
        if isinstance(f, (bool, np.bool_)):
            continue
        if not isinstance(f, numbers.Integral):
            raise TypeError(f"all_reduce_flags: flags[{i}] is {f!r}, not an int")
        if not _INT32[0] <= int(f) <= _INT32[1]:
            raise ValueError(f"all_reduce_flags: flags[{i}] = {f} does not fit in int32")
    if not flags or dist.get_world_size(group) == 1:
        return flags if isinstance(flags, list) else list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    try:
        dist.all_reduce(t, op=op, group=group)
    finally:
        lent.lend(t)  # gloo's thread may still hold it (see lifecycle.drive.lent)
    out: list[int] = t.tolist()
    return out


def _pp_tag() -> dict[str, Any]:
    """The field's PP-sync message tag, when SGLang is importable (else no tag)."""
    try:
        from sglang.srt.distributed.communication_tags import (  # type: ignore[import-not-found]
            P2PTag,
        )
    except Exception:
        return {}
    return {"tag": P2PTag.DISAGG_BOOTSTRAP_PP_SYNC}


def pp_sync_polls(
    polls: list[int] | None, pp_group: Any, pp_rank: int, pp_size: int, sync_work_list: list[Any]
) -> list[int]:
    """PP rank 0's ``polls``, on every stage: a later stage receives them from the
    stage before it and forwards them, without waiting, to the next; the
    previous call's forwards are waited for first."""
    if pp_size <= 1:
        if polls is None:
            raise ValueError("pp_sync_polls: polls is None on the only pipeline stage")
        return polls
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_sync_polls: pp_rank {pp_rank} is not in 0..{pp_size - 1}")
    for sent in sync_work_list:
        work = getattr(sent, "work", sent)
        work.wait()
    sync_work_list.clear()
    tag = _pp_tag()
    data = polls
    if pp_rank > 0:
        data = pp_group.recv_object(src=pp_rank - 1, **tag)
    if pp_rank + 1 < pp_size:
        sync_work_list.extend(pp_group.send_object(data, dst=pp_rank + 1, async_send=True, **tag))
    if data is None:
        raise ValueError(f"pp_sync_polls: stage {pp_rank} got no polls from PP rank 0")
    return list(data)


def poll_and_all_reduce_pp(
    rids: Iterable[str],
    ready_poll: int,
    pp_good_rids: list[str] | None = None,
    pp_bad_rids: list[str] | None = None,
) -> list[int | None]:
    """Poll states from the pipeline's agreed verdicts, without polling again:
    Failed for a request in ``pp_bad_rids``, ``ready_poll`` for one in
    ``pp_good_rids``, None (no news) for the rest. Both lists are required."""
    if pp_good_rids is None or pp_bad_rids is None:
        raise ValueError("PP consensus is required: pass pp_good_rids and pp_bad_rids")
    good, bad = set(pp_good_rids), set(pp_bad_rids)
    failed = int(KVPoll.Failed)
    return [failed if r in bad else ready_poll if r in good else None for r in rids]


class _PPConsensus:
    """A sender polled through its ``poll_pp_consensus``."""

    __slots__ = ("bootstrap_room", "sender")

    def __init__(self, sender: Any) -> None:
        self.sender = sender
        self.bootstrap_room = getattr(sender, "bootstrap_room", None)

    def poll(self) -> int:
        return int(self.sender.poll_pp_consensus())


def poll_and_all_reduce_prefill_pp(
    pollers: Sequence[Any],
    attn_cp_cpu_group: Any,
    attn_tp_cpu_group: Any,
    pp_group: Any,
    pp_rank: int,
    pp_size: int,
    pp_poll_sync_work_list: list[Any],
) -> list[int]:
    """Prefill with pipeline parallelism: PP rank 0 polls each sender's
    ``poll_pp_consensus`` and agrees over TP then CP; every stage applies PP
    rank 0's list.

    When ``pp_group`` is a gloo process group (or a coordinator with one as
    ``cpu_group``), every stage steps the same table with the core's
    :class:`~lifecycle.drive.pipeline.PipelineForward`: the later stages keep the
    agreed state and catch a list that differs from PP rank 0's (they poll
    nothing). Otherwise PP rank 0's list is forwarded through the coordinator's
    ``send_object`` / ``recv_object`` (:func:`pp_sync_polls`)."""
    senders = list(pollers)
    group = _process_group(pp_group)
    if pp_size > 1 and group is not None:
        if not 0 <= pp_rank < pp_size:
            raise ValueError(
                f"poll_and_all_reduce_prefill_pp: pp_rank {pp_rank} not in 0..{pp_size - 1}"
            )
        polled = [_PPConsensus(s) for s in senders] if pp_rank == 0 else [_IDLE] * len(senders)
        return run_consensus(
            "cp_tp_pp",
            (attn_tp_cpu_group, attn_cp_cpu_group),
            polled,
            decode_reqs=senders,  # the senders name the requests
            pipeline=(group, pp_rank, pp_size),
        )
    polls: list[int] = []
    if pp_rank == 0:
        polls = run_consensus(
            "cp_tp_pp",
            (attn_tp_cpu_group, attn_cp_cpu_group),
            [_PPConsensus(s) for s in senders],
            decode_reqs=senders,
        )
    return pp_sync_polls(polls, pp_group, pp_rank, pp_size, pp_poll_sync_work_list)


def _process_group(pp_group: Any) -> Any:
    from torch.distributed import ProcessGroup

    for g in (pp_group, getattr(pp_group, "cpu_group", None)):
        if isinstance(g, ProcessGroup):
            return g
    return None


class _Idle:
    """A later stage's poller: Success, the largest word, so the stage contributes
    nothing to the MIN it takes with PP rank 0's result (which it applies)."""

    bootstrap_room = None

    def poll(self) -> int:
        return int(KVPoll.Success)


_IDLE = _Idle()
