"""The reduced buffer: one byte per live request, and a header in bytes.

A request's word is one ``uint8``::

    7..4  status  (KVPoll, 0..4)
    3..0  reason  (FailureReason when status is Failed, else 0)

The status sits in the high bits, so MIN over ranks yields the agreed status;
among ranks that failed a request, MIN then keeps the smallest reason code,
which is the documented priority (:mod:`lifecycle.reasons`). Every rank
decodes the same status and, for Failed, the same reason. The rank a failure
came from is not in the word: it is fetched by a second, small collective
only on steps where some request newly failed and more than one rank failed
rows (the header's FAILER field says when a single rank did: every new
failure then came from it).

A buffer is :data:`HEADER` bytes followed by ``capacity`` request bytes
(padded with :data:`PAD`, which MIN ignores). The header is a list of 64-bit
fields, each as its 8 big-endian bytes and, for the fields that must match,
their complements ``255 - b``. MIN then gives every rank the byte-wise
minimum *and* maximum across ranks, so "all ranks sent the same value" is
known everywhere in the very call that would otherwise have mixed requests
up. For the capacity fields only the complement is sent: the byte-wise
maximum it yields is an upper bound of every rank's value, the same on every
rank, which is all a capacity decision needs.
"""

from __future__ import annotations

import enum
import hashlib
import struct

import numpy as np
from numpy.typing import NDArray

from lifecycle.reasons import REASON_BITS

__all__ = [
    "STATUS_SHIFT",
    "PAD",
    "HEADER",
    "Field",
    "NO_ORIGIN",
    "pack",
    "unpack",
    "fingerprint",
    "position_weights",
    "status_sum",
    "with_statuses",
    "stable_hash",
    "write_field",
    "field_slice",
    "NO_FAILER",
    "Header",
]

STATUS_SHIFT = REASON_BITS
_REASON_MASK = np.uint8((1 << REASON_BITS) - 1)
PAD = np.uint8(255)
#: the origin fetch's "not me" value (any real rank is smaller)
NO_ORIGIN = np.int32(np.iinfo(np.int32).max)


class Field(enum.IntEnum):
    """Header fields, in buffer order. Matched fields carry value and complement."""

    FINGERPRINT = 0  # the whole ordered request list (and its length)
    LENGTH = 1  # the length of that list (to say how it differs)
    CONFIG = 2  # settings every rank must share
    QUEUE = 3  # which queue this segment is
    TAG = 4  # the caller's iteration number (0: none given)
    NEED = 5  # capacity needed (active rows): upper bound across ranks
    FLOOR = 6  # capacity wanted as a floor: upper bound across ranks
    FAILER = 7  # this rank, if it fails some row locally (else all 0xFF): see Header.sole


MATCHED = (Field.FINGERPRINT, Field.LENGTH, Field.CONFIG, Field.QUEUE, Field.TAG)
_BOUNDS = (Field.NEED, Field.FLOOR)
_OFFSET: dict[Field, int] = {}
_at = 0
for _f in (*MATCHED, Field.FAILER):
    _OFFSET[_f] = _at
    _at += 16
for _f in _BOUNDS:
    _OFFSET[_f] = _at
    _at += 8
HEADER = _at


def pack(status: NDArray[np.integer], reason: NDArray[np.integer], out: NDArray[np.uint8]) -> None:
    """Pack local values into ``out`` (uint8, same length); reason counts only on Failed."""
    np.left_shift(status, STATUS_SHIFT, out=out, dtype=np.uint8, casting="unsafe")
    failed = np.asarray(status) == 0
    if failed.any():
        out[failed] |= np.asarray(reason)[failed].astype(np.uint8) & _REASON_MASK


def unpack(words: NDArray[np.uint8]) -> tuple[NDArray[np.int8], NDArray[np.int8]]:
    """Split words into (status, reason); reason is NONE where not Failed."""
    status = (words >> STATUS_SHIFT).astype(np.int8)
    reason = np.where(status == 0, words & _REASON_MASK, _REASON_MASK).astype(np.int8)
    return status, reason


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
    """A 64-bit hash of the ordered list of rooms (order and length sensitive)."""
    n = rooms.size
    with np.errstate(over="ignore"):
        h = np.bitwise_xor.reduce(_mix(rooms ^ _position_keys(n)), initial=np.uint64(0))
        h = _mix(np.array([h ^ np.uint64(n)], dtype=np.uint64))[0]
    return int(h)


_WEIGHTS = np.empty(0, dtype=np.uint64)
_KEYS = np.empty(0, dtype=np.uint64)


def _position_keys(n: int) -> NDArray[np.uint64]:
    """``_mix((i + 1) * GOLD)`` for positions 0..n-1 (cached: a frame is
    rebuilt on every change of membership, and this half of the hash depends
    on the length alone)."""
    global _KEYS
    if _KEYS.size < n:
        size = max(n, 2 * _KEYS.size, 1024)
        with np.errstate(over="ignore"):
            k = _mix(np.arange(1, size + 1, dtype=np.uint64) * _GOLD)
        k.setflags(write=False)
        _KEYS = k
    return _KEYS[:n]


def position_weights(n: int) -> NDArray[np.uint64]:
    """Fixed pseudo-random 64-bit weights for list positions 0..n-1 (cached,
    read-only): :func:`status_sum` weighs each row's status by them."""
    global _WEIGHTS
    if _WEIGHTS.size < n:
        size = max(n, 2 * _WEIGHTS.size, 1024)
        with np.errstate(over="ignore"):
            w = _mix(np.arange(1, size + 1, dtype=np.uint64) * _M2) | np.uint64(1)
        w.setflags(write=False)
        _WEIGHTS = w
    return _WEIGHTS[:n]


def status_sum(states: NDArray[np.integer], pos: NDArray[np.int64] | None = None) -> int:
    """``sum(states[i] * weight[pos[i]])`` modulo 2**64 (``pos``: 0..n-1). Linear,
    so a change of some rows updates it from those rows alone."""
    w = position_weights(states.size) if pos is None else position_weights(int(pos.max()) + 1)[pos]
    with np.errstate(over="ignore"):
        return int((states.astype(np.uint64) * w).sum(dtype=np.uint64))


def with_statuses(fp: int, total: int) -> int:
    """A list fingerprint combined with its :func:`status_sum`."""
    x = total & _MASK64_INT
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64_INT
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64_INT
    return fp ^ x ^ (x >> 31)


_MASK64_INT = 2**64 - 1


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that every process computes alike (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def field_slice(field: Field) -> slice:
    """Where ``field`` sits in a header (value and complement, if it has one)."""
    at = _OFFSET[field]
    return slice(at, at + (8 if field in _BOUNDS else 16))


def write_field(buf: NDArray[np.uint8], field: Field, value: int) -> None:
    """Write one header field (and its complement where it has one) into ``buf``."""
    at = _OFFSET[field]
    raw = np.frombuffer((value & (2**64 - 1)).to_bytes(8, "big"), dtype=np.uint8)
    if field in _BOUNDS:
        buf[at : at + 8] = 255 - raw
    else:
        buf[at : at + 8] = raw
        buf[at + 8 : at + 16] = 255 - raw


_MASK64 = 2**64 - 1
_STRUCT = struct.Struct(f">{HEADER // 8}Q")
_FAILER_AT = _OFFSET[Field.FAILER] // 8
#: the FAILER field of a rank that fails no row: neutral for both its halves
NO_FAILER = b"\xff" * 16
_NEED_AT = _OFFSET[Field.NEED] // 8
_FLOOR_AT = _OFFSET[Field.FLOOR] // 8


class Header:
    """What a reduced header says about every rank's values.

    Read as big-endian 64-bit words, a complement of bytes is the bitwise NOT
    of the value, so each field's byte-wise minimum and maximum are two words.
    """

    __slots__ = ("_words", "agreed", "floor", "need", "sole")

    def __init__(self, buf: NDArray[np.uint8]) -> None:
        w = self._words = _STRUCT.unpack(buf[:HEADER].tobytes())
        #: every matched field is the same on every rank
        self.agreed = all(w[2 * i] == w[2 * i + 1] ^ _MASK64 for i in range(len(MATCHED)))
        self.need = w[_NEED_AT] ^ _MASK64
        self.floor = w[_FLOOR_AT] ^ _MASK64
        # the ranks failing some row locally write their rank (value and
        # complement), the others 0xFF bytes, neutral to both halves: the
        # byte-wise low and high of the failing ranks' values are equal exactly
        # when one rank failed rows, and then every new failure came from it
        lo, hi = w[_FAILER_AT], w[_FAILER_AT + 1] ^ _MASK64
        #: the only rank that failed rows in this step (None: none, or several)
        self.sole: int | None = lo if lo == hi else None

    def bounds(self, field: Field) -> tuple[int, int]:
        """(byte-wise low, byte-wise high) of a matched field across ranks."""
        at = _OFFSET[field] // 8
        return self._words[at], self._words[at + 1] ^ _MASK64

    def differing(self) -> tuple[Field, ...]:
        """The matched fields whose value is not the same on every rank."""
        return tuple(f for f in MATCHED if len(set(self.bounds(f))) > 1)
