"""The engine's writes in flight, by the core's write id: where the driver
turns the core's :class:`~transport.connector.core.events.Write` and
:class:`~transport.connector.core.events.Forget` into engine calls, and the
engine's answers back into :class:`~transport.connector.core.events.Written`.

Every call is made from one thread (the driver's), as the
:class:`~transport.engine.Engine` contract asks."""

from __future__ import annotations

from typing import Any

from transport.connector.core.events import FAILED, LANDED, UNREACHABLE, Write, Written
from transport.engine import Engine

__all__ = ["InFlight"]


class InFlight:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[int, Any] = {}  # write id -> the engine's token

    def issue(self, w: Write) -> Written | None:
        """Start ``w``; its outcome at once if the peer is unreachable (else None)."""
        token = self.engine.write(w.info, *w.writes, w.note)
        if token is None:
            return Written(w.write, UNREACHABLE)
        self.tokens[w.write] = token
        return None

    def forget(self, write: int) -> None:
        """Let go of a write (given up at the drain timeout: it may still land)."""
        token = self.tokens.pop(write, None)
        if token is not None:
            self.engine.forget(token)

    def reap(self) -> list[Written]:
        """The writes that landed or failed since the last look, each once."""
        out = []
        for wid, token in list(self.tokens.items()):
            s = self.engine.check(token)
            if s != 0:
                del self.tokens[wid]
                self.engine.forget(token)
                out.append(Written(wid, LANDED if s > 0 else FAILED))
        return out
