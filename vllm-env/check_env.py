"""Fail the .venv-vllm build when a package there lacks a dependency it needs.

Run with the venv's own Python after the --no-deps installs (Makefile target
vllm-env). `pip check` lists every unmet requirement; three kinds are unmet on
purpose (see vllm-env/requirements.txt) and are counted, not failed:

- vllm's requirements that are not installed: vllm is installed with
  --no-deps, and its serving stack is not needed by the modules under test.
  A requirement of vllm that IS installed at a version vllm refuses still
  fails, with one exception below: the lock must agree with vllm's own pins.
- vllm's torch==2.14.0: torch is 2.14.1 here, the build this machine's
  indexes hold (the same torch as .venv-field). Any other torch fails.
- torch's cuda-toolkit and cuda-bindings: libraries `import torch` never loads.

Anything else (say a dependency added to pyproject.toml but not to the lock)
fails the build with pip check's own line.
"""

from __future__ import annotations

import re
import subprocess
import sys

# torch 2.14.1 requirements left out on purpose (their extras bring the rest)
OMITTED_BY_TORCH = {"cuda-toolkit", "cuda-bindings"}
# the one installed version vllm's metadata refuses, and the version it is
TORCH_INSTEAD = "2.14.1"
MISSING = re.compile(
    r"^(?P<pkg>\S+) \S+ requires (?P<dep>[A-Za-z0-9._-]+).*, which is not installed\.$"
)
WRONG = re.compile(
    r"^(?P<pkg>\S+) \S+ has requirement (?P<dep>[A-Za-z0-9._-]+)\S*, "
    r"but you have (?P<have_name>\S+) (?P<have>\S+)\.$"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def classify(line: str) -> str | None:
    """The omission a pip check line is, or None when it is not one of them."""
    m = MISSING.match(line)
    if m and canonical(m["pkg"]) == "vllm":
        return "vllm"
    if m and canonical(m["pkg"]) == "torch" and canonical(m["dep"]) in OMITTED_BY_TORCH:
        return "torch"
    w = WRONG.match(line)
    if (
        w
        and canonical(w["pkg"]) == "vllm"
        and canonical(w["dep"]) == "torch"
        and w["have"] == TORCH_INSTEAD
    ):
        return "vllm-torch"
    return None


def main() -> int:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    ).stdout
    expected = {"vllm": 0, "torch": 0, "vllm-torch": 0}
    unexpected = []
    for line in out.splitlines():
        if not line.strip() or line.startswith("No broken requirements"):
            continue
        kind = classify(line)
        if kind is None:
            unexpected.append(line)
        else:
            expected[kind] += 1
    if unexpected:
        print("vllm-env: unmet requirements that vllm-env/requirements.txt must cover:")
        for line in unexpected:
            print("  " + line)
        return 1
    print(
        f"vllm-env: dependencies complete, except {expected['vllm']} of vllm's "
        f"(its serving stack), its torch pin (torch is {TORCH_INSTEAD} here) and "
        f"{expected['torch']} of torch's (CUDA libraries it does not load), left out on purpose"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
