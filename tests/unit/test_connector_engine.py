"""The connector drives its engine only through the public Engine protocol of
transport.engine: no backend or test subclass overrides the connector's own
(underscore) methods (read from the sources), and an object lacking a method is
refused naming it. (The loaded backends' subclasses, and an object with the
protocol's methods driving a request end to end from the threads the contract
names, run the driver and real engines' modules: see
tests/integration/test_connector_driver.py.)"""

import ast
from pathlib import Path

import pytest

from support.engine_contract import CONNECTOR_OWN, Partial, _subclasses, overrides
from support.stub_engine import CopyEngine
from transport.connector.hub import Connector
from transport.engine import check_engine
from transport.errors import NotAnEngine

ROOT = Path(__file__).resolve().parents[2]


def _scan(sources):
    """``Class.name`` for every class among ``sources`` (path -> text) that
    derives from Connector by name, through any chain of classes defined there,
    and defines one of the connector's own members."""
    classes = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                classes.append((path, node, bases))
    family, grew = {"Connector"}, True
    while grew:
        grew = False
        for _, node, bases in classes:
            if node.name not in family and bases & family:
                family.add(node.name)
                grew = True
    out = []
    for path, node, bases in classes:
        if node.name == "Connector" or not bases & family:
            continue
        for item in node.body:
            names = []
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [item.name]
            elif isinstance(item, ast.Assign):
                names = [t.id for t in item.targets if isinstance(t, ast.Name)]
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names = [item.target.id]
            out += [f"{path}:{node.name}.{n}" for n in names if n in CONNECTOR_OWN]
    return out


def test_a_subclass_overriding_a_connector_method_is_flagged():
    # built with type(): a class statement here would be flagged by the scan below
    sneaky = type("Sneaky", (Connector,), {"_perform": lambda self, *a: [], "start": None})
    deeper = type("Deeper", (sneaky,), {"_records": lambda self, store: []})
    assert overrides(sneaky) == ["Sneaky._perform"]  # (a public name is the subclass's own)
    assert sorted(overrides(deeper)) == ["Deeper._records", "Sneaky._perform"]
    # the check of every loaded subclass (tests/integration/test_connector_driver.py) would see it
    assert sneaky in set(_subclasses(Connector))


def test_no_class_in_src_or_tests_overrides_a_connector_method():
    # the test files' classes are not all imported here: read, not loaded
    files = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    sources = {f.relative_to(ROOT): f.read_text() for f in files}
    assert len(sources) > 100
    assert _scan(sources) == []


def test_the_scan_flags_an_override_through_a_chain_of_classes():
    text = (
        "class Mine(Connector):\n    def __init__(self, a, c):\n        pass\n"
        "class Deeper(Mine):\n    def _notified(self):\n        return []\n"
        "    def _perform(self, effects, store):\n        pass\n"
        "class Unrelated:\n    def _perform(self):\n        pass\n"
    )
    assert _scan({"x.py": text}) == ["x.py:Deeper._perform"]  # _notified is not the connector's
    assert _scan({"x.py": text.replace("_notified", "_records")}) == [
        "x.py:Deeper._records",
        "x.py:Deeper._perform",
    ]


def test_an_object_lacking_members_is_refused_naming_them():
    with pytest.raises(NotAnEngine) as e:
        check_engine(Partial())
    for name in ("connect", "check", "forget", "notified", "stop", "NOTIFIES (a bool)"):
        assert name in e.value.missing
    assert "start" not in e.value.missing and "write" not in e.value.missing
    assert "Partial is not a transfer engine" in str(e.value)
    assert "docs/backends.md" in str(e.value)
    check_engine(CopyEngine())  # the stub has them all


def calls_from_outside(sources, own):
    """``path:line .name`` for every call or read of one of ``own`` (the
    connector's underscore members) on something other than ``self``."""
    out = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, filename=str(path))):
            on_self = isinstance(node, ast.Attribute) and (
                isinstance(node.value, ast.Name) and node.value.id == "self"
            )
            if isinstance(node, ast.Attribute) and node.attr in own and not on_self:
                out.append(f"{path}:{node.lineno} .{node.attr}")
    return out


# the connector's own methods (not its attributes): what no other module may call
CONNECTOR_METHODS = {n for n in CONNECTOR_OWN if callable(getattr(Connector, n, None))}


def test_no_module_of_src_calls_an_underscore_method_of_the_connector():
    files = [f for f in sorted((ROOT / "src").rglob("*.py")) if f.name != "hub.py"]
    sources = {f.relative_to(ROOT): f.read_text() for f in files}
    assert len(CONNECTOR_METHODS) > 5
    assert calls_from_outside(sources, CONNECTOR_METHODS) == []


def test_a_call_of_an_underscore_method_from_another_module_is_flagged():
    text = "def bench(mgr):\n    mgr._records(None)\n    self._records(None)\n"
    assert calls_from_outside({"b.py": text}, CONNECTOR_METHODS) == ["b.py:2 ._records"]
