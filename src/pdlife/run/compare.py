"""``pdlife simulate --compare A B``: two runs' per-request outcomes, request by request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdlife.args import UsageError

__all__ = ["compare"]


def _outcomes(path: Path) -> dict[str, Any]:
    f = path / "summary.json" if path.is_dir() else path
    try:
        doc = json.loads(f.read_text())
    except OSError as e:
        raise UsageError(f"--compare {path}", f"cannot read {f} ({e.strerror})") from None
    except ValueError as e:
        raise UsageError(f"--compare {path}", f"{f} is not JSON ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("outcomes"), dict):
        raise UsageError(
            f"--compare {path}", f"{f} has no per-request outcomes; rerun it with this version"
        )
    return doc


def compare(a_dir: Path, b_dir: Path) -> int:
    """Diff two runs' per-request outcomes (room, status, reason, attempts); 1 if they differ."""
    a_doc, b_doc = _outcomes(a_dir), _outcomes(b_dir)
    a_out, b_out = a_doc["outcomes"], b_doc["outcomes"]
    rooms = sorted(set(a_out) | set(b_out), key=int)
    diffs = [r for r in rooms if a_out.get(r) != b_out.get(r)]
    label = f"{a_dir} ({a_doc.get('backend')}) vs {b_dir} ({b_doc.get('backend')})"
    if not diffs:
        print(
            f"compare: {label}: the {len(rooms)} requests end the same (room, status, reason, attempts)"
        )
        return 0
    r = diffs[0]

    def show(o: Any) -> str:
        if o is None:
            return "unfinished"
        tries = f" after {o[2]} attempts" if len(o) > 2 and o[2] != 1 else ""
        return (f"{o[0]} ({o[1]})" if o[0] == "Failed" else o[0]) + tries

    print(
        f"compare: {label}: {len(diffs)} of {len(rooms)} requests differ; first: room {r}: "
        f"{show(a_out.get(r))} vs {show(b_out.get(r))}"
    )
    return 1
