"""One graph kernel for every declared state machine: edges compiled to tables.

A machine here is an :class:`enum.IntEnum` of states and a tuple of edges,
each a trigger that moves some source states to one destination. A
:class:`Kernel` compiles them once into what every executor needs: the
destination table ``dest[trigger, state]`` (-1 where undeclared) that batch
executors index with whole arrays, :meth:`Kernel.fire` over such arrays, the
``transitions`` machine a reference executor runs, and mermaid or dot
diagrams. The request lifecycle (:mod:`lifecycle.rules.graph`) and the
connector's per-request protocol (one kernel per side) both run on it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

__all__ = ["Arc", "Kernel"]

S = TypeVar("S", bound=enum.IntEnum)


class Arc(Protocol):
    """What a kernel reads of an edge."""

    @property
    def trigger(self) -> str: ...

    @property
    def sources(self) -> Sequence[Any]: ...

    @property
    def dest(self) -> Any: ...


class Kernel(Generic[S]):
    """``arcs`` over the states of ``states``, compiled; ``terminal`` states latch."""

    def __init__(self, states: type[S], arcs: Sequence[Arc], terminal: Iterable[S]) -> None:
        self.states = states
        self.arcs = tuple(arcs)
        self.terminal = frozenset(terminal)
        self.triggers: tuple[str, ...] = tuple(dict.fromkeys(a.trigger for a in self.arcs))
        self.trigger_id = {t: i for i, t in enumerate(self.triggers)}
        dest = np.full((len(self.triggers), len(states)), -1, dtype=np.int8)
        for a in self.arcs:
            row = dest[self.trigger_id[a.trigger]]
            for s in a.sources:
                if row[int(s)] >= 0:
                    raise AssertionError(f"{a.trigger}: declared twice from {states(s).name}")
                row[int(s)] = int(a.dest)
        dest.setflags(write=False)
        #: ``dest[trigger_id, state]``: where the trigger moves that state, -1: nowhere
        self.dest = dest

    def fire(
        self, current: NDArray[np.integer], trigger: str
    ) -> tuple[NDArray[np.int8], NDArray[np.bool_]]:
        """Fire ``trigger`` on every row: (new states, illegal mask); illegal rows stay."""
        try:
            t = self.trigger_id[trigger]
        except KeyError:
            raise ValueError(f"unknown trigger {trigger!r}; declared: {self.triggers}") from None
        now = np.asarray(current)
        to = self.dest[t, now]
        illegal = to < 0
        return np.where(illegal, now, to).astype(np.int8, copy=False), illegal

    def allowed(self, state: int) -> tuple[str, ...]:
        """The triggers declared from ``state``."""
        return tuple(t for t in self.triggers if self.dest[self.trigger_id[t], state] >= 0)

    def reachable(self, start: S) -> frozenset[S]:
        seen = {start}
        for _ in self.states:
            seen |= {a.dest for a in self.arcs if set(a.sources) & seen}
        return frozenset(seen)

    def machine(
        self,
        model: Any,
        initial: S,
        conditions: Callable[[Any], list[Any]] = lambda arc: [],
        **options: Any,
    ) -> Any:
        """A ``transitions`` machine with exactly these edges (``conditions``:
        the guards of an arc, as the library takes them; ``options``: the
        library's own)."""
        from transitions import Machine

        return Machine(
            model=model,
            states=self.states,
            transitions=[
                {
                    "trigger": a.trigger,
                    "source": list(a.sources),
                    "dest": a.dest,
                    "conditions": conditions(a),
                }
                for a in self.arcs
            ],
            initial=initial,
            auto_transitions=False,
            **options,
        )

    def diagram(
        self,
        fmt: str,
        name: str,
        title: str,
        initial: S,
        label: Callable[[Any], str] = lambda arc: str(arc.trigger),
        style: Callable[[Any], str] = lambda arc: "solid",
        describe: Callable[[S], str] | None = None,
    ) -> str:
        """The machine as a mermaid or dot diagram: every edge labelled by
        ``label``, styled (dot) by ``style``, every state described by ``describe``."""
        if fmt == "mermaid":
            lines = ["stateDiagram-v2", f"    %% {title}"]
            if describe is not None:
                lines += [f"    {s.name}: {s.name} ({int(s)}) - {describe(s)}" for s in self.states]
            lines.append(f"    [*] --> {initial.name}")
            for a in self.arcs:
                lines += [f"    {s.name} --> {a.dest.name}: {label(a)}" for s in a.sources]
            lines += [f"    {s.name} --> [*]" for s in self.states if s in self.terminal]
        elif fmt == "dot":
            lines = [f"digraph {name} {{", f'    label="{title}";', "    rankdir=LR;"]
            for s in self.states:
                shape = "doublecircle" if s in self.terminal else "circle"
                extra = (
                    f', label="{s.name}\\n({int(s)})", tooltip="{describe(s)}"' if describe else ""
                )
                lines.append(f"    {s.name} [shape={shape}{extra}];")
            for a in self.arcs:
                lines += [
                    f'    {s.name} -> {a.dest.name} [label="{label(a)}", style={style(a)}];'
                    for s in a.sources
                ]
            lines.append("}")
        else:
            raise ValueError(f"unknown diagram format {fmt!r}; use 'mermaid' or 'dot'")
        return "\n".join(lines) + "\n"
