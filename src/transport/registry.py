"""One registry of transfer backends, imported lazily.

``get_backend(name)`` imports a backend's module only when asked; a backend
whose package is missing raises :class:`BackendUnavailable` naming the pip
extra that installs it (or, for mori and ascend, the hardware stack they
need). Third-party backends register a module under the entry-point group
``pd_lifecycle.backends``; the module must expose ``MANAGER``, ``SENDER``,
``RECEIVER`` and optionally ``BOOTSTRAP`` and ``probe()``.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType
from typing import Any

import attrs

from transport.errors import BackendUnavailable, UnknownBackend

__all__ = [
    "Backend",
    "BackendSpec",
    "BUILTIN",
    "get_backend",
    "known_backends",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "pd_lifecycle.backends"


@attrs.frozen
class BackendSpec:
    name: str
    module: str | None  # None: needs hardware this package does not drive
    fix: str


@attrs.frozen
class Backend:
    """A loaded backend: the classes an engine instantiates."""

    name: str
    manager: Any
    sender: Any
    receiver: Any
    bootstrap: Any | None


BUILTIN: dict[str, BackendSpec] = {
    "fake": BackendSpec("fake", "transport.backends.fake_backend", "it ships with pd-lifecycle"),
    "mooncake": BackendSpec(
        "mooncake",
        "transport.backends.mooncake",
        "Install it with `pip install 'pd-lifecycle[mooncake]'` (and Debian's libibverbs1)",
    ),
    "nixl": BackendSpec(
        "nixl",
        "transport.backends.nixl",
        "Install it with `pip install 'pd-lifecycle[nixl]'` (needs torch installed first)",
    ),
    "mori": BackendSpec(
        "mori",
        None,
        "mori needs AMD GPUs with its ROCm stack; use it from an engine built for that hardware",
    ),
    "ascend": BackendSpec(
        "ascend",
        None,
        "ascend needs Huawei Ascend NPUs with the CANN stack; use it on that hardware",
    ),
}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> list[str]:
    return sorted(set(BUILTIN) | set(_entry_points()))


def _from_module(name: str, mod: ModuleType) -> Backend:
    probe = getattr(mod, "probe", None)
    if probe is not None:
        probe()
    try:
        backend = Backend(
            name=name,
            manager=mod.MANAGER,
            sender=mod.SENDER,
            receiver=mod.RECEIVER,
            bootstrap=getattr(mod, "BOOTSTRAP", None),
        )
    except AttributeError as e:
        raise BackendUnavailable(
            name,
            f"module {mod.__name__} lacks {e.name}",
            "it must define MANAGER, SENDER, RECEIVER",
        ) from None
    _check_shapes(backend)
    return backend


def _check_shapes(b: Backend) -> None:
    """Every class has the methods of its protocol (:mod:`transport.protocols`),
    so a plugin that lacks one fails here, naming it, not mid-transfer."""
    from transport.protocols import BootstrapService, KVManager, KVReceiver, KVSender

    pairs = [
        ("MANAGER", b.manager, KVManager),
        ("SENDER", b.sender, KVSender),
        ("RECEIVER", b.receiver, KVReceiver),
    ]
    if b.bootstrap is not None:
        pairs.append(("BOOTSTRAP", b.bootstrap, BootstrapService))
    for what, cls, proto in pairs:
        need = [m for m in _methods(proto) if not callable(getattr(cls, m, None))]
        if need:
            raise BackendUnavailable(
                b.name,
                f"its {what} {getattr(cls, '__name__', cls)!r} lacks {', '.join(need)}",
                f"implement the {proto.__name__} protocol of transport.protocols",
            )


def _methods(proto: type) -> list[str]:
    return [m for m in vars(proto) if not m.startswith("_") and callable(getattr(proto, m))]


def get_backend(name: str) -> Backend:
    """Load backend ``name`` (case-insensitive); :class:`UnknownBackend` for a
    name no backend answers to, or a value that is not a string."""
    if not isinstance(name, str):
        raise UnknownBackend(name, known_backends())
    key = name.lower()
    if key in BUILTIN:
        spec = BUILTIN[key]
        if spec.module is None:
            raise BackendUnavailable(key, "its hardware stack is not present here", spec.fix)
        try:
            mod = importlib.import_module(spec.module)
        except ImportError as e:
            raise BackendUnavailable(key, f"cannot import it ({e})", spec.fix) from None
        return _from_module(key, mod)
    eps = _entry_points()
    if key in eps:
        try:
            mod = eps[key].load()
        except ImportError as e:
            raise BackendUnavailable(
                key, f"its entry point {eps[key].value} failed to import ({e})", "reinstall it"
            ) from None
        return _from_module(key, mod)
    raise UnknownBackend(name, known_backends())
