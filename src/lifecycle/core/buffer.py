"""Stage 4 of a step (reduce), this rank's side: the header and a byte per active row.

A :class:`StepBuffer` packs what the local stage decided into the buffer the
group MIN-reduces (layout in :mod:`lifecycle.core.packing`), and recognises the
common step in the reduced result: the header came back as this rank sent it
and every row at its agreed status, so nothing can raise and nothing moves.
The header is rewritten only when one of its fields changes.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from lifecycle.core.frame import Frame
from lifecycle.core.local import LocalStage
from lifecycle.core.packing import (
    HEADER,
    PAD,
    STATUS_SHIFT,
    buffer_size,
    encode_header,
    status_words,
    write_slots,
)

__all__ = ["StepBuffer"]


_NONE = np.empty(0, dtype=np.int64)
_NO_WORDS = np.empty(0, dtype=np.uint8)
_REASON_MASK = np.uint8((1 << STATUS_SHIFT) - 1)
#: a status byte to its word with no reason (bytes.translate)
_WORDS = bytes((b << STATUS_SHIFT) & 0xFF for b in range(256))


class StepBuffer:
    """The buffer one stepper hands its collective, and its header."""

    def __init__(self, rank: int, config_hash: int, queue_hash: int) -> None:
        self.rank = rank
        self._config_hash = config_hash
        self._queue_hash = queue_hash
        self.buf = np.empty(0, dtype=np.uint8)
        self._hdr = np.zeros(HEADER, dtype=np.uint8)  # this rank's header, never reduced
        self._packed = 0
        self._capacity = -1
        #: the failure slots hold PAD only (no rank can have written them since)
        self._clean = False
        self._key: tuple[object, ...] = ()
        #: the header as last sent
        self.header = b""
        self._view: tuple[NDArray[np.uint8], memoryview] | None = None  # (buf, its view)
        #: (header, unchanged words, the two joined): a common step's reduced bytes
        self._expect: tuple[bytes, bytes, bytes] = (b"", b"", b"")

    def place(self, area: NDArray[np.uint8], capacity: int) -> None:
        """Pack into ``area`` (:func:`buffer_size` bytes of ``capacity``, all
        PAD) from now on: a group's steppers pack into one buffer, which it
        reduces as it is, with no joining."""
        self.buf = area
        self._capacity, self._packed, self._clean = capacity, 0, True

    def pack(
        self, f: Frame, local: LocalStage, capacity: int, tag: int, want: int, failer: bool
    ) -> NDArray[np.uint8]:
        """Header plus this rank's words for the first ``capacity`` active rows
        (``failer``: this rank fails one of them) and its failure slots."""
        if capacity != self._capacity:
            self.buf = np.full(buffer_size(capacity), PAD, dtype=np.uint8)
            self._capacity, self._packed, self._clean = capacity, 0, True
        buf = self.buf
        key = (f.key, f.fp, tag, want, failer)
        if key != self._key:
            self.header = encode_header(
                f.fp,
                f.n_all,
                self._config_hash,
                self._queue_hash,
                tag,
                f.n,
                want,
                self.rank if failer else None,
            )
            self._hdr = np.frombuffer(self.header, dtype=np.uint8)
            self._key = key
        # always copied in: a caller reduces ``buf`` in place, and a merged
        # header left there after a mismatch would never agree again
        buf[:HEADER] = self._hdr
        k = min(f.n, capacity)
        rows = buf[HEADER : HEADER + k]
        values = local.values[:k]
        status_words(values, rows)
        pos = local.failed_in(k) if failer else _NONE
        words = _NO_WORDS
        if pos.size and local.codes is not None:
            # a Failed row's word is its reason alone (Failed is status 0)
            words = local.codes[pos].view(np.uint8) & _REASON_MASK
            rows[pos] = words
        elif pos.size:
            words = rows[pos]
        if self._packed > k:  # a reduce leaves PAD as PAD, so only a shrink needs refilling
            buf[HEADER + k : HEADER + self._packed] = PAD
        self._packed = k
        slots = buf[HEADER + capacity :]
        if not self._clean:  # this rank's list, or every rank's from a reduce made in place
            slots[:] = PAD
        # until a reduce is seen to have left them alone (see unchanged)
        self._clean = False
        if failer:
            write_slots(slots, self.rank, pos, words)
        return buf

    def repack(
        self,
        f: Frame,
        scan: bytes | bytearray | NDArray[np.int8],
        capacity: int,
        want: int,
        tag: int = 0,
    ) -> NDArray[np.uint8] | None:
        """:meth:`pack` for a step after a common one (every row fits, no row
        failed, and the header, capacity and row count of the last pack stand,
        with the failure slots left PAD by its reduce): only the words are
        written, from the statuses ``scan`` (a byte each, all live), through a
        memoryview (no numpy call); given as an int8 array (a long list), in
        one numpy call. A ``tag`` word (an iteration number) that moved is
        encoded anew. None when that is not so (:meth:`pack`)."""
        n, key = f.n, self._key
        if not (
            self._clean
            and self._packed == n <= capacity == self._capacity
            and (key == (f.key, f.fp, tag, want, False) or self._retag(f, tag, want))
        ):
            return None
        buf, kept = self.buf, self._view
        view = kept[1] if kept is not None and kept[0] is buf else None
        if view is None:
            view = buf.data
            self._view = (buf, view)
        view[:HEADER] = self.header
        if isinstance(scan, np.ndarray):
            status_words(scan, buf[HEADER : HEADER + n])
        else:
            view[HEADER : HEADER + n] = scan.translate(_WORDS)
        self._clean = False
        return buf

    def _retag(self, f: Frame, tag: int, want: int) -> bool:
        """The header of the last pack with another tag, when only the tag moved."""
        key = self._key
        if not (len(key) == 5 and key[:2] == (f.key, f.fp) and key[3:] == (want, False)):
            return False
        self.header = encode_header(
            f.fp, f.n_all, self._config_hash, self._queue_hash, tag, f.n, want, None
        )
        self._hdr = np.frombuffer(self.header, dtype=np.uint8)
        self._key = (f.key, f.fp, tag, want, False)
        return True

    def unchanged(self, reduced: NDArray[np.uint8], f: Frame) -> bool:
        """The reduce returned this rank's own header and every active row at
        its agreed status (the caller checks that every row was packed).

        Byte-wise MIN gives back a rank's own header only when every rank sent
        the same list, configuration, queue, tag and sizes; with every word
        equal to its row's agreed status (a failure would read Failed) no row
        moves, nothing can raise and no origin is fetched (and no rank
        failed a row, so no rank wrote a failure slot)."""
        words, exp = f.unchanged_words(), self._expect
        if exp[0] is not self.header or exp[1] is not words:  # both kept until they change
            exp = self._expect = (self.header, words, self.header + words)
        same = reduced.data[: HEADER + f.n].tobytes() == exp[2]
        self._clean = same
        return same

    def unchanged_in(self, whole: bytes, at: int, f: Frame) -> bool:
        """:meth:`unchanged` for the segment at ``at`` of a reduced buffer
        given as bytes (a group's: one copy for every queue's comparison).
        The header first: a step where rows failed differs there already."""
        same = whole.startswith(self.header, at) and whole.endswith(
            f.unchanged_words(), at, at + HEADER + f.n
        )
        self._clean = same
        return same
