"""Keep the engines' own output off the terminal of a ``pdlife`` command.

The engines write from C and C++, past Python: Mooncake's glog prints a
couple of lines at every start that no level silences (one of them an ``E``
line that is not an error), UCX prints to stdout. So a rank process that
runs an engine sends its file descriptors 1 and 2 to a log file of its own,
and gives Python's ``sys.stdout``/``sys.stderr`` the terminal back: what
``pdlife`` prints (a rank's one-line error, the summary) still shows, a
progress bar is never broken by a foreign line, and the engines' lines are
in the file when they are wanted. ``--verbose``, or an engine log variable
the user set, leaves everything on the terminal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from transport.engine_logs import engine_logs, user_set

__all__ = ["choose", "divert"]


def choose(verbose: bool) -> bool:
    """In the launcher, before any rank starts: set the engines' log levels
    (inherited by the ranks) and say whether ranks divert their output."""
    chosen = user_set()
    engine_logs(verbose=verbose)
    return not verbose and not chosen


def divert(path: Path | None) -> None:
    """In a rank process, before its engine starts: file descriptors 1 and 2
    go to ``path`` (None: nowhere), Python's own streams keep the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    keep_out, keep_err = os.dup(1), os.dup(2)
    target = os.devnull if path is None else str(path)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(keep_out, "w", buffering=1)
    sys.stderr = os.fdopen(keep_err, "w", buffering=1)
