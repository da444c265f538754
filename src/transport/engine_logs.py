"""How loud the transfer engines' own loggers are, declared once.

The engines log through their own channels, not Python's ``logging``:
Mooncake through glog (``MC_LOG_LEVEL``), NIXL through its C++ logger and a
``nixl`` Python logger that writes to stdout (``NIXL_LOG_LEVEL``), and UCX
under NIXL (``UCX_LOG_LEVEL``). Each is read once, when its engine loads, so
a backend sets its defaults before it imports the engine. A variable the
user has set is never touched.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["ENGINE_LOG_LEVELS", "VARIABLES", "engine_logs", "user_set"]

#: variable -> (quiet: errors only, the default; verbose: the engine's own detail)
ENGINE_LOG_LEVELS: dict[str, tuple[str, str]] = {
    "MC_LOG_LEVEL": ("ERROR", "INFO"),
    "NIXL_LOG_LEVEL": ("ERROR", "INFO"),
    "UCX_LOG_LEVEL": ("error", "warn"),
}
#: every variable a user may set to choose an engine's loudness (glog's own too)
VARIABLES: tuple[str, ...] = (*ENGINE_LOG_LEVELS, "GLOG_minloglevel")


def _check() -> None:
    for var, levels in ENGINE_LOG_LEVELS.items():
        if len(levels) != 2 or not all(levels):
            raise AssertionError(f"{var}: a quiet and a verbose level")


_check()


def engine_logs(verbose: bool = False, env: MutableMapping[str, str] | None = None) -> None:
    """Set each engine's log level (errors only, or ``verbose``) where the user
    has not chosen one; call it before an engine is imported."""
    target = os.environ if env is None else env
    for var, (quiet, loud) in ENGINE_LOG_LEVELS.items():
        target.setdefault(var, loud if verbose else quiet)


def user_set(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether the user chose an engine's loudness (then nothing is hidden):
    a variable set to anything but the quiet level a backend sets itself."""
    target = os.environ if env is None else env
    quiet = {var: levels[0] for var, levels in ENGINE_LOG_LEVELS.items()}
    return any(v in target and target[v] != quiet.get(v) for v in VARIABLES)
