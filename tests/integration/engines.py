"""The transfer engines here: whether each can run, and what one prints itself
(told apart from what pdlife prints)."""

import importlib
import importlib.util
import os
import re

import pytest

#: a line a transfer engine wrote itself: glog (I/W/E/F, date, time) and its
#: pre-init notice, NIXL's logger, UCX
FOREIGN = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d|Logging before InitGoogleLogging|NIXL (INFO|WARN)|\bUCX\b",
    re.MULTILINE,
)


def engine_env() -> dict[str, str]:
    """The environment without an engine log level the user may have chosen."""
    from transport.engine_logs import VARIABLES

    return {k: v for k, v in os.environ.items() if k not in VARIABLES}


_MODULE = {"mooncake": "mooncake", "nixl": "nixl_cu12"}


def unusable(backend):
    """Why a byte-moving backend cannot run here, or None. A missing system library
    (libibverbs.so.1 for Mooncake) raises ImportError or OSError on import."""
    if importlib.util.find_spec(_MODULE[backend]) is None:
        return f"pd-lifecycle[{backend}] not installed"
    try:
        importlib.import_module("mooncake.engine" if backend == "mooncake" else "nixl_cu12")
    except (ImportError, OSError) as e:
        return (
            f"{backend} engine not usable here ({e}); install Debian's libibverbs1 "
            "(`apt-get install libibverbs1`, or `make install` as root)"
        )
    return None


def require(backend):
    """Skip the calling test, with the reason, if ``backend`` cannot run here."""
    why = None if backend == "fake" else unusable(backend)
    if why is not None:
        pytest.skip(why)
    return backend
