"""The reduced word: one int32 per request that carries what, why and where.

Layout of a request's word (bit 31, the sign, is always 0)::

    30..28  status   (KVPoll, 0..4)
    27..24  reason   (FailureReason; NONE unless status is Failed)
    23..0   origin   (the rank that produced this value)

Because the status sits in the high bits, MIN over ranks yields the agreed
status. Among ranks at that status, MIN then keeps the smallest reason code
(the documented priority in :mod:`lifecycle.reasons`) and then the smallest
rank: for a Failed request every rank decodes the same reason and the same
origin; for a pending one the origin names a rank holding it back.

A buffer is ``HEADER`` words followed by ``capacity`` request words (padded
with :data:`PAD`). The header carries, each as the pair ``(x, -x)`` so that
after MIN every rank knows both the minimum and the maximum across ranks:

- a 62-bit fingerprint of the ordered request list (two 31-bit halves) and
  the list length: a divergence is seen by all ranks in the very call that
  would otherwise have mixed requests up;
- a 31-bit hash of the step configuration and one of the queue's name: a
  rank built differently, or stepping another queue, is seen the same way;
- the caller's iteration tag (31 bits; 0 when none is given), so a rank one
  iteration behind is caught on the first step it takes out of turn;
- the capacity each rank asked for (``initial_capacity``): the group takes
  the maximum, so buffer sizes never depend on one rank's settings.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import REASON_BITS

__all__ = [
    "STATUS_SHIFT",
    "REASON_SHIFT",
    "ORIGIN_BITS",
    "MAX_RANK",
    "HEADER",
    "PAD",
    "pack",
    "unpack",
    "fingerprint",
    "write_header",
    "hash31",
    "Header",
]

ORIGIN_BITS = 24
REASON_SHIFT = ORIGIN_BITS
STATUS_SHIFT = ORIGIN_BITS + REASON_BITS
MAX_RANK = (1 << ORIGIN_BITS) - 1
_ORIGIN_MASK = np.int32(MAX_RANK)
_REASON_MASK = np.int32((1 << REASON_BITS) - 1)
HEADER = 14
PAD = np.int32(np.iinfo(np.int32).max)
_HALF = (1 << 31) - 1


def pack(
    status: NDArray[np.integer], reason: NDArray[np.integer], origin: int, out: NDArray[np.int32]
) -> None:
    """Pack local values into ``out`` (int32, same length)."""
    np.left_shift(status, STATUS_SHIFT, out=out, dtype=np.int32, casting="unsafe")
    out |= np.left_shift(reason, REASON_SHIFT, dtype=np.int32, casting="unsafe")
    out |= np.int32(origin)


def unpack(
    words: NDArray[np.int32],
) -> tuple[NDArray[np.int8], NDArray[np.int8], NDArray[np.int32]]:
    """Split words into (status, reason, origin)."""
    status = (words >> STATUS_SHIFT).astype(np.int8)
    reason = ((words >> REASON_SHIFT) & _REASON_MASK).astype(np.int8)
    origin = words & _ORIGIN_MASK
    return status, reason, origin


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    # splitmix64 finaliser, vectorised (uint64 arithmetic wraps)
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def fingerprint(rooms: NDArray[np.uint64]) -> int:
    """A 62-bit hash of the ordered list of rooms (order and length sensitive)."""
    n = rooms.size
    with np.errstate(over="ignore"):
        pos = np.arange(1, n + 1, dtype=np.uint64) * _GOLD
        h = np.bitwise_xor.reduce(_mix(rooms ^ _mix(pos)), initial=np.uint64(0))
        h = _mix(np.array([h ^ np.uint64(n)], dtype=np.uint64))[0]
    return int(h) & ((1 << 62) - 1)


def write_header(
    buf: NDArray[np.int32],
    n: int,
    fp: int,
    config: int = 0,
    queue: int = 0,
    tag: int = 0,
    capacity: int = 0,
) -> None:
    """Fill the header; ``config``, ``queue``, ``tag`` and ``capacity`` are
    31-bit non-negative values (see :func:`hash31`)."""
    hi, lo = fp >> 31, fp & _HALF
    buf[:HEADER] = (
        hi, -hi, lo, -lo, n, -n, config, -config, queue, -queue, tag, -tag, capacity, -capacity
    )  # fmt: skip


def hash31(text: str) -> int:
    """A stable 31-bit hash (the same in every process, unlike ``hash``)."""
    import hashlib

    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _HALF


class Header:
    """What the reduced header says about every rank's list and settings."""

    __slots__ = (
        "cap_max",
        "cap_min",
        "config",
        "fp_max",
        "fp_min",
        "len_max",
        "len_min",
        "queue",
        "tag",
    )

    def __init__(self, buf: NDArray[np.int32]) -> None:
        h: list[int] = buf[:HEADER].tolist()
        hi_min, hi_max, lo_min, lo_max = h[0], -h[1], h[2], -h[3]
        # (hi, lo) pairs are compared component-wise: all ranks equal iff min == max in both
        self.fp_min = (hi_min << 31) | lo_min
        self.fp_max = (hi_max << 31) | lo_max
        self.len_min, self.len_max = h[4], -h[5]
        self.config = (h[6], -h[7])
        self.queue = (h[8], -h[9])
        self.tag = (h[10], -h[11])
        self.cap_min, self.cap_max = h[12], -h[13]

    @property
    def lists_agree(self) -> bool:
        return bool(self.fp_min == self.fp_max and self.len_min == self.len_max)

    def differs(self) -> tuple[str, ...]:
        """What differs across ranks: request list, step configuration, queue, tag."""
        out = []
        if not self.lists_agree:
            out.append("request list")
        for name, (lo, hi) in (
            ("step configuration", self.config),
            ("queue", self.queue),
            ("tag", self.tag),
        ):
            if lo != hi:
                out.append(name)
        return tuple(out)

    @property
    def agreed(self) -> bool:
        return not self.differs()
