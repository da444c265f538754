"""State diagrams drawn from :data:`lifecycle.rules.graph.EDGES` (mermaid or dot)."""

from __future__ import annotations

from lifecycle.rules.graph import KERNEL, EdgeKind
from lifecycle.status import KVPoll, Role, meaning

__all__ = ["mermaid", "dot", "render"]


def _label(trigger: str, guard: str | None) -> str:
    return f"{trigger} [{guard}]" if guard else trigger


_STYLE = {EdgeKind.PROGRESS: "solid", EdgeKind.FAIL: "bold", EdgeKind.DEMOTE: "dashed"}


def render(role: Role, fmt: str) -> str:
    """The request lifecycle of ``role``'s side as a mermaid or dot diagram."""
    return KERNEL.diagram(
        fmt,
        "lifecycle",
        f"{role.node} ({role.name.lower()}) request lifecycle",
        KVPoll.Bootstrapping,
        label=lambda e: _label(e.trigger, e.guard),
        style=lambda e: _STYLE[e.kind],
        describe=lambda s: meaning(role, s),
    )


def mermaid(role: Role) -> str:
    return render(role, "mermaid")


def dot(role: Role) -> str:
    return render(role, "dot")
