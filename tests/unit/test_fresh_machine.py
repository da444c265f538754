"""A machine without Debian's libibverbs1: `make` installs it when it can,
says what to install when it cannot, and the Mooncake tests skip."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def stubs(tmp_path, uid, apt_rc=0):
    """A PATH where ldconfig finds no libibverbs, `id -u` says ``uid`` and
    apt-get records its arguments."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "apt.log"
    scripts = {
        "ldconfig": "exit 0",
        "id": f"echo {uid}",
        "apt-get": f'echo "$@" >> {log}; exit {apt_rc}',
    }
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    # a suite run by `make test REQUIRE_SYSDEPS=1` (CI) passes that setting to
    # every make below it through MAKEFLAGS: each call here says its own
    outer = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "REQUIRE_SYSDEPS")
    env = {k: v for k, v in os.environ.items() if k not in outer}
    env["PATH"] = f"{bin_}:/usr/bin:/bin"
    return env, log


def sysdeps(env, *extra):
    return subprocess.run(
        ["make", "-s", "-C", str(ROOT), "sysdeps", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@needs_make
def test_without_root_make_says_in_one_line_what_to_install(tmp_path):
    env, log = stubs(tmp_path, uid=1000)
    proc = sysdeps(env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "apt-get install libibverbs1" in lines[0]
    assert not log.exists()


@needs_make
def test_as_root_make_installs_it_with_apt(tmp_path):
    env, log = stubs(tmp_path, uid=0)
    proc = sysdeps(env)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "update -qq"
    assert calls[1].split()[-1] == "libibverbs1" and calls[1].startswith("install -y")


@needs_make
def test_a_failed_install_skips_locally_and_fails_ci(tmp_path):
    env, _ = stubs(tmp_path, uid=0, apt_rc=100)
    proc = sysdeps(env)
    assert proc.returncode == 0
    assert "could not install libibverbs1" in proc.stdout
    assert sysdeps(env, "REQUIRE_SYSDEPS=1").returncode != 0


def test_mooncake_tests_skip_when_the_engine_cannot_load_its_library(tmp_path):
    # this machine has the library: make the import fail as it does without it
    boot = tmp_path / "boot.py"
    boot.write_text(
        textwrap.dedent(
            """
            import sys

            import pytest


            class NoVerbs:
                def find_spec(self, name, path=None, target=None):
                    if name == "mooncake.engine" or name.startswith("mooncake.engine."):
                        raise ImportError(
                            "libibverbs.so.1: cannot open shared object file: "
                            "No such file or directory"
                        )
                    return None


            sys.meta_path.insert(0, NoVerbs())
            sys.exit(pytest.main(sys.argv[1:]))
            """
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(boot),
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "unit" / "test_mooncake_quirks.py"),
            str(ROOT / "tests" / "unit" / "test_mooncake_batches.py"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
    )
    # every test skipped, none collected: pytest's "no tests ran" (5), not an error (2)
    assert proc.returncode == 5, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("2 skipped")
    assert proc.stdout.count("libibverbs1") >= 2
