"""Stage 4 of a step (reduce): the buffer's layout, one byte per live request and a header.

A request's word is one ``uint8``::

    7..4  status  (KVPoll, 0..4)
    3..0  reason  (FailureReason when status is Failed, else 0)

The status sits in the high bits, so MIN over ranks yields the agreed status;
among ranks that failed a request, MIN then keeps the smallest reason code,
which is the documented priority (:mod:`lifecycle.reasons`). Every rank
decodes the same status and, for Failed, the same reason. The rank a failure
came from is not in the word: it is fetched by a second, small collective
only on steps where some request newly failed and more than one rank failed
rows and their lists did not fit the buffer's *failure slots* (the
header's FAILER field says when a single rank did: every new failure then
came from it).

A buffer is :data:`HEADER` bytes followed by ``capacity`` request bytes
(padded with :data:`PAD`, which MIN ignores). The header is a list of 64-bit
fields, each as its 8 big-endian bytes and, for the fields that must match,
their complements ``255 - b``. MIN then gives every rank the byte-wise
minimum *and* maximum across ranks, so "all ranks sent the same value" is
known everywhere in the very call that would otherwise have mixed requests
up. For the capacity fields only the complement is sent: the byte-wise
maximum it yields is an upper bound of every rank's value, the same on every
rank, which is all a capacity decision needs.

After the request bytes come :data:`REGIONS` failure-slot regions
(:func:`slots_size` bytes; the buffer is :func:`buffer_size`). A rank that
fails rows writes region ``rank % REGIONS``: its rank (value and
complement), how many rows it failed, and up to :func:`slots_per_region`
entries ``position << 8 | word`` in ascending position. Every other byte is
0xFF, which MIN ignores, so a region read back holds exactly its writer's
list; two writers in one region show as a rank whose value and complement
disagree. When every failing rank's list came back whole, the origin of each
new failure (the lowest rank whose word won) is read from the buffer and no
second reduce is needed (:func:`slot_origins`).
"""

from __future__ import annotations

import enum
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
    "status_words",
    "unpack",
    "write_field",
    "encode_header",
    "field_slice",
    "Header",
    "REGIONS",
    "slots_per_region",
    "slots_size",
    "buffer_size",
    "write_slots",
    "slot_origins",
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
if len(MATCHED) != 5 or [int(f) for f in MATCHED] != list(range(5)):  # Header reads them so
    raise AssertionError("the matched fields are the header's first five")
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


_I8 = np.dtype(np.int8)
_WORD_OF_STATUS = np.uint8(1 << STATUS_SHIFT)


def status_words(status: NDArray[np.integer], out: NDArray[np.uint8]) -> None:
    """``out[i] = status[i] << STATUS_SHIFT`` (as uint8): the word of a row with no reason."""
    if status.dtype is _I8:  # the same bits as uint8: a plain uint8 multiply is the fastest loop
        np.multiply(status.view(np.uint8), _WORD_OF_STATUS, out=out)
    else:
        np.left_shift(status, STATUS_SHIFT, out=out, dtype=np.uint8, casting="unsafe")


def pack(status: NDArray[np.integer], reason: NDArray[np.integer], out: NDArray[np.uint8]) -> None:
    """Pack local values into ``out`` (uint8, same length); reason counts only on Failed."""
    status_words(np.asarray(status), out)
    failed = np.asarray(status) == 0
    if failed.any():
        out[failed] |= np.asarray(reason)[failed].astype(np.uint8) & _REASON_MASK


def unpack(words: NDArray[np.uint8]) -> tuple[NDArray[np.int8], NDArray[np.int8]]:
    """Split words into (status, reason); reason is NONE where not Failed."""
    status = (words >> STATUS_SHIFT).astype(np.int8)
    reason = np.where(status == 0, words & _REASON_MASK, _REASON_MASK).astype(np.int8)
    return status, reason


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
_NEED_AT = _OFFSET[Field.NEED] // 8
_FLOOR_AT = _OFFSET[Field.FLOOR] // 8


def encode_header(
    fp: int,
    length: int,
    config: int,
    queue: int,
    tag: int,
    need: int,
    floor: int,
    failer: int | None,
) -> bytes:
    """A whole header in one call (what :func:`write_field` would write for
    every field; ``failer``: this rank, if it fails some row)."""
    m = _MASK64
    fp, length, config, queue, tag = fp & m, length & m, config & m, queue & m, tag & m
    fail, unfail = (m, m) if failer is None else (failer, failer ^ m)
    return _STRUCT.pack(
        fp,
        fp ^ m,
        length,
        length ^ m,
        config,
        config ^ m,
        queue,
        queue ^ m,
        tag,
        tag ^ m,
        fail,
        unfail,
        (need & m) ^ m,
        (floor & m) ^ m,
    )


class Header:
    """What a reduced header says about every rank's values.

    Read as big-endian 64-bit words, a complement of bytes is the bitwise NOT
    of the value, so each field's byte-wise minimum and maximum are two words.
    """

    __slots__ = ("_words", "agreed", "floor", "need", "sole")

    def __init__(self, buf: NDArray[np.uint8]) -> None:
        w = self._words = _STRUCT.unpack(buf[:HEADER].tobytes())
        m = _MASK64
        #: every matched field is the same on every rank
        self.agreed = (
            w[0] == w[1] ^ m
            and w[2] == w[3] ^ m
            and w[4] == w[5] ^ m
            and w[6] == w[7] ^ m
            and w[8] == w[9] ^ m
        )
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


#: failure-slot regions after the request bytes (a failing rank writes region rank % REGIONS)
REGIONS = 8
_EMPTY_U32 = 0xFFFFFFFF
_REGION_HEAD = 3  # owner, its complement, count (big-endian uint32 each)
_HEAD = struct.Struct(f">{_REGION_HEAD}I")


def slots_per_region(capacity: int) -> int:
    """Entries per region for a buffer of ``capacity`` rows (agreed: a
    function of the agreed capacity alone)."""
    return max(2, min(64, capacity // 128))


def slots_size(capacity: int) -> int:
    """Bytes of the failure-slot regions of a buffer of ``capacity`` rows."""
    return REGIONS * 4 * (_REGION_HEAD + slots_per_region(capacity))


_SIZES: dict[int, int] = {}


def buffer_size(capacity: int) -> int:
    """Header, ``capacity`` request bytes and the failure-slot regions."""
    size = _SIZES.get(capacity)
    if size is None:
        size = HEADER + capacity + slots_size(capacity)
        if len(_SIZES) < 1024:  # capacities are bucketed: a few sizes in practice
            _SIZES[capacity] = size
    return size


def write_slots(
    area: NDArray[np.uint8], rank: int, positions: NDArray[np.int64], words: NDArray[np.uint8]
) -> None:
    """Fill ``area`` (:func:`slots_size` bytes, all 0xFF) with this rank's
    failed rows: ``positions`` ascending and their ``words``. Past the
    region's size only the count is written (the step then fetches)."""
    width = area.size // REGIONS
    at = (rank % REGIONS) * width
    count = positions.size
    if count <= width // 4 - _REGION_HEAD:  # written in place, in one call
        entries = [(p << 8) | w for p, w in zip(positions.tolist(), words.tolist())]
        struct.pack_into(
            f">{_REGION_HEAD + count}I", area.data, at, rank, rank ^ _EMPTY_U32, count, *entries
        )
    else:
        _HEAD.pack_into(area.data, at, rank, rank ^ _EMPTY_U32, count)


def slot_origins(
    area: NDArray[np.uint8], failed: NDArray[np.int64], agreed: NDArray[np.uint8]
) -> NDArray[np.int32] | None:
    """From reduced failure slots: the origin rank of each failed row
    (``failed``: ascending positions, ``agreed``: their agreed words), or
    None when some list did not come back whole (two writers in a region, a
    list longer than its region, an entry naming a row that did not fail):
    the step then fetches. Reads reduced data only: every rank answers alike."""
    if not failed.size:
        return np.full(0, NO_ORIGIN, dtype=np.int32)
    raw = area.tobytes()  # one copy; the regions are read from it in Python
    width = len(raw) // REGIONS
    k = width // 4 - _REGION_HEAD
    written, total = [], 0
    for at in range(0, REGIONS * width, width):
        owner, comp, count = _HEAD.unpack_from(raw, at)
        comp ^= _EMPTY_U32
        if owner == _EMPTY_U32 and comp == 0:
            continue  # no rank wrote here
        if owner != comp or count > k or owner >= NO_ORIGIN:
            return None
        if count:
            written.append((owner, at + 4 * _REGION_HEAD, count))
            total += count
    if not written:
        return None  # failed rows that no rank listed
    if total <= 128:  # a few entries: Python integers cost less than numpy calls
        return _origins_of(raw, written, failed, agreed)
    # every listed entry at once: (position, word), and the rank that listed it
    lists = [np.frombuffer(raw, dtype=">u4", count=c, offset=o) for _, o, c in written]
    entries = (lists[0] if len(lists) == 1 else np.concatenate(lists)).astype(np.int64)
    rank = np.repeat(
        np.array([o for o, _, _ in written], dtype=np.int32), [c for _, _, c in written]
    )
    listed = entries >> 8
    pos = np.searchsorted(failed, listed)
    if int(pos.max()) >= failed.size or (failed[pos] != listed).any():
        return None
    won = agreed[pos] == (entries & 0xFF)
    origin = np.full(failed.size, NO_ORIGIN, dtype=np.int32)
    np.minimum.at(origin, pos[won], rank[won])  # the lowest rank whose word won
    if int(origin.max()) == NO_ORIGIN:
        return None
    return origin


_NO_ORIGIN_INT = int(NO_ORIGIN)


def _origins_of(
    raw: bytes,
    written: list[tuple[int, int, int]],
    failed: NDArray[np.int64],
    agreed: NDArray[np.uint8],
) -> NDArray[np.int32] | None:
    """:func:`slot_origins` over a few listed entries, in Python integers
    (``written``: each listing rank, where its entries start in ``raw``, how many)."""
    where = {p: i for i, p in enumerate(failed.tolist())}
    words = agreed.tolist()
    origin = [_NO_ORIGIN_INT] * len(words)
    for owner, offset, count in written:
        for e in struct.unpack_from(f">{count}I", raw, offset):
            i = where.get(e >> 8)
            if i is None:  # a listed row that did not fail
                return None
            if words[i] == e & 0xFF and owner < origin[i]:
                origin[i] = owner  # the lowest rank whose word won
    if _NO_ORIGIN_INT in origin:
        return None
    return np.array(origin, dtype=np.int32)
