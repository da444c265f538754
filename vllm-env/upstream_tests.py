"""Fetch vLLM 0.34.0's own scheduler-level connector tests for
``make vllm-upstream-test``.

They are not part of this repository: this script downloads vLLM's source
release from PyPI (checked against its sha256), and unpacks only the test
files the plugin ``tests/vllm/upstream/pdlife_upstream.py`` names (with the
package files and the ``utils.py``/``conftest.py`` they import) under
``.cache/vllm-upstream``. The download is kept in ``.cache`` and reused while
its hash matches.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.34.0"
URL = (
    "https://files.pythonhosted.org/packages/92/21/"
    "6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz"
)
SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
SDIST = CACHE / f"vllm-{VERSION}.tar.gz"
OUT = CACHE / "vllm-upstream"
UNIT = "tests/v1/kv_connector/unit"
SUPPORT = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/kv_connector/__init__.py",
    f"{UNIT}/__init__.py",
    f"{UNIT}/conftest.py",
    f"{UNIT}/utils.py",
)


def _files() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location(
        "pdlife_upstream", ROOT / "tests/vllm/upstream/pdlife_upstream.py"
    )
    assert spec is not None and spec.loader is not None
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    return tuple(f"{UNIT}/{name}" for name in plugin.FILES)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch() -> None:
    CACHE.mkdir(exist_ok=True)
    if not SDIST.exists() or _digest(SDIST) != SHA256:
        part = SDIST.with_suffix(".part")
        with urllib.request.urlopen(URL, timeout=300) as r, part.open("wb") as f:
            shutil.copyfileobj(r, f)
        got = _digest(part)
        if got != SHA256:
            part.unlink()
            sys.exit(f"upstream_tests: {URL} has sha256 {got}, expected {SHA256}; not used")
        part.replace(SDIST)
    shutil.rmtree(OUT, ignore_errors=True)
    wanted = {f"vllm-{VERSION}/{p}": p for p in SUPPORT + _files()}
    with tarfile.open(SDIST) as tar:
        for member in tar.getmembers():
            rel = wanted.pop(member.name, None)
            if rel is None or not member.isfile():
                continue
            src = tar.extractfile(member)
            assert src is not None
            dest = OUT / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(src.read())
    if wanted:
        sys.exit(f"upstream_tests: vllm-{VERSION}.tar.gz lacks {sorted(wanted.values())}")
    print(f"upstream_tests: {len(SUPPORT) + len(_files())} files of vLLM {VERSION} in {OUT}")


if __name__ == "__main__":
    fetch()
