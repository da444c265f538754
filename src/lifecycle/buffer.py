"""This rank's side of a step's reduce: the header and a byte per active row.

A :class:`StepBuffer` packs what the local stage decided into the buffer the
group MIN-reduces (layout in :mod:`lifecycle.packing`), and recognises the
common step in the reduced result: the header came back as this rank sent it
and every row at its agreed status, so nothing can raise and nothing moves.
The header is rewritten only when one of its fields changes.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from lifecycle.frame import Frame
from lifecycle.local import LocalStage
from lifecycle.packing import HEADER, NO_FAILER, PAD, Field, field_slice, write_field

__all__ = ["StepBuffer"]

_FAILER = field_slice(Field.FAILER)
_NO_FAILER = np.frombuffer(NO_FAILER, dtype=np.uint8)


class StepBuffer:
    """The buffer one stepper hands its collective, and its header."""

    def __init__(self, rank: int, config_hash: int, queue_hash: int) -> None:
        self.rank = rank
        self._config_hash = config_hash
        self._queue_hash = queue_hash
        self.buf = np.empty(0, dtype=np.uint8)
        self._hdr = np.zeros(HEADER, dtype=np.uint8)  # this rank's header, never reduced
        self._packed = 0
        self._key: tuple[object, ...] = ()
        #: the header as last sent
        self.header = b""

    def pack(
        self, f: Frame, local: LocalStage, capacity: int, tag: int, want: int, failer: bool
    ) -> NDArray[np.uint8]:
        """Header plus this rank's words for the first ``capacity`` active rows
        (``failer``: this rank fails one of them)."""
        size = HEADER + capacity
        if self.buf.size != size:
            self.buf = np.full(size, PAD, dtype=np.uint8)
            self._packed = 0
        buf = self.buf
        key = (f.key, f.fp, tag, want, failer)
        hdr = self._hdr
        if key != self._key:
            write_field(hdr, Field.FINGERPRINT, f.fp)
            write_field(hdr, Field.LENGTH, f.n_all)
            write_field(hdr, Field.CONFIG, self._config_hash)
            write_field(hdr, Field.QUEUE, self._queue_hash)
            write_field(hdr, Field.TAG, tag)
            write_field(hdr, Field.NEED, f.n)
            write_field(hdr, Field.FLOOR, want)
            if failer:
                write_field(hdr, Field.FAILER, self.rank)
            else:
                hdr[_FAILER] = _NO_FAILER
            self._key = key
            self.header = hdr.tobytes()
        # always copied in: a caller reduces ``buf`` in place, and a merged
        # header left there after a mismatch would never agree again
        buf[:HEADER] = hdr
        k = min(f.n, capacity)
        local.pack(buf[HEADER : HEADER + k])
        if self._packed > k:  # a reduce leaves PAD as PAD, so only a shrink needs refilling
            buf[HEADER + k : HEADER + self._packed] = PAD
        self._packed = k
        return buf

    def unchanged(self, reduced: NDArray[np.uint8], f: Frame) -> bool:
        """The reduce returned this rank's own header and every active row at
        its agreed status (the caller checks that every row was packed).

        Byte-wise MIN gives back a rank's own header only when every rank sent
        the same list, configuration, queue, tag and sizes; with every word
        equal to its row's agreed status (a failure would read Failed) no row
        moves, nothing can raise and no origin is fetched."""
        return (
            reduced[:HEADER].tobytes() == self.header
            and reduced[HEADER : HEADER + f.n].tobytes() == f.unchanged_words()
        )
