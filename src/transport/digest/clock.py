"""The CPU time the digest's hashing costs this process (every thread)."""

from __future__ import annotations

import threading

__all__ = ["CPU", "hash_cpu"]


class _CpuClock:
    """CPU seconds this process's hashing took, on every thread, and the bytes
    it hashed (:func:`hash_cpu`): what the digest costs a rank, apart from the
    wall-clock time its threads overlap with the transfer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.nbytes = 0

    def add(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.seconds += seconds
            self.nbytes += nbytes


CPU = _CpuClock()


def hash_cpu() -> tuple[float, int]:
    """(CPU seconds, bytes) of every digest hashed in this process so far: the
    hashing threads' own CPU time (``time.thread_time``), gathers of scattered
    rows included."""
    return CPU.seconds, CPU.nbytes
