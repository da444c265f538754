"""Drop-in functions with the field's names and meanings, built on the step.

An engine that calls ``poll_and_all_reduce(pollers, gloo_group)`` today can
import it from here and get, with no other change:

- one MIN all-reduce as before, of packed words (so a failure's reason and
  origin rank are known; see :func:`last_failures`);
- a fingerprint of the ordered request list in the same call, so ranks whose
  lists diverged raise :class:`~lifecycle.errors.CollectiveMismatch` on every
  rank instead of hanging or mixing requests up (rooms are taken from each
  poller's ``bootstrap_room`` when present, else only lengths are compared);
- a poller that raises fails only its request (reason local exception), on
  every rank, instead of killing one rank and hanging the others;
- the failure-probability environment variables, seeded by
  ``PDLIFE_FAULT_SEED``.

Differences from the field: values outside KVPoll fail the request (agreed)
rather than flowing through unchecked; the buffer has an agreed capacity per
group, so the first call on a group with more than 64 requests, or a call
that outgrows it, makes one extra all-reduce (all ranks decide this from the
same reduced header). No state is kept between calls beyond that capacity:
latching is the backend's job here, as in the field.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from lifecycle import faults as _faults
from lifecycle.collective import Collective, Hierarchical, TorchCollective
from lifecycle.protocols import MetadataSource, StagingGate
from lifecycle.step import Failure, StepConfig, Stepper
from lifecycle.table import RequestTable

__all__ = [
    "poll_and_all_reduce",
    "poll_and_all_reduce_attn_cp_tp_group",
    "poll_and_all_reduce_with_staging",
    "last_failures",
    "FAKE_BOOTSTRAP_HOST",
]

FAKE_BOOTSTRAP_HOST = "2.2.2.2"

# agreed buffer capacity per (kind, group); process groups live as long as the process
_capacity: dict[tuple[str, int], int] = {}
_last_failures: list[Failure] = []
# one fault generator per (rank, settings) for the life of the process: a
# fresh one per call would draw the same numbers, failing the same queue
# positions on every call
_fault_hooks: dict[tuple[int, tuple[str | None, ...]], _faults.ProbabilisticFaults | None] = {}


def _fault_hook(rank: int) -> _faults.ProbabilisticFaults | None:
    env = os.environ
    key = (rank, tuple(env.get(v) for v in (*_faults.ENV_VARS, _faults.SEED_VAR)))
    if key not in _fault_hooks:
        _fault_hooks[key] = _faults.from_env(rank)
    return _fault_hooks[key]


def last_failures() -> list[Failure]:
    """Failures (room, reason, origin rank) agreed by the last compat call in this process."""
    return list(_last_failures)


def _table_for(
    pollers: Sequence[Any], decode_reqs: Sequence[Any] | None, rank: int, with_metadata: bool
) -> RequestTable:
    t = RequestTable(rank=rank, capacity=max(1, len(pollers)))
    rooms = [getattr(p, "bootstrap_room", None) for p in pollers]
    fake = np.zeros(len(pollers), dtype=bool)
    slots = np.full(len(pollers), -1, dtype=np.int64)
    if decode_reqs is not None:
        if len(decode_reqs) != len(pollers):
            raise ValueError(
                f"decode_reqs has {len(decode_reqs)} entries for {len(pollers)} pollers"
            )
        for i, dr in enumerate(decode_reqs):
            req = getattr(dr, "req", dr)
            slots[i] = getattr(dr, "metadata_buffer_index", -1)
            host = getattr(req, "bootstrap_host", None)
            fake[i] = host == FAKE_BOOTSTRAP_HOST or host is None
            room = getattr(req, "bootstrap_room", None)
            if isinstance(room, int):
                rooms[i] = room
    usable = all(isinstance(r, int) and r > 0 for r in rooms) and len(set(rooms)) == len(rooms)
    if usable:
        ids = [int(r) for r in rooms]  # type: ignore[arg-type]
    else:
        if decode_reqs is not None and with_metadata:
            raise ValueError(
                "the metadata gate needs each request's non-zero, unique bootstrap_room"
            )
        ids = list(range(1, len(pollers) + 1))
    t.extend(ids, handles=list(pollers), fake=fake, metadata_slots=slots)
    return t


def _run(
    pollers: Sequence[Any],
    collective: Collective,
    group_key: tuple[str, int],
    *,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: MetadataSource | None = None,
    staging: StagingGate | None = None,
) -> list[int]:
    rank = collective.rank
    table = _table_for(pollers, decode_reqs, rank, metadata_buffers is not None)
    if decode_reqs is None and metadata_buffers is not None:
        raise ValueError("metadata_buffers needs decode_reqs (their metadata slots and rooms)")
    stepper = Stepper(
        table,
        rank,
        staging=staging,
        metadata=metadata_buffers,
        faults=_fault_hook(rank),
        config=StepConfig(invalid_status="fail"),
        agreed_capacity=_capacity.get(group_key),
    )
    result = stepper.step(collective)
    _capacity[group_key] = stepper.capacity
    _last_failures[:] = result.failures()
    out: list[int] = result.statuses.tolist()
    return out


def poll_and_all_reduce(
    pollers: Sequence[Any],
    group: Any = None,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: MetadataSource | None = None,
) -> list[int]:
    """Poll every poller, fold local gates in, MIN over ``group``; one int per poller."""
    coll = TorchCollective(group)
    return _run(pollers, coll, group, decode_reqs=decode_reqs, metadata_buffers=metadata_buffers)


def poll_and_all_reduce_attn_cp_tp_group(
    pollers: Sequence[Any],
    cp_group: Any,
    tp_group: Any,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: MetadataSource | None = None,
) -> list[int]:
    """As :func:`poll_and_all_reduce`, reduced over TP then CP (the MIN over TP x CP)."""
    coll = Hierarchical([TorchCollective(tp_group), TorchCollective(cp_group)])
    return _run(
        pollers,
        coll,
        ("cp_tp", id(cp_group)),
        decode_reqs=decode_reqs,
        metadata_buffers=metadata_buffers,
    )


def poll_and_all_reduce_with_staging(
    pollers: Sequence[Any],
    staging: StagingGate,
    group: Any = None,
    decode_reqs: Sequence[Any] | None = None,
    metadata_buffers: MetadataSource | None = None,
) -> list[int]:
    """As :func:`poll_and_all_reduce`, advancing the staging scatter first and
    holding a local Success at Transferring until its scatter is done."""
    coll = TorchCollective(group)
    return _run(
        pollers,
        coll,
        ("flat", id(group)),
        decode_reqs=decode_reqs,
        metadata_buffers=metadata_buffers,
        staging=staging,
    )
