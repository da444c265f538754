"""The least a numpy agreement step can cost: what bench_worker_overhead.py times
as ``floor`` beside ours and vLLM's path.

:class:`NumpyFloor` does, on the very table and connector of an
:class:`~overhead_subjects.OursLoop`, only what any step that agrees on the
loads' statuses with a numpy buffer and one MIN all-reduce must do: gather the
list's columns in list order, fingerprint the list, poll the connector once
for every load, check the answers are statuses, pack a header and a word per
load, reduce, check the header came back, and find, check and write the moves.
It writes the moves into a column of its own, so the loop's table is left as
it is, and it releases nothing and reports nothing. No gates, no failures, no
origins, no capacity, no results: it is a lower bound for this library's step,
not a step. Its time against vLLM's count-based path says whether a numpy step
of any design can meet the bound on this machine.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from numpy.typing import NDArray

from lifecycle import KVPoll
from lifecycle.core.fingerprint import list_fingerprint, list_sum
from lifecycle.core.packing import HEADER, encode_header, status_words, unpack
from lifecycle.rules.batch import ADVANCE

__all__ = ["NumpyFloor"]

#: the statuses a poll may answer that need no verdict
_LIVE = bytes(int(s) for s in KVPoll if s != KVPoll.Failed)


class NumpyFloor:
    """The floor of a numpy agreement step over ``loop``'s loads (see the module)."""

    def __init__(self, loop: Any, collective: Any) -> None:
        self.table = loop.decode.agreement.table
        self.poller = loop.decode_rank.core
        self.collective = collective
        self.scratch: NDArray[np.int8] = np.zeros(0, dtype=np.int8)
        self.buf: NDArray[np.uint8] = np.zeros(0, dtype=np.uint8)  # one per size, as the step
        #: what the last call found: (the header came back whole, moves, all legal)
        self.last: tuple[bool, int, bool] = (False, 0, False)

    def iterate(self) -> float:
        """Timed: one floor step (seconds)."""
        t = self.table
        if self.scratch.size != t.state.size:  # (untimed: the table grew)
            self.scratch = np.zeros_like(t.state)
        if self.buf.size != HEADER + len(t):  # (untimed: the list's length changed)
            self.buf = np.zeros(HEADER + len(t), dtype=np.uint8)
        scratch, buf = self.scratch, self.buf
        t0 = time.perf_counter()
        rows = t.order()
        rooms, keys, states, hidx = (
            t.room[rows],
            t.room_key[rows],
            t.state[rows],
            t.handle_index[rows],
        )
        n = rows.size
        fp = list_fingerprint(list_sum(keys, states), n)
        raw = self.poller.poll_many(rooms, hidx)
        clean = not raw.tobytes().translate(None, _LIVE)
        header = encode_header(fp, n, 0, 0, 0, n, n, None)
        buf[:HEADER] = np.frombuffer(header, dtype=np.uint8)
        status_words(raw, buf[HEADER:])
        self.collective.all_reduce_min(buf)
        whole = buf[:HEADER].tobytes() == header
        new = unpack(buf[HEADER:])[0]
        changed = np.flatnonzero(new != states)
        legal = bool((ADVANCE[states[changed], new[changed]] >= 0).all())
        scratch[rows[changed]] = new[changed]
        took = time.perf_counter() - t0
        self.last = (whole and clean, int(changed.size), legal)
        return took
