"""Tests against the real SGLang 0.5.23, in .venv-field.

They run through `make field-test`, which builds that venv first (`make
field-env`); the main suite does not collect them (pyproject's testpaths). In
any other Python every test here fails, with one line saying so: nothing is
skipped.
"""

from __future__ import annotations

import sys
import warnings

import pytest

# Import-time warnings of SGLang's import chain, not what these tests look at:
# its quantization modules on a machine without CUDA ("Only CUDA, HIP and XPU
# support AWQ currently.", ...), and sentencepiece's SWIG types (imported
# through transformers), which also warn once more at interpreter exit.
SWIG_TYPES = r"builtin type (SwigPyPacked|SwigPyObject|swigvarlink) has no __module__ attribute"
IMPORT_WARNINGS = (
    r"ignore::UserWarning:sglang\.",
    f"ignore:{SWIG_TYPES}:DeprecationWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in IMPORT_WARNINGS:
        config.addinivalue_line("filterwarnings", line)


def pytest_unconfigure(config: pytest.Config) -> None:
    # for the exit-time one, after pytest has put the filters back
    warnings.filterwarnings("ignore", message=SWIG_TYPES, category=DeprecationWarning)


def _sglang_missing() -> str | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang  # noqa: F401
    except Exception as exc:
        return (
            f"sglang is not importable in {sys.executable} ({type(exc).__name__}: {exc}); "
            "these tests need .venv-field: run `make field-env` (or `make field-test`, "
            "which builds it and runs them there)"
        )
    return None


SGLANG_MISSING = _sglang_missing()


def pytest_runtest_call(item: pytest.Item) -> None:
    # before the test body: each test FAILS (not errors, not skips) with that line
    if SGLANG_MISSING is not None:
        pytest.fail(SGLANG_MISSING, pytrace=False)
