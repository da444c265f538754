"""The list fingerprint a step's header carries: a 64-bit digest of the ordered
rooms (and, for the common step, their statuses) that every rank computes
alike, kept up as requests join and leave instead of hashed anew each step."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
from numpy.typing import NDArray

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64's finaliser, vectorised: a bijection of uint64 that scrambles
    every bit (uint64 arithmetic wraps). The one mixer every hash and seeded
    draw of the project uses."""
    with np.errstate(over="ignore"):  # a 0-d array warns where an array wraps
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


_mix = mix64


def fingerprint(rooms: NDArray[np.uint64]) -> int:
    """A 64-bit hash of the ordered list of rooms (order and length sensitive)."""
    n = rooms.size
    x, tmp = _scratch(n)
    np.bitwise_xor(rooms, _position_keys(n), out=x)
    with np.errstate(over="ignore"):  # _mix, in place: no temporaries to allocate
        np.right_shift(x, _S30, out=tmp)
        x ^= tmp
        x *= _M1
        np.right_shift(x, _S27, out=tmp)
        x ^= tmp
        x *= _M2
        np.right_shift(x, _S31, out=tmp)
        x ^= tmp
    h = int(np.bitwise_xor.reduce(x, initial=np.uint64(0)))
    return _mix_int(h ^ n)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_TLS = threading.local()


def _scratch(n: int) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """Two uint64 work arrays of ``n`` values, kept per thread (large
    temporaries are fresh pages to fault in on every call)."""
    pair: tuple[NDArray[np.uint64], NDArray[np.uint64]] | None = getattr(_TLS, "pair", None)
    if pair is None or pair[0].size < n:
        size = max(n, 1024)
        pair = (np.empty(size, dtype=np.uint64), np.empty(size, dtype=np.uint64))
        _TLS.pair = pair
    return pair[0][:n], pair[1][:n]


def _mix_int(x: int) -> int:
    """:func:`_mix` of one value, in Python integers (a numpy call on a
    one-element array costs more than the arithmetic)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64_INT
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64_INT
    return x ^ (x >> 31)


_TABLES: dict[str, NDArray[np.uint64]] = {}


def _cached(name: str, n: int, multiplier: np.uint64, odd: bool) -> NDArray[np.uint64]:
    """The first ``n`` of ``_mix((i + 1) * multiplier)`` (``| 1`` if ``odd``),
    from a read-only table that only grows. Each caller slices the table it
    read or built: another thread may replace the cached one meanwhile."""
    table = _TABLES.get(name)
    if table is None or table.size < n:
        size = max(n, 2 * (0 if table is None else table.size), 1024)
        with np.errstate(over="ignore"):
            table = _mix(np.arange(1, size + 1, dtype=np.uint64) * multiplier)
        if odd:
            table |= np.uint64(1)
        table.setflags(write=False)
        if table.size > _TABLES.get(name, table[:0]).size:
            _TABLES[name] = table
    return table[:n]


def _position_keys(n: int) -> NDArray[np.uint64]:
    """Keys for positions 0..n-1 (cached: a frame is rebuilt on every change
    of membership, and this half of the hash depends on the length alone)."""
    return _cached("keys", n, _GOLD, odd=False)


def position_weights(n: int) -> NDArray[np.uint64]:
    """Fixed pseudo-random 64-bit weights for list positions 0..n-1 (cached,
    read-only): :func:`status_sum` weighs each row's status by them."""
    return _cached("weights", n, _M2, odd=True)


def status_sum(states: NDArray[np.integer], pos: NDArray[np.int64] | None = None) -> int:
    """``sum(states[i] * weight[pos[i]])`` modulo 2**64 (``pos``: 0..n-1). Linear,
    so a change of some rows updates it from those rows alone."""
    w = (
        position_weights(states.size)
        if pos is None
        else position_weights(int(pos[pos.argmax()]) + 1)[pos]
    )
    # uint64 array arithmetic wraps modulo 2**64 without a warning (and an
    # errstate block costs microseconds right after a collective)
    return int(np.dot(states.astype(np.uint64), w))


def with_statuses(fp: int, total: int) -> int:
    """A list fingerprint combined with its :func:`status_sum`."""
    return fp ^ _mix_int(total & _MASK64_INT)


#: salts the room keys (kept apart from the position keys and weights)
_ROOM_SALT = 0xD6E8FEB86659FD93


#: salts an attempt's epoch into its room's key (epoch 0 leaves the key as it was)
_EPOCH_SALT = 0x9E3779B97F4A7C15


def room_keys(
    rooms: NDArray[np.uint64], epochs: NDArray[np.uint16] | None = None
) -> NDArray[np.uint64]:
    """Each (room, epoch)'s 64-bit key, for epoch 0 a bijection of the room (a
    table computes them once, as requests join, for :func:`list_sum`): two
    ranks that hold one room at different attempts hold different lists."""
    if rooms.size <= 8:  # a few rooms: Python integers cost less than numpy calls
        keys = np.array(
            [_mix_int(r ^ _ROOM_SALT) for r in rooms.tolist()], dtype=np.uint64
        ).reshape(rooms.shape)
    else:
        with np.errstate(over="ignore"):
            keys = _mix(np.bitwise_xor(rooms, np.uint64(_ROOM_SALT)))
    if epochs is not None and epochs.any():
        with np.errstate(over="ignore"):
            keys ^= epochs.astype(np.uint64) * np.uint64(_EPOCH_SALT)
    return keys


def list_sum(keys: NDArray[np.uint64], states: NDArray[np.int8]) -> int:
    """``sum((keys[i] + states[i]) * weight[i])`` modulo 2**64 over the list's
    positions (:func:`position_weights`), from the rows' :func:`room_keys`
    (``keys`` may be overwritten). The rooms are mixed already, so one weighted
    sum binds each room and its status to its position; linear in the
    statuses, so a status change updates it by :func:`status_sum` of the
    change alone."""
    n = keys.size
    if not n:
        return 0
    w = position_weights(n)
    scan = states.tobytes()
    # most lists hold one status: then sum(states * w) is that status times
    # the sum of the weights (no conversion of the statuses to uint64); one
    # comparison of bytes tells (bytes.strip, a byte at a time, took 54 us at
    # 16,384 rows where this takes 0.5)
    same = scan == scan[:1] * n
    # uint64 array arithmetic wraps modulo 2**64 without a warning
    if not same:
        np.add(keys, states.view(np.uint8), out=keys)
    total = int(np.dot(keys, w))
    if same:
        total += scan[0] * _weight_sum(n)
    return total & _MASK64_INT


def _weight_sum(n: int) -> int:
    """``sum(position_weights(n))`` modulo 2**64."""
    sums = _cached_sums(n)
    return int(sums[n - 1]) if n else 0


_SUMS: list[NDArray[np.uint64]] = []


def _cached_sums(n: int) -> NDArray[np.uint64]:
    """Prefix sums of the position weights, from a read-only table that only grows."""
    sums = _SUMS[0] if _SUMS else None
    if sums is None or sums.size < n:
        w = position_weights(max(n, 1024))
        with np.errstate(over="ignore"):
            sums = np.cumsum(w, dtype=np.uint64)
        sums.setflags(write=False)
        if not _SUMS or _SUMS[0].size < sums.size:
            _SUMS[:] = [sums]
    return sums


def list_fingerprint(total: int, length: int) -> int:
    """The fingerprint of a list of ``length`` rows whose :func:`list_sum` is ``total``."""
    return _mix_int((total ^ _mix_int(length ^ _ROOM_SALT)) & _MASK64_INT)


_MASK64_INT = 2**64 - 1


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that every process computes alike (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
