"""The hash's own speed here: what a digest is held against in the benchmarks."""

from __future__ import annotations

import time

import numpy as np

from transport.digest.hashing import ALGORITHM, Part, digest, new_hasher

__all__ = ["bare_cpu", "measure"]


def bare_cpu(nbytes: int, reps: int = 3) -> float:
    """CPU seconds of one bare xxh3 (or crc32) pass over ``nbytes`` contiguous
    bytes on this thread (the best of ``reps``): the floor a digest of that
    many bytes is held against."""
    buf = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        h = new_hasher(ALGORITHM)
        h.update(buf)
        h.intdigest()
        best = min(best, time.thread_time() - t0)
    return best


def measure(nbytes: int, algorithm: str = ALGORITHM, reps: int = 5) -> float:
    """GB/s of ``algorithm`` over one ``nbytes`` buffer (the best of ``reps``)."""
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    part: Part = (buf.reshape(1, -1), np.zeros(1, dtype=np.int64), (slice(None),))
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        digest([part], algorithm)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
