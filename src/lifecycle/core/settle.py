"""Stage 5 of a step (apply): read the reduced buffer, fetch origins, apply.

Every decision here reads reduced data only (the header, the agreed words,
the agreed table state), so every rank takes the same branch: the same
error, the same "is an origin fetch needed". The functions take plain data:
the step's frame and header, this rank's :class:`Who` and local stage, the
table they write.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import NDArray

from lifecycle.config import StepConfig
from lifecycle.core.frame import Frame, no_origins
from lifecycle.core.local import LocalStage
from lifecycle.core.packing import (
    HEADER,
    NO_ORIGIN,
    STATUS_SHIFT,
    Field,
    Header,
    slot_origins,
    slots_size,
)
from lifecycle.errors import CollectiveMismatch, IllegalTransition, InvalidStatus
from lifecycle.reasons import FailureReason
from lifecycle.result import StepResult
from lifecycle.rules import batch
from lifecycle.rules.recovery import FAIL_ALL, RecoveryTable
from lifecycle.status import I8, KVPoll
from lifecycle.table import RequestTable

__all__ = ["Who", "Settled", "settle", "unchanged_result", "result_of"]

_F = I8.F
#: the smallest word of a status other than Failed
_FIRST_LIVE_WORD = np.uint8(1 << STATUS_SHIFT)
_INVALID = bytes([int(FailureReason.INVALID_STATUS)])
_NO_TRIGGER = b"\xff\xff"  # an int16 -1
if batch.STAY >= 255:
    raise AssertionError("trigger ids fit below 255: a 0xFF byte is a -1 only")
_FAILED_BYTE = bytes([int(KVPoll.Failed)])
_SUCCESS_BYTE = bytes([int(KVPoll.Success)])
_EMPTY_I64 = np.empty(0, dtype=np.int64)
_EMPTY_I16 = np.empty(0, dtype=np.int16)
_EMPTY_I8 = np.empty(0, dtype=np.int8)
_EMPTY_F64 = np.empty(0, dtype=np.float64)
_FIELD_NAMES = {
    Field.FINGERPRINT: "request list",
    Field.LENGTH: "request list",
    Field.CONFIG: "step configuration",
    Field.QUEUE: "queue",
    Field.TAG: "tag",
}


@attrs.frozen
class Who:
    """Which stepper a step belongs to: what a divergence message names."""

    rank: int
    queue: str
    config: StepConfig


class Settled:
    """The agreed outcome of one step, before it is applied to the table."""

    __slots__ = (
        "failed",
        "failing",
        "fetch",
        "frame",
        "hdr",
        "known",
        "moved",
        "new",
        "origin",
        "planned",
        "reason",
        "to",
        "triggers",
        "was",
        "words",
    )

    def __init__(self, frame: Frame, hdr: Header, words: NDArray[np.uint8]) -> None:
        self.frame = frame
        self.hdr = hdr
        # the rows whose agreed word is not their agreed status of before: the
        # only rows worked on (a few per step, however long the list)
        self.moved = (words != frame.unchanged_array()).nonzero()[0]
        #: the moved rows' agreed words (a copy: the reduced buffer is reused)
        self.words = words[self.moved]
        self.to = batch.WORD_STATUS[self.words]
        # active rows were not Failed before, so every failed row moved; a
        # Failed word is its reason alone (Failed is status 0)
        self.failing = self.words < _FIRST_LIVE_WORD
        self.failed: NDArray[np.int64] = self.moved[self.failing]
        self.fetch: NDArray[np.int32] | None = None
        #: the failed rows' origins, read from the failure slots
        self.known: NDArray[np.int32] | None = None
        self.planned = False
        self.new: NDArray[np.int8] | None = None

    def plan(self, who: Who, local: LocalStage, origins: NDArray[np.int32] | None) -> None:
        """Work out every moving row's move, raising (on every rank alike: from
        agreed data only) before anything changes."""
        f = self.frame
        self.new = None
        self.planned = True
        if not self.moved.size:  # the common case: nothing moved
            return
        moved, to, words = self.moved, self.to, self.words
        was = self.was = f.state_all[moved if f.all_active else f.pos[moved]]
        reason = batch.WORD_REASON[words]
        origin = no_origins(moved.size)
        if self.failed.size:
            failing = self.failing
            if self.hdr.sole is not None:
                origin[failing] = self.hdr.sole  # one rank failed rows: all came from it
            elif self.known is not None:
                origin[failing] = self.known  # every failing rank's list came back whole
            else:
                assert origins is not None
                # both ascending, and every failed row moved: the same order
                origin[failing] = origins[: self.failed.size]
            if who.config.invalid_status == "raise" and _INVALID in reason.tobytes():
                i = int(np.flatnonzero(reason == FailureReason.INVALID_STATUS)[0])
                room = int(f.rooms[moved[i]])
                raise InvalidStatus(room, int(origin[i]), local.raw_invalid.get(room))
        # the trigger of each move, the abort rule included (batch.advance's)
        trig = batch.WORD_TRIGGER[was, words]
        if _NO_TRIGGER in trig.tobytes():  # a -1 (no trigger id reaches 255)
            i = int(np.flatnonzero(trig < 0)[0])
            raise IllegalTransition(
                int(f.rooms[moved[i]]), who.rank, int(was[i]), int(to[i]), "advance"
            )
        self.new, self.triggers, self.reason, self.origin = to, trig, reason, origin

    def commit(
        self, t: RequestTable, local: LocalStage, queue: str, recovery: RecoveryTable
    ) -> StepResult:
        """Write the planned moves into ``t``; the step's result (whose failures
        ``recovery`` decides)."""
        f, now = self.frame, local.now
        step = t.step_no + 1
        assert self.planned, "commit() before plan()"
        new = self.new
        if new is None:
            t.step_no, t.now = step, now
            return unchanged_result(queue, local, f, step)
        moved, was = self.moved, self.was
        slots = f.rows[moved]
        dwell = now - t.entered_time[slots]
        states = new.tobytes()
        ended = states.count(_FAILED_BYTE) + states.count(_SUCCESS_BYTE)
        t.terminal_count += ended
        t.state[slots] = new
        t.entered_step[slots] = step
        t.entered_time[slots] = now
        pos = moved if f.all_active else f.pos[moved]
        f.restate(pos, was, new, rehash=not ended)
        if self.failed.size:
            failing = self.failing
            reason, origin = self.reason[failing], self.origin[failing]
            at = slots[failing]
            t.reason[at] = reason
            t.origin[at] = origin
            at = pos[failing]
            f.reason_all[at] = reason
            f.origin_all[at] = origin
        t.step_no, t.now = step, now
        if ended:
            # some row became terminal: the table's terminal count changed, so
            # the next step builds a new frame, and this one's columns are
            # never written again: the result may hold them as they are
            f.retire()
        return result_of(queue, local, f, step, pos, was, self.triggers, dwell, recovery)


def unchanged_result(queue: str, local: LocalStage, f: Frame, step: int) -> StepResult:
    """The result of step ``step`` where nothing moved (the reduced buffer was
    this rank's own header and every row's agreed status)."""
    return result_of(queue, local, f, step, _EMPTY_I64, _EMPTY_I8, _EMPTY_I16, _EMPTY_F64)


def settle(
    who: Who,
    f: Frame,
    hdr: Header,
    reduced: NDArray[np.uint8],
    capacity: int,
    tag: int,
    local: LocalStage,
) -> Settled:
    """Check the header (raising on every rank if the ranks diverged) and work
    out whether this step needs an origin fetch."""
    if not hdr.agreed:
        raise _mismatch(who, tag, f, hdr)
    if hdr.need > capacity:
        raise RuntimeError("apply(): capacity too small; call resize() and reduce again")
    s = Settled(f, hdr, reduced[HEADER : HEADER + f.n])
    failed = s.failed
    if failed.size:
        if hdr.sole is None:  # several ranks failed rows: which word won where?
            area = reduced[HEADER + capacity :]
            if area.size == slots_size(capacity):
                s.known = slot_origins(area, failed, s.words[s.failing])
        if hdr.sole is None and s.known is None:  # some list did not fit: ask
            mine = local.words(failed) == s.words[s.failing]
            s.fetch = np.where(mine, np.int32(who.rank), NO_ORIGIN).astype(np.int32)
    return s


def _mismatch(who: Who, tag: int, f: Frame, hdr: Header) -> CollectiveMismatch:
    fields = hdr.differing()
    differs = tuple(dict.fromkeys(_FIELD_NAMES[x] for x in fields))
    detail = []
    if Field.FINGERPRINT in fields and Field.LENGTH not in fields:
        detail.append(
            "The lists have the same length: their rooms, their order or an agreed status "
            "differs (a request added or moved with another state on some rank, or a step "
            "that raised on some ranks only)."
        )
    if "queue" in differs:
        detail.append(f"This rank stepped queue {who.queue!r} in this collective.")
    if "tag" in differs:
        lo, hi = hdr.bounds(Field.TAG)
        detail.append(
            f"A rank is on another iteration (local tag {_tag(tag)}; tags across "
            f"ranks {_tag(lo)}..{_tag(hi)}): retry a failed iteration on every rank or on none."
        )
    if "step configuration" in differs:
        detail.append(f"This rank's config: {who.config!r}.")
    return CollectiveMismatch(
        who.rank,
        f.n_all,
        hdr.bounds(Field.LENGTH),
        f.fp,
        hdr.bounds(Field.FINGERPRINT),
        differs=differs,
        detail=" ".join(detail),
    )


def _tag(word: int) -> str:
    return "none" if word == 0 else str(word - 1)


def result_of(
    queue: str,
    local: LocalStage,
    f: Frame,
    step: int,
    pos: NDArray[np.int64],
    previous: NDArray[np.int8],
    triggers: NDArray[np.int16],
    dwell: NDArray[np.float64],
    recovery: RecoveryTable = FAIL_ALL,
) -> StepResult:
    statuses, reasons, origins = f.snapshot()
    return StepResult(
        step=step,
        queue=queue,
        rooms=f.rooms_all,
        statuses=statuses,
        reasons=reasons,
        origins=origins,
        active=f.pos,
        changed=pos,
        previous=previous,
        triggers=triggers,
        dwell=dwell,
        exceptions=local.exceptions,
        epochs=f.epoch_all,
        recovery=recovery,
    )
