"""The package layers: buffers <- lifecycle <- transport <- field <- vllm_connector <- pdlife (tooling).

Each layer may import only the ones before it, including imports inside
functions, so ``import lifecycle`` can never pull in a transport or the
tooling, and there is no cycle between the packages.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ORDER = ["buffers", "lifecycle", "transport", "field", "vllm_connector", "pdlife"]


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


# -- inside a package: modules import one way, the step's core imports no driver --

PACKAGES = ["buffers", "lifecycle", "transport", "field", "vllm_connector", "pdlife"]
#: the sans-I/O step and the rules it executes; the drivers that do I/O
SANS_IO = ("lifecycle.core", "lifecycle.rules")
DRIVERS = ("lifecycle.drive",)
#: what only a driver may import: a network, processes, an event loop, torch
#: (threads are not I/O: the core keeps per-thread scratch arrays)
IO_MODULES = {"torch", "socket", "subprocess", "multiprocessing", "asyncio", "select"}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path) -> dict[str, set[str]]:
    """Every module under ``root`` and the modules of the same top package it
    imports: at the top, inside functions and under ``if TYPE_CHECKING``
    alike. ``from pkg import name`` counts as importing ``pkg.name`` when that
    is a module, else ``pkg`` (its ``__init__``)."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    up = up[: len(up) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                subs = {f"{base}.{a.name}" for a in node.names} & files.keys()
                out |= subs or {base}
                if len(subs) < len(node.names):
                    out.add(base)
        top = mod.split(".")[0]
        graph[mod] = {m for m in out if m in files and m != mod and m.split(".")[0] == top}
    return graph


def io_imports(root: Path, mod: str) -> set[str]:
    """The I/O modules ``mod`` imports itself (anywhere in it)."""
    path = root / (mod.replace(".", "/") + ".py")
    if not path.exists():
        path = root / mod.replace(".", "/") / "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out & IO_MODULES


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected parts of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_a_package(package):
    graph = {m: e for m, e in module_graph(SRC).items() if m.split(".")[0] == package}
    assert graph
    assert circles(graph) == [], f"import circles in {package}"


def test_the_sans_io_step_imports_no_driver():
    graph = module_graph(SRC)
    core = [m for m in graph if m.startswith(SANS_IO)]
    assert len(core) > 5
    bad = {
        m: sorted(x for x in reach(graph, m) if x.startswith(DRIVERS))
        for m in core
        if any(x.startswith(DRIVERS) for x in reach(graph, m))
    }
    assert bad == {}, f"the sans-I/O step reaches a driver: {bad}"
    io = {m: sorted(io_imports(SRC, m)) for m in core if io_imports(SRC, m)}
    assert io == {}, f"the sans-I/O step imports I/O: {io}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_circle_hidden_in_a_function_or_under_type_checking_is_seen(tmp_path):
    """Negative control: a back-import inside a function, or under
    ``TYPE_CHECKING``, closes a circle the scan names."""
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/hub.py": "from pkg.part import f\n",
            "pkg/part.py": "def f():\n    from pkg.hub import g\n",
            "pkg/typed.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from pkg import other\n",
            "pkg/other.py": "import pkg.typed\n",
            "pkg/fine.py": "from pkg import part\n",
        },
    )
    assert circles(module_graph(root)) == [["pkg.hub", "pkg.part"], ["pkg.other", "pkg.typed"]]


def test_a_core_module_importing_a_driver_is_seen(tmp_path):
    """Negative control: a core module that reaches a driver through another
    core module, and one that opens a socket, are both named."""
    root = _package(
        tmp_path,
        {
            "lifecycle/__init__.py": "",
            "lifecycle/core/__init__.py": "",
            "lifecycle/core/a.py": "from lifecycle.core import b\n",
            "lifecycle/core/b.py": "def late():\n    from lifecycle.drive.group import G\n",
            "lifecycle/core/c.py": "import socket\n",
            "lifecycle/drive/__init__.py": "",
            "lifecycle/drive/group.py": "from lifecycle.core import a\n",
        },
    )
    graph = module_graph(root)
    assert "lifecycle.drive.group" in reach(graph, "lifecycle.core.a")
    assert io_imports(root, "lifecycle.core.c") == {"socket"}


#: the connector's core does no I/O either: no clock, thread, socket, store or
#: engine (its driver, transport.connector.hub, owns them and tells it the time)
CONNECTOR_CORE = "transport.connector.core"
CONNECTOR_IO = {"socket", "select", "threading", "time", "asyncio", "subprocess", "torch"}
CONNECTOR_DRIVERS = (
    "transport.connector.hub",
    "transport.connector.mailbox",
    "transport.connector.handles",
    "transport.connector.inflight",
    "transport.backends",
    "transport.engine",
)
ENGINE_PACKAGES = {"mooncake", "nixl", "nixl_cu12"}


def connector_core_breaches(root: Path) -> dict[str, list[str]]:
    """What each module of the connector's core imports that it may not: an I/O
    module or an engine (its own imports), or a driver (reached through any)."""
    graph = module_graph(root)
    out = {}
    for m in sorted(graph):
        if m != CONNECTOR_CORE and not m.startswith(CONNECTOR_CORE + "."):
            continue
        path = root / (m.replace(".", "/") + ".py")
        if not path.exists():
            path = root / m.replace(".", "/") / "__init__.py"
        own = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                own |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                own.add(node.module.split(".")[0])
        bad = sorted(own & (CONNECTOR_IO | ENGINE_PACKAGES))
        bad += sorted(x for x in reach(graph, m) if x.startswith(CONNECTOR_DRIVERS))
        if bad:
            out[m] = bad
    return out


def test_the_connector_core_does_no_io():
    graph = module_graph(SRC)
    core = [m for m in graph if m.startswith(CONNECTOR_CORE + ".")]
    assert len(core) > 8
    assert connector_core_breaches(SRC) == {}


def test_a_connector_core_module_doing_io_is_seen(tmp_path):
    """Negative control: a core module that reads the clock, one that starts a
    thread, one that reaches the driver through another core module, and one
    that loads an engine are each named."""
    root = _package(
        tmp_path,
        {
            "transport/__init__.py": "",
            "transport/engine.py": "",
            "transport/connector/__init__.py": "",
            "transport/connector/hub.py": "from transport.connector.core import a\n",
            "transport/connector/core/__init__.py": "",
            "transport/connector/core/a.py": "import time\n",
            "transport/connector/core/b.py": "def later():\n    import threading\n",
            "transport/connector/core/c.py": "from transport.connector.core import d\n",
            "transport/connector/core/d.py": "from transport.connector import hub\n",
            "transport/connector/core/e.py": "from nixl_cu12 import _api\n",
            "transport/connector/core/f.py": "import numpy\n",
        },
    )
    got = connector_core_breaches(root)
    assert got["transport.connector.core.a"] == ["time"]
    assert got["transport.connector.core.b"] == ["threading"]
    assert "transport.connector.hub" in got["transport.connector.core.c"]
    assert got["transport.connector.core.e"] == ["nixl_cu12"]
    assert "transport.connector.core.f" not in got


#: the modules allowed past ``MAX_LINES``, each with the one concept that keeps
#: it whole; a budget to spend on readable code, not a reason to pack lines
MAX_LINES = 400
LONG_MODULES = {
    "lifecycle/core/step.py": "RawStepper, the one sans-I/O step protocol (prepare, resize, "
    "origins, apply and the calls the drivers use), under the theory of operation of the "
    "five stages",
    "lifecycle/table.py": "RequestTable: the request columns and every operation that keeps "
    "them consistent (add, remove, move, hand edits, the counts a step skips gathers by)",
    "lifecycle/core/observe.py": "the observe stage: polling the active rows (batch, by "
    "handle or as already polled) and containing every poll error as a verdict",
    "field/step/session.py": "Session: one queue's consensus kept across calls (the list's "
    "changes applied to its table, the poll, the step and the retirement of its rows)",
    "transport/connector/hub.py": "Connector, the driver of the connector's core: the "
    "scheduler's calls under one lock, and the thread's pass (messages, heartbeats, records, "
    "the engine's answers) with the effects it performs",
    "transport/connector/core/machine.py": "ConnectorCore: one rank's requests and the one "
    "entry through which every event, effect and scheduler call passes (the phases fired in "
    "batch, the writes and records it asks for)",
    "transport/connector/core/graph.py": "the connector's protocol graph: its declared edges, "
    "the tables compiled from them and their execution (a batch, or one request in Python "
    "integers), and the reference machine they are held to",
    "transport/connector/core/legs.py": "a request's legs: each side's leg machine (declared "
    "on the graph kernel, checked at import), the leg and request records, and the checks "
    "of what a leg writes",
    "transport/connector/core/prefill.py": "the prefill side of the protocol: a request's legs "
    "planned from decode's register, and every write of each leg checked and issued in order "
    "(pages, fields, state rows, the room last), each leg's end counted by its decode peer",
}


def line_budget_breaches(root: Path, waivers: dict[str, str]) -> list[str]:
    """What breaks the line budget under ``root``: a module over ``MAX_LINES``
    not in ``waivers``, and a waiver for a module that is no longer over it
    (or no longer exists); each names the module, its length and what to do."""
    lengths = {
        p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in root.rglob("*.py")
    }
    out = [
        f"{m} has {n} lines (over {MAX_LINES}): split it by concern, or, if it holds one "
        f"concept, waive it in LONG_MODULES with that concept as the reason"
        for m, n in sorted(lengths.items())
        if n > MAX_LINES and m not in waivers
    ]
    for m in sorted(waivers):
        if m not in lengths:
            out.append(f"{m} is waived in LONG_MODULES but does not exist: drop its waiver")
        elif lengths[m] <= MAX_LINES:
            out.append(
                f"{m} is waived in LONG_MODULES but has {lengths[m]} lines (not over "
                f"{MAX_LINES}): drop its waiver"
            )
    return out


def test_no_module_over_400_lines_unless_waived_and_no_folder_over_12_modules():
    assert all(reason.strip() for reason in LONG_MODULES.values())
    breaches = line_budget_breaches(SRC, LONG_MODULES)
    assert breaches == [], "\n".join(breaches)
    big = {
        str(d.relative_to(SRC)): n
        for d in [SRC, *[p for p in SRC.rglob("*") if p.is_dir()]]
        if (n := len(list(d.glob("*.py")))) > 12
    }
    assert big == {}, "folders of more than 12 modules"


def test_a_long_module_or_a_stale_waiver_is_seen(tmp_path):
    """Negative control: an unwaived long module, a waiver of a short module and
    a waiver of a missing one are each named with what to do; a waived long
    module passes."""
    long = "\n" * (MAX_LINES + 1)
    root = _package(
        tmp_path,
        {"pkg/long.py": long, "pkg/waived.py": long, "pkg/short.py": "\n" * MAX_LINES},
    )
    waivers = {"pkg/waived.py": "one concept", "pkg/short.py": "was long", "pkg/gone.py": "x"}
    breaches = line_budget_breaches(root, waivers)
    assert len(breaches) == 3
    assert f"pkg/long.py has {MAX_LINES + 1} lines" in breaches[0]
    assert "waive it in LONG_MODULES" in breaches[0]
    assert "pkg/gone.py" in breaches[1] and "does not exist" in breaches[1]
    assert f"pkg/short.py is waived in LONG_MODULES but has {MAX_LINES} lines" in breaches[2]
    assert line_budget_breaches(root, {"pkg/long.py": "a", "pkg/waived.py": "b"}) == []


def test_every_module_opens_with_its_responsibility():
    bare = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert bare == []


def test_the_public_surface_fits_on_one_screen():
    import lifecycle
    from lifecycle import protocols

    assert len(lifecycle.__all__) <= 25
    assert len(set(lifecycle.__all__)) == len(lifecycle.__all__)
    user_implements = {"BatchPoller", "Gate", "StagingGate", "MetadataSource", "FaultHook"}
    assert user_implements <= set(lifecycle.__all__)
    assert {
        n for n in user_implements if getattr(lifecycle, n) is getattr(protocols, n)
    } == user_implements
    assert all(hasattr(lifecycle, n) for n in lifecycle.__all__)


def test_no_two_test_files_share_a_name():
    """The test folders are not packages: pytest imports each file by its base
    name, so two of one name fail the whole run's collection (a subset run of
    either folder would not show it)."""
    from collections import Counter

    tests = Path(__file__).parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert {n: c for n, c in names.items() if c > 1} == {}


# -- a name is imported from the module that defines it, not through a shim --

#: the src/field modules that stand for one of the engine's modules: an engine
#: changes only the import, so each re-exports that module's names from wherever
#: ours are defined
ENGINE_MODULES = {
    "field.utils": "stands for sglang.srt.disaggregation.utils",
    "field.conn.base": "stands for sglang.srt.disaggregation.base.conn",
}


def defined_names(tree: ast.Module) -> set[str]:
    """The names a module binds itself at its top level (``if``, ``try`` and
    ``with`` blocks included): functions, classes and assignment targets; what
    it only imports is not among them."""
    out: set[str] = set()

    def targets(node: ast.AST) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                out.add(n.id)

    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets(node.target)
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.AsyncFor, ast.While)):
            todo += [*node.body, *node.orelse] if not isinstance(node, ast.With) else node.body
        if isinstance(node, ast.Try):
            todo += [*node.finalbody, *(s for h in node.handlers for s in h.body)]
    return out


def shim_imports(root: Path, exempt: dict[str, str]) -> list[str]:
    """Every ``from X import name`` under ``root`` (anywhere in a module, under
    ``TYPE_CHECKING`` too) where X is one of our modules, not a package's
    ``__init__`` nor in ``exempt``, and X does not define ``name`` (nor has it
    as a submodule): X only passes on what it imported."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    defined: dict[str, set[str]] = {}
    got: dict[str, dict[str, str]] = {}
    out = []
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                up = mod.split(".") if is_pkg else mod.split(".")[:-1]
                up = up[: len(up) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            target = files.get(base)
            if target is None or target.name == "__init__.py" or base in exempt:
                continue
            if base not in defined:
                tree = ast.parse(target.read_text())
                defined[base] = defined_names(tree)
                got[base] = {
                    a.asname or a.name: n.module or "." * n.level
                    for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom)
                    for a in n.names
                }
            for alias in node.names:
                name = alias.name
                if name != "*" and name not in defined[base] and f"{base}.{name}" not in files:
                    out.append(
                        f"{mod} imports {name} from {base}, which does not define it "
                        f"(it has it from {got[base].get(name, 'elsewhere')}): import it "
                        f"from the module that defines it"
                    )
    return sorted(set(out))


def test_no_module_imports_a_name_through_a_shim():
    assert all(m.startswith("field.") and r.strip() for m, r in ENGINE_MODULES.items())
    shims = shim_imports(SRC, ENGINE_MODULES)
    assert shims == [], "\n".join(shims)
    # an exemption is for a module that does pass names on: else it is stale
    stale = []
    for m in ENGINE_MODULES:
        path = SRC / (m.replace(".", "/") + ".py")
        if not path.exists():
            stale.append(f"{m} is exempt in ENGINE_MODULES but does not exist: drop it")
            continue
        tree = ast.parse(path.read_text())
        own = defined_names(tree)
        passed_on = [n for n in _all_of(tree) if n not in own]
        if not passed_on:
            stale.append(f"{m} is exempt in ENGINE_MODULES but passes on no name: drop it")
    assert stale == [], "\n".join(stale)


def _all_of(tree: ast.Module) -> list[str]:
    """The names a module's ``__all__`` lists (none without one)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def test_a_shim_is_seen(tmp_path):
    """Negative control: a name imported through a module that only imports it
    (at the top, in a function or under ``TYPE_CHECKING``) is named; imports of
    what a module defines, of a package's ``__init__`` and of an exempt module
    pass."""
    files = {
        "pkg/__init__.py": "from pkg.core import Thing\n",
        "pkg/core.py": "class Thing: ...\nLIMIT: int = 3\ndef f(): ...\n",
        "pkg/front.py": "from pkg.core import Thing\n",
        "pkg/engine.py": "from pkg.core import Thing\n",
        "pkg/user.py": "from pkg.core import Thing, LIMIT, f\nfrom pkg import Thing as T\n"
        "from pkg.engine import Thing as E\n",
    }
    clean = _package(tmp_path / "clean", files)
    assert shim_imports(clean, {"pkg.engine": "stands for an engine module"}) == []
    shimmed = _package(
        tmp_path / "shim",
        {
            **files,
            "pkg/late.py": "def g():\n    from pkg.front import Thing\n",
            "pkg/typed.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .front import Thing\n",
        },
    )
    assert shim_imports(shimmed, {"pkg.engine": "stands for an engine module"}) == [
        "pkg.late imports Thing from pkg.front, which does not define it (it has it "
        "from pkg.core): import it from the module that defines it",
        "pkg.typed imports Thing from pkg.front, which does not define it (it has it "
        "from pkg.core): import it from the module that defines it",
    ]
    assert len(shim_imports(shimmed, {})) == 3
