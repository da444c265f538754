"""The field's consensus helpers, by their own names and call shapes, run by the step.

An engine that calls ``poll_and_all_reduce(pollers, gloo_group, decode_reqs,
metadata_buffers)`` (SGLang 0.5.23; the seed's trailing ``server_args`` is
accepted too) imports it from here instead and keeps the same arguments and
the same answer: one agreed status per poller, a list of ints. Underneath,
every call is one :class:`~lifecycle.drive.stepper.Stepper` step on a table kept from
one call to the next (:mod:`field.step.session`), so it also gets, with no other
change:

- a failure's agreed reason and origin rank (:func:`last_failures`);
- a fingerprint of the ordered request list in the same all-reduce, so ranks
  whose lists diverged raise :class:`~lifecycle.errors.CollectiveMismatch` on
  every rank instead of hanging or mixing requests up (rooms are read from
  ``decode_req.req.bootstrap_room`` or the poller's ``bootstrap_room``; when
  they are missing or repeat, only list lengths can be compared);
- a poller, staging handler or metadata row that raises fails only its
  request, on every rank, instead of killing one rank and hanging the others;
- the failure-probability variables read on every call as before, but drawn
  from a generator seeded once per process by ``PDLIFE_FAULT_SEED`` and rank,
  so a failing run repeats.

Where the field's semantics are kept on purpose (see docs/compat.md): the
metadata gate runs whenever ``decode_reqs`` and ``metadata_buffers`` are both
given (``metadata_buffers`` alone raises: there is no row to read); it holds a
Success only while the row's room is 0; the fake path skips it. An empty list
returns ``[]`` without a collective, as the field's does. Where ours is stricter: a row that carries another request's
non-zero room fails that request (reason metadata corrupt) instead of letting
it through, and a poll value outside KVPoll fails its request instead of
flowing into the reduce. Injected faults still poll the request (its backend
latches as usual); only the value reported changes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from field._checks import sequence
from field.release import release
from field.step.session import Session
from lifecycle import faults as _faults
from lifecycle.drive.collective import Collective, Hierarchical, TorchCollective
from lifecycle.drive.pipeline import PipelineForward
from lifecycle.result import Failure

__all__ = [
    "poll_and_all_reduce",
    "poll_and_all_reduce_attn_cp_tp_group",
    "poll_and_all_reduce_with_staging",
]

logger = logging.getLogger(__name__)

#: sessions kept per (kind, groups, gated, staged): a scheduler's queues of one
#: kind share a group, so a few are kept and each call goes to the one that
#: last saw its first request
MAX_SESSIONS = 4

_sessions: dict[tuple[Any, ...], list[Session]] = {}
_collectives: dict[tuple[int, ...], tuple[Collective, tuple[Any, ...]]] = {}
_last_failures: list[Failure] = []
# one seeded generator per (seed, rank) for the whole process: re-creating it on
# every call would draw the same numbers every call
_fault_hooks: dict[tuple[int, int], _faults.ProbabilisticFaults] = {}


def last_failures() -> list[Failure]:
    """Failures (room, reason, origin rank) agreed by the last compat call in this process."""
    return list(_last_failures)


def reset() -> None:
    """Forget every kept table and collective (for tests, or after the groups are destroyed)."""
    _sessions.clear()
    _collectives.clear()
    _last_failures.clear()


def _env_keys() -> tuple[Any, list[Any]] | None:
    """The environment's own mapping and the failure variables' keys in it
    (POSIX: the bytes os.environ keeps them under), or None where it has none."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or not callable(encode):
        return None
    return data, [encode(v) for v in _faults.ENV_VARS]


_ENV = _env_keys()


def _fault_hook(rank: int) -> _faults.ProbabilisticFaults | None:
    """The failure probability as set now, drawing from this process's seeded generator
    (read on every call: when neither variable is set, two dict lookups say so)."""
    if _ENV is not None and _ENV[0].keys().isdisjoint(_ENV[1]):
        return None
    fresh = _faults.from_env(rank)
    if fresh is None:
        return None
    hook = _fault_hooks.setdefault((fresh.seed, rank), fresh)
    hook.prob = fresh.prob
    return hook


def _collective(
    groups: tuple[Any, ...], pipeline: tuple[Any, int, int] | None = None
) -> Collective:
    """One collective per group tuple, kept (with the groups, so their ids stay theirs).

    With ``pipeline`` (a PP process group, this stage, the number of stages),
    the first stage reduces over ``groups`` and every stage applies its result
    (:class:`~lifecycle.drive.pipeline.PipelineForward`)."""
    key = tuple(map(id, groups))
    if pipeline is not None:
        key += (id(pipeline[0]), pipeline[1], pipeline[2])
    kept = _collectives.get(key)
    if kept is None:
        import torch.distributed as dist

        parts = [TorchCollective(g) for g in groups]
        coll: Collective = parts[0] if len(parts) == 1 else Hierarchical(parts)
        if pipeline is not None:
            group, stage, stages = pipeline
            world = 1
            for g in groups:
                world *= dist.get_world_size(g)
            coll = PipelineForward(
                coll if stage == 0 else None,
                group,
                stage,
                stages,
                rank=parts[0].rank,
                world_size=world,
            )
        kept = _collectives[key] = (coll, (*groups, pipeline))
    return kept[0]


def _session(
    key: tuple[Any, ...], coll: Collective, first: Any, gated: bool, staged: bool
) -> Session:
    pool = _sessions.setdefault(key, [])
    for i, s in enumerate(pool):
        if s.holds(first):
            if i:
                pool.insert(0, pool.pop(i))
            return s
    if len(pool) >= MAX_SESSIONS:  # the least recently used one starts over
        pool.pop()
    s = Session(coll, gated, staged)
    pool.insert(0, s)
    return s


def run_consensus(
    kind: str,
    groups: tuple[Any, ...],
    pollers: Sequence[Any],
    *,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: Any = None,
    server_args: Any = None,
    staging_handler: Any = None,
    pipeline: tuple[Any, int, int] | None = None,
) -> list[int]:
    """One consensus step of ``kind`` over ``groups`` (reduced in order) for the
    caller's list; every argument is checked before anything is polled."""
    n = len(pollers) if type(pollers) is list else _length(pollers, "pollers")
    if decode_reqs is not None and _length(decode_reqs, "decode_reqs") != n:
        raise ValueError(f"decode_reqs has {len(decode_reqs)} entries for {n} pollers")
    for g, name in zip(groups, ("gloo_group", "the CP group")):
        if g is not None:
            _check_group(g, name)
    if staging_handler is not None:
        for method in ("is_done", "advance_scatter"):
            if not callable(getattr(staging_handler, method, None)):
                raise TypeError(
                    f"staging_handler ({type(staging_handler).__name__}) has no {method}(decode_req)"
                )
    if n == 0:  # as the field: nothing to agree, no collective
        _last_failures.clear()
        return []
    coll = _collective(groups, pipeline)
    gated = metadata_buffers is not None
    staged = staging_handler is not None
    plist = pollers if type(pollers) is list else list(pollers)
    dlist = decode_reqs if decode_reqs is None or type(decode_reqs) is list else list(decode_reqs)
    first = plist[0] if dlist is None else dlist[0]
    key = (kind, id(coll), gated, staged)
    pool = _sessions.get(key)  # the queue this list is, most often the one seen last
    session = (
        pool[0] if pool and pool[0].holds(first) else _session(key, coll, first, gated, staged)
    )
    statuses, failures = session.run(
        plist,
        dlist,
        metadata_buffers=metadata_buffers,
        server_args=server_args,
        staging_handler=staging_handler,
        # the variables are read on every call: when neither is set, in one C call
        faults=None
        if _ENV is not None and _ENV[0].keys().isdisjoint(_ENV[1])
        else _fault_hook(coll.rank),
    )
    _last_failures[:] = failures
    return statuses


_group_types: list[type] = []


def _check_group(group: Any, name: str) -> None:
    """None (the default group) or a torch.distributed process group."""
    if group is None:
        return
    if not _group_types:
        from torch.distributed import ProcessGroup

        _group_types.append(ProcessGroup)
    if not isinstance(group, _group_types[0]):
        raise TypeError(
            f"{name} must be a torch.distributed ProcessGroup (a gloo group) or None, "
            f"not {type(group).__name__}"
        )


def _length(value: Any, name: str) -> int:
    return len(sequence(name, value, "a list, one entry per request"))


def _gate_args(decode_reqs: Any, metadata_buffers: Any, where: str) -> None:
    if metadata_buffers is not None and decode_reqs is None:
        raise TypeError(
            f"{where}: metadata_buffers was given without decode_reqs; the metadata gate "
            "reads each request's row from decode_reqs[i].metadata_buffer_index: pass both, "
            "or neither for no gate"
        )


def poll_and_all_reduce(
    pollers: Sequence[Any],
    gloo_group: Any,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: Any = None,
    server_args: Any = None,
) -> list[int]:
    """One agreed (MIN over ``gloo_group``) status per poller, as ints.

    The metadata gate runs when ``decode_reqs`` and ``metadata_buffers`` are
    both given (0.5.23's rule; the seed's ``server_args`` is optional and, when
    given, names the fake backend): a local Success whose row
    ``metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0]`` is
    still 0 counts as Transferring, except on the fake path.
    """
    if metadata_buffers is not None and decode_reqs is None:
        _gate_args(decode_reqs, metadata_buffers, "poll_and_all_reduce")  # raises
    gated = decode_reqs is not None and metadata_buffers is not None
    return run_consensus(
        "flat",
        (gloo_group,),
        pollers,
        decode_reqs=decode_reqs,
        metadata_buffers=metadata_buffers if gated else None,
        server_args=server_args,
    )


def poll_and_all_reduce_attn_cp_tp_group(
    pollers: Sequence[Any], attn_cp_cpu_group: Any, attn_tp_cpu_group: Any
) -> list[int]:
    """As :func:`poll_and_all_reduce` over the attention TP group, then MIN over
    the CP group: the MIN over TP x CP."""
    return run_consensus("cp_tp", (attn_tp_cpu_group, attn_cp_cpu_group), pollers)


def poll_and_all_reduce_with_staging(
    decode_reqs: Sequence[Any],
    staging_handler: Any,
    gloo_group: Any,
    metadata_buffers: Any = None,
    pollers: Sequence[Any] | None = None,
    server_args: Any = None,
) -> list[int]:
    """Poll each request (``pollers`` when given, else each ``decode_req.kv_receiver``);
    before that, advance the scatter of every request whose receiver requires
    staging and is not done. A staged request whose ``staging_handler.is_failed``
    reports Failed (0.5.23); a local Success is held at Transferring until its
    scatter is done; then the metadata gate when ``metadata_buffers`` is given;
    MIN over ``gloo_group``.

    The fifth argument is 0.5.23's ``pollers``; under the seed's conventions
    (:func:`field.release.release` is ``"seed"``) it is the seed's ``server_args``.

    ``decode_reqs`` that is not a list (None, say) raises
    :class:`~buffers.errors.BadArgumentType` (a TypeError) naming it, before
    any scatter is advanced or anything is polled.
    """
    _length(decode_reqs, "decode_reqs")
    if release() == "seed" and pollers is not None and server_args is None:
        server_args, pollers = pollers, None
    _gate_args(decode_reqs, metadata_buffers, "poll_and_all_reduce_with_staging")
    if pollers is None:
        pollers = [dr.kv_receiver for dr in decode_reqs]
    return run_consensus(
        "staging",
        (gloo_group,),
        pollers,
        decode_reqs=decode_reqs,
        metadata_buffers=metadata_buffers,
        server_args=server_args,
        staging_handler=staging_handler,
    )
