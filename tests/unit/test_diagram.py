import pytest

from lifecycle import KVPoll
from lifecycle.rules.graph import EDGES
from pdlife.cli import main


@pytest.mark.parametrize("role", ["sender", "receiver"])
@pytest.mark.parametrize("fmt", ["mermaid", "dot"])
def test_diagram_has_every_state_and_trigger(role, fmt, capsys):
    assert main(["diagram", "--role", role, "--format", fmt]) == 0
    out = capsys.readouterr().out
    for s in KVPoll:
        assert s.name in out
    for e in EDGES:
        for src in e.sources:
            edge = (
                f"{src.name} --> {e.dest.name}: {e.trigger}"
                if fmt == "mermaid"
                else f'{src.name} -> {e.dest.name} [label="{e.trigger}'
            )
            assert edge in out
    assert ("prefill" if role == "sender" else "decode") in out


def test_mermaid_starts_a_state_diagram(capsys):
    main(["diagram"])
    assert capsys.readouterr().out.startswith("stateDiagram-v2")
