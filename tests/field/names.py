"""The public names a module defines, with their kinds and signatures.

A helper for building and checking the compatible surface, not a test:
`defined_names(module)` lists what the module itself defines, and
`python tests/field/names.py` (in .venv-field) prints it as a markdown table
for sglang.srt.disaggregation.utils and sglang.srt.disaggregation.base.conn
(other modules: name them as arguments; ``--members`` adds, under each class
the module defines, the members that class itself defines: `class_members`).

Which names count (the rule):

- public: the name does not start with an underscore, and the module has it
  at run time (in its ``__dict__``); modules are never listed;
- a class or a routine (function, builtin, method descriptor, or any callable
  with ``__wrapped__``) counts when its ``__module__`` is the module's own
  name: one imported from elsewhere keeps its home module there. One whose
  home is elsewhere but that the module binds by an assignment of its own
  (``Alias = other.Thing``, see below) is listed too, its kind marked
  ``(alias of home.Qualname)``;
- any other object (a constant, a logger, a TypeVar, an instance) carries no
  reliable home, so it counts when the module's own source binds the name by
  an assignment at module level (``=``, annotated, augmented or walrus; in
  top-level ``if``/``try``/``with``/``for`` blocks too) and binds it by no
  import statement there. Without the source (a compiled module) such names
  are left out: where one cannot tell, the name is not listed.

Columns: the name; its kind (class, abstract class, enum, dataclass,
function, async function, or ``value: <type>``); the signature, which is
``str(inspect.signature(obj))`` for functions and classes (annotations as the
module wrote them, strings under ``from __future__ import annotations``),
the members for an enum (its call signature is Enum's own), the ``repr`` for
a value (cut at 80 characters), and empty where inspect has none.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import sys
import types
import warnings
from typing import Any, NamedTuple

MODULES = ("sglang.srt.disaggregation.utils", "sglang.srt.disaggregation.base.conn")
REPR_MAX = 80


class Name(NamedTuple):
    name: str
    kind: str
    signature: str


def _assigned_and_imported(module: types.ModuleType) -> tuple[set[str], set[str]]:
    """Names bound at module level by assignments, and by imports."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return set(), set()
    assigned: set[str] = set()
    imported: set[str] = set()

    def targets(node: ast.AST) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                assigned.add(sub.id)

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    targets(target)
            elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
                targets(stmt.target)
            elif isinstance(stmt, ast.Import | ast.ImportFrom):
                for alias in stmt.names:
                    imported.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(stmt, ast.Expr):
                for sub in ast.walk(stmt):
                    if isinstance(sub, ast.NamedExpr):
                        targets(sub.target)
            elif isinstance(stmt, ast.If | ast.For | ast.While | ast.With):
                visit(stmt.body)
                visit(getattr(stmt, "orelse", []))
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
                for handler in stmt.handlers:
                    visit(handler.body)
                visit(stmt.orelse)
                visit(stmt.finalbody)

    visit(ast.parse(source).body)
    return assigned, imported


def _is_routine(obj: Any) -> bool:
    return inspect.isroutine(obj) or (callable(obj) and hasattr(obj, "__wrapped__"))


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _describe(obj: Any) -> tuple[str, str]:
    if inspect.isclass(obj):
        if issubclass(obj, enum.Enum):
            members = ", ".join(f"{m.name}={m.value!r}" for m in obj)
            return "enum", "{" + members + "}"
        if dataclasses.is_dataclass(obj):
            kind = "dataclass"
        elif inspect.isabstract(obj):
            kind = "abstract class"
        else:
            kind = "class"
        return kind, _signature(obj)
    if _is_routine(obj):
        kind = "async function" if inspect.iscoroutinefunction(obj) else "function"
        return kind, _signature(obj)
    text = repr(obj)
    if len(text) > REPR_MAX:
        text = text[: REPR_MAX - 3] + "..."
    return f"value: {type(obj).__qualname__}", f"= {text}"


def defined_names(module: types.ModuleType) -> list[Name]:
    """The public names `module` defines (see the module docstring), sorted."""
    assigned, imported = _assigned_and_imported(module)
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        bound_here = name in assigned and name not in imported
        alias_of = ""
        if inspect.isclass(obj) or _is_routine(obj):
            home = getattr(obj, "__module__", None)
            if home != module.__name__:
                if not bound_here:
                    continue
                alias_of = f" (alias of {home}.{getattr(obj, '__qualname__', '?')})"
        elif not bound_here:
            continue
        kind, signature = _describe(obj)
        names.append(Name(name, kind + alias_of, signature))
    return sorted(names)


def class_members(cls: type) -> list[Name]:
    """The public members `cls` itself defines (not inherited), as ``Class.member``.

    Kinds: method, classmethod, staticmethod, property, abstract method (or
    property), attribute (signature ``= repr``, or ``: annotation = repr``
    when the class body annotates it; the kind then has no type, the
    annotation says it) and, for a name only annotated in the class body,
    annotation (signature ``: annotation``). Enum members are left out: the
    class's own row lists them.
    """
    members = []
    own = vars(cls)
    annotations = {
        name: ann if isinstance(ann, str) else inspect.formatannotation(ann)
        for name, ann in inspect.get_annotations(cls).items()
    }
    for name, raw in own.items():
        if name.startswith("_") or (issubclass(cls, enum.Enum) and name in cls.__members__):
            continue
        if isinstance(raw, staticmethod | classmethod):
            kind, signature = type(raw).__name__, _signature(getattr(cls, name))
        elif isinstance(raw, property):
            kind, signature = "property", _signature(raw.fget) if raw.fget else ""
        elif inspect.isfunction(raw):
            kind, signature = "method", _signature(raw)
        elif inspect.isclass(raw):
            kind, signature = _describe(raw)
        elif name in annotations:
            kind, signature = "attribute", f": {annotations[name]} {_describe(raw)[1]}"
        else:
            kind, signature = _describe(raw)
            kind = "attribute" + kind.removeprefix("value")
        if getattr(raw, "__isabstractmethod__", False):
            kind = f"abstract {kind}"
        members.append(Name(f"{cls.__name__}.{name}", kind, signature))
    for name, text in annotations.items():
        if not name.startswith("_") and name not in own:
            members.append(Name(f"{cls.__name__}.{name}", "annotation", f": {text}"))
    return sorted(members)


def markdown_table(module: types.ModuleType, members: bool = False) -> str:
    """name | kind | signature; with `members`, each defined class's own members under it."""

    def cell(text: str) -> str:
        return "`" + text.replace("|", "\\|") + "`" if text else ""

    rows = ["| name | kind | signature |", "|---|---|---|"]
    for n in defined_names(module):
        rows.append(f"| `{n.name}` | {n.kind} | {cell(n.signature)} |")
        obj = getattr(module, n.name)
        if members and inspect.isclass(obj) and "alias of" not in n.kind:
            rows += [f"| `{m.name}` | {m.kind} | {cell(m.signature)} |" for m in class_members(obj)]
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    """Usage: names.py [--members] [module ...] (default: the two modules of MODULES)."""
    import importlib

    members = "--members" in argv
    for name in [a for a in argv if a != "--members"] or MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
        print(f"### `{name}`\n\n{markdown_table(module, members)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
