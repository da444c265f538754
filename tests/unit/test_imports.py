"""Importing works without the optional packages, backends load lazily, and a
third-party backend is found through its entry point."""

import subprocess
import sys
import textwrap

import pytest

from transport.errors import BackendUnavailable
from transport.registry import ENTRY_POINT_GROUP, get_backend, known_backends

BLOCKER = """
import importlib.abc, sys

BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Block())
"""


def run_blocked(blocked, body):
    code = BLOCKER.format(blocked=sorted(blocked)) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


OPTIONAL = {"mooncake", "nixl", "nixl_cu12", "prometheus_client", "matplotlib"}


def test_import_lifecycle_needs_no_optional_package_nor_torch():
    out = run_blocked(
        OPTIONAL | {"torch", "transport", "hypothesis", "pytest"},
        """
        import lifecycle
        from lifecycle import RequestTable, SingleRank, Stepper
        from lifecycle.testing.doubles import StatusBoard

        t = RequestTable()
        t.extend([1, 2])
        b = StatusBoard()
        b.set([1, 2], 4)
        print(Stepper(t, 0, poller=b).step(SingleRank()).succeeded.tolist())
        loaded = sorted(
            m for m in sys.modules
            if m.split(".")[0] in ("transport", "buffers", "torch") or m == "pdlife"
        )
        print(loaded)
        """,
    )
    assert out.splitlines() == ["[1, 2]", "[]"]


def test_transport_imports_backends_only_when_asked():
    out = run_blocked(
        OPTIONAL,
        """
        import transport
        from transport.errors import BackendUnavailable
        from transport.registry import get_backend

        print(get_backend("fake").name)
        print(sorted(m for m in sys.modules if m in ("transport.backends.mooncake", "transport.backends.nixl")))
        try:
            get_backend("mooncake")
        except BackendUnavailable as e:
            print("unavailable", "pd-lifecycle[mooncake]" in str(e))
        try:
            get_backend("nixl")
        except BackendUnavailable as e:
            print("unavailable", "pd-lifecycle[nixl]" in str(e))
        """,
    )
    assert out.splitlines() == ["fake", "[]", "unavailable True", "unavailable True"]


def test_lifecycle_import_does_not_load_transport_or_tools():
    out = run_blocked(
        set(),
        """
        import lifecycle, field.step.consensus
        print(sorted(m for m in sys.modules if m.startswith(("transport", "pdlife"))))
        """,
    )
    assert out.strip() == "[]"


def make_plugin(root, name, body, module=None):
    module = module or f"{name}_backend"
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    dist = root / f"{name}_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {module}\n")


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for mod in [m for m in sys.modules if m.startswith(("acme", "broken", "partial"))]:
        del sys.modules[mod]


def test_a_backend_plugin_loads_through_its_entry_point(plugins):
    make_plugin(
        plugins,
        "acme",
        """
        class Manager:
            def poll_many(self, rooms, indices): return [1] * len(rooms)
        class Handle:
            def poll(self): return 1
            def failure_exception(self): return None
            def abort(self): pass
            def clear(self): pass
        class Sender(Handle):
            def init(self, num_pages, metadata_slot): pass
            def send(self, page_indices, state_indices=None): pass
        class Receiver(Handle):
            def init(self, prefill_dp_rank=None): pass
            def send_metadata(self, page_indices, metadata_slot, state_indices=None, decode_prefix_len=0): pass
        MANAGER, SENDER, RECEIVER = Manager, Sender, Receiver
        probed = []
        def probe():
            probed.append(True)
        """,
    )
    assert "acme" in known_backends()
    assert "acme_backend" not in sys.modules  # listed, not imported
    b = get_backend("ACME")
    assert (b.name, b.manager.__name__, b.sender.__name__, b.receiver.__name__) == (
        "acme",
        "Manager",
        "Sender",
        "Receiver",
    )
    assert b.bootstrap is None
    assert sys.modules["acme_backend"].probed == [True]


def test_a_broken_plugin_is_a_typed_error(plugins):
    make_plugin(plugins, "broken", "import not_a_module_anywhere\n")
    make_plugin(plugins, "partial", "MANAGER = object\n")
    with pytest.raises(BackendUnavailable, match="failed to import"):
        get_backend("broken")
    with pytest.raises(BackendUnavailable, match="SENDER"):
        get_backend("partial")


def test_a_plugin_missing_a_method_is_named_at_load(plugins):
    make_plugin(
        plugins,
        "acme",
        """
        class Manager:
            def poll_many(self, rooms, indices): return []
        class Sender:
            def init(self, n, slot): pass
        MANAGER, SENDER, RECEIVER = Manager, Sender, Sender
        """,
    )
    with pytest.raises(BackendUnavailable, match=r"SENDER 'Sender' lacks .*poll"):
        get_backend("acme")
