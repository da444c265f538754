"""A soak's admission: how many requests a group may have admitted by now,
and the limit every group stops at once time is up, agreed through the step
digest and the store."""

from __future__ import annotations

from typing import Any

from pdlife.cluster.topology import Place

__all__ = ["Soak"]


class Soak:
    """The soak of global rank ``rank`` (at ``where``): ``seconds`` long,
    ``arrival_rate`` requests a step on schedule."""

    def __init__(
        self, seconds: float, rank: int, where: Place, store: Any, arrival_rate: int
    ) -> None:
        self.seconds = seconds
        self.rank = rank
        self.store = store
        self.arrival_rate = arrival_rate
        # this rank's group sets the soak's pace: prefill (DP group 0). Decode and
        # the other prefill DP groups follow it, through the store
        self.paces = where.side == "prefill" and where.dp_rank == 0
        self.leader = where.tp_rank == 0
        #: the requests every group stops at, once agreed (None: not yet)
        self.limit: int | None = None
        self._allowed = 0

    def upto(self, step: int) -> int:
        """How many requests this group may have admitted by ``step``: the agreed
        limit, else prefill (group 0) admits on schedule; the others only what
        it has (agreed in the digest), so that every group stops at the same
        request."""
        if self.limit is not None:
            return self.limit
        if self.paces:
            return step * self.arrival_rate
        return self._allowed

    def words(self, elapsed: float) -> tuple[int, int]:
        """What the group's first rank says for it in the digest, ``elapsed``
        seconds into the run."""
        if self.paces:
            up = elapsed >= self.seconds
            return int(up and self.leader), 0
        if not self.leader:
            return 0, -1

        def get(key: str, default: int) -> int:
            try:
                return int(self.store.get(key).decode()) if self.store.check([key]) else default
            except Exception:
                return default

        return get("soak/admitted", 0), get("soak/limit", -1)

    def agreed(self, a: int, b: int, admitted: int) -> None:
        """The words of the group's first rank (``a``, ``b``), with ``admitted``
        requests admitted here so far."""
        if self.paces:
            if self.limit is None and a:
                self.limit = admitted
                if self.rank == 0:
                    self.store.set("soak/limit", str(self.limit))
            if self.rank == 0:
                self.store.set("soak/admitted", str(admitted))
        else:
            self._allowed = a
            if b >= 0 and admitted >= b:
                self.limit = b
