"""SGLang 0.5.23's own Mooncake KV connector moves the bench's scattered pages
between a prefill and a decode process on 127.0.0.1: two requests through
``tests/field/sglang_transfer.py``, every byte checked on decode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("sglang_transfer.py")
RUN_TIMEOUT_S = 150  # three processes importing SGLang on two cores: about 20 s


def _mooncake_missing() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for a missing libibverbs
        return (
            f"the Mooncake engine is not importable in {sys.executable} "
            f"({type(exc).__name__}: {exc}); install mooncake-transfer-engine "
            "(make field-env) and Debian's libibverbs1 (make sysdeps)"
        )
    return None


MOONCAKE_MISSING = _mooncake_missing()


@pytest.mark.network
@pytest.mark.multiprocess
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=MOONCAKE_MISSING or "")
def test_sglang_mooncake_moves_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "sglang_mooncake.json"
    cmd = [sys.executable, str(HARNESS), "--backend", "mooncake", "--reps", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"harness failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    line = proc.stdout.strip().splitlines()[-1]
    assert "GB/s median of 2 request(s)" in line and "bytes verified" in line, line
    assert "MISMATCH" not in line, line
    result = json.loads(out.read_text())
    assert len(result["seconds"]) == 2 and all(s > 0 for s in result["seconds"])
    assert result["bytes_verified"] == result["expected_bytes"] == 2 * (64 * 2**20 + 64)
