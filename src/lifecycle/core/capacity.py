"""The step buffer's agreed capacity: how many rows it holds, when it grows, when it shrinks.

Every input is reduced data (a header's ``need`` and ``floor``), so every
rank computes the same capacity and the collectives' sizes always match,
even when ranks were configured differently.
"""

from __future__ import annotations

import attrs

from lifecycle.config import MAX_CAPACITY

__all__ = ["Capacity", "bucket"]


def bucket(n: int, floor: int) -> int:
    """Capacity for ``n`` requests: 1/8 headroom, rounded up to an eighth of a
    power of two (at most ~25% padding, and few distinct sizes)."""
    need = max(floor, n + n // 8, 1)
    grain = max(1, 1 << max(0, need.bit_length() - 3))
    return -(-need // grain) * grain


@attrs.frozen
class Capacity:
    """``rows`` the buffer holds now; ``floor`` the least it may shrink to (the
    largest floor any rank asked for, as the reduce agreed it)."""

    rows: int
    floor: int

    @classmethod
    def first(cls, agreed: int) -> Capacity:
        cap = bucket(0, agreed)
        return cls(cap, cap)

    def with_floor(self, asked: int) -> Capacity:
        """The floor raised to a reduced request for ``asked`` rows."""
        floor = max(self.floor, min(bucket(0, asked), MAX_CAPACITY))
        return self if floor == self.floor else attrs.evolve(self, floor=floor)

    def grown(self, need: int) -> Capacity | None:
        """The capacity for ``need`` rows when they do not fit (None: they do)."""
        if need <= self.rows:
            return None
        return attrs.evolve(self, rows=bucket(need, self.floor))

    def settled(self, need: int) -> Capacity:
        """After a step that needed ``need`` rows: the floor takes effect, and a
        buffer four times too large shrinks to twice the need."""
        rows, floor = self.rows, self.floor
        if rows < floor:
            return attrs.evolve(self, rows=floor)
        if need * 4 < rows and rows > floor:
            return attrs.evolve(self, rows=max(floor, bucket(need * 2, floor)))
        return self
