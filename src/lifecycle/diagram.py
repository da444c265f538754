"""State diagrams drawn from :data:`lifecycle.graph.EDGES` (mermaid or dot)."""

from __future__ import annotations

from lifecycle.graph import EDGES, EdgeKind
from lifecycle.status import KVPoll, Role, meaning

__all__ = ["mermaid", "dot", "render"]


def _label(trigger: str, guard: str | None) -> str:
    return f"{trigger} [{guard}]" if guard else trigger


def mermaid(role: Role) -> str:
    lines = ["stateDiagram-v2", f"    %% {role.node} ({role.name.lower()}) request lifecycle"]
    for s in KVPoll:
        lines.append(f"    {s.name}: {s.name} ({int(s)}) - {meaning(role, s)}")
    lines.append(f"    [*] --> {KVPoll.Bootstrapping.name}")
    for e in EDGES:
        for src in e.sources:
            lines.append(f"    {src.name} --> {e.dest.name}: {_label(e.trigger, e.guard)}")
    for s in KVPoll:
        if s.terminal:
            lines.append(f"    {s.name} --> [*]")
    return "\n".join(lines) + "\n"


def dot(role: Role) -> str:
    lines = [
        "digraph lifecycle {",
        f'    label="{role.node} ({role.name.lower()}) request lifecycle";',
        "    rankdir=LR;",
    ]
    for s in KVPoll:
        shape = "doublecircle" if s.terminal else "circle"
        lines.append(
            f'    {s.name} [shape={shape}, label="{s.name}\\n({int(s)})", '
            f'tooltip="{meaning(role, s)}"];'
        )
    for e in EDGES:
        style = {EdgeKind.PROGRESS: "solid", EdgeKind.FAIL: "bold", EdgeKind.DEMOTE: "dashed"}
        for src in e.sources:
            lines.append(
                f'    {src.name} -> {e.dest.name} [label="{_label(e.trigger, e.guard)}", '
                f"style={style[e.kind]}];"
            )
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(role: Role, fmt: str) -> str:
    if fmt == "mermaid":
        return mermaid(role)
    if fmt == "dot":
        return dot(role)
    raise ValueError(f"unknown diagram format {fmt!r}; use 'mermaid' or 'dot'")


def protocol(fmt: str) -> str:
    """The connector's per-request protocol (:mod:`transport.connector_graph`)."""
    # tooling may import the transport layer; lifecycle's core never does
    from transport.connector_graph import EDGES as WIRE
    from transport.connector_graph import TERMINAL, Phase

    if fmt not in ("mermaid", "dot"):
        raise ValueError(f"unknown diagram format {fmt!r}; use 'mermaid' or 'dot'")
    title = "connector per-request protocol (prefill and decode)"
    if fmt == "mermaid":
        lines = ["stateDiagram-v2", f"    %% {title}", f"    [*] --> {Phase.Bootstrap.name}"]
        for e in WIRE:
            status = f" / {e.poll.name}" if e.poll is not None else ""
            lines += [f"    {s.name} --> {e.dest.name}: {e.trigger}{status}" for s in e.sources]
        lines += [f"    {p.name} --> [*]" for p in Phase if p in TERMINAL]
    else:
        lines = ["digraph protocol {", f'    label="{title}";', "    rankdir=LR;"]
        for p in Phase:
            shape = "doublecircle" if p in TERMINAL else "circle"
            lines.append(f"    {p.name} [shape={shape}];")
        for e in WIRE:
            lines += [f'    {s.name} -> {e.dest.name} [label="{e.trigger}"];' for s in e.sources]
        lines.append("}")
    return "\n".join(lines) + "\n"
