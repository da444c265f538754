"""The package layers: buffers <- lifecycle <- transport <- field <- pdlife (tooling).

Each layer may import only the ones before it, including imports inside
functions, so ``import lifecycle`` can never pull in a transport or the
tooling, and there is no cycle between the packages.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ORDER = ["buffers", "lifecycle", "transport", "field", "pdlife"]


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & set(ORDER)


@pytest.mark.parametrize("package", ORDER)
def test_a_layer_imports_only_the_layers_before_it(package):
    allowed = set(ORDER[: ORDER.index(package) + 1])
    files = sorted((SRC / package).rglob("*.py"))
    assert files
    bad = {
        str(f.relative_to(SRC)): sorted(imported_packages(f) - allowed)
        for f in files
        if imported_packages(f) - allowed
    }
    assert bad == {}, f"{package} reaches into a later layer: {bad}"


def test_a_broken_layer_is_seen(tmp_path):
    """Negative control: the scan finds a lazy import inside a function."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from transport.registry import get_backend\n")
    assert imported_packages(f) == {"transport"}
