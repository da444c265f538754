import json
import subprocess
from pathlib import Path

import pytest
import zygote
from engines import FOREIGN, engine_env, require


def simulate(
    out: Path, backend: str, *args: str, fresh: bool = False
) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run `pdlife simulate` in a process of its own (a child of the zygote, or
    a fresh interpreter when ``fresh``); returns the process and summary.json.
    What it prints is its own: no engine's line reaches it."""
    proc = zygote.run(
        "simulate",
        "--backend",
        backend,
        "--quiet",
        "--no-timeline",  # the default run of test_simulate draws one
        "--out",
        str(out),
        *args,
        env=engine_env(),
        fresh=fresh,
    )
    foreign = FOREIGN.findall(proc.stdout + proc.stderr)
    assert not foreign, f"an engine's own lines reached the terminal: {foreign[:3]}"
    if backend != "fake":  # where they went instead: each rank's engine log
        assert list((out / "ranks").glob("*.engine.log")), "no engine log written"
    return proc, json.loads((out / "summary.json").read_text())


@pytest.fixture
def run_sim(tmp_path):
    def run(backend, name, *args, fresh=False):
        """``fresh``: in a fresh interpreter (the zygote's note on it)."""
        out = tmp_path / name
        proc, summary = simulate(out, backend, *args, fresh=fresh)
        return proc, summary, out

    return run


@pytest.fixture(params=["mooncake", "nixl"])
def backend(request):
    """Each byte-moving backend in turn (skipped where it cannot run)."""
    return require(request.param)


@pytest.fixture(params=["fake", "mooncake", "nixl"])
def any_backend(request):
    """The fake backend, then each byte-moving one (skipped where it cannot run)."""
    return require(request.param)
