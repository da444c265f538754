"""State diagrams drawn from :data:`lifecycle.rules.graph.EDGES` (mermaid or dot)."""

from __future__ import annotations

from lifecycle.rules.graph import EDGES, EdgeKind
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
