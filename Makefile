# Two commands a newcomer needs: `make demo` and `make test`.
# Every install goes through constraints.txt (torch==2.13.0, a CPU build here).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= dev,plot,mooncake,nixl,metrics,otel
STAMP  := $(VENV)/.installed-stamp

.PHONY: install sysdeps demo test lint typecheck bytecode unit property integration bench deep clean field-env field-bench field-bench-transfer field-test vllm-env vllm-test vllm-upstream-test vllm-bench

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q -c constraints.txt "torch==2.13.0"
	$(PIP) install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

# Debian's libibverbs1: the Mooncake engine's wheel links it. Installed when we
# can (root with apt-get, as on CI); otherwise one line says what to install, and
# the Mooncake tests skip with that reason. CI sets REQUIRE_SYSDEPS=1: there a
# failed install fails the run instead of skipping the tests.
REQUIRE_SYSDEPS ?=
sysdeps:
	@if ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing Debian's libibverbs1 (the Mooncake engine links it)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; } \
	    || { echo "make: could not install libibverbs1; the Mooncake backend and its tests will be skipped"; \
	         [ -z "$(REQUIRE_SYSDEPS)" ] || exit 1; }; \
	else \
	  echo "make: the Mooncake backend needs Debian's libibverbs1 (sudo apt-get install libibverbs1); until then its tests are skipped"; \
	fi

install: sysdeps $(STAMP)

demo: sysdeps $(STAMP)
	$(VENV)/bin/pdlife simulate --out .demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict src

# Where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) Python writes no
# .pyc, so every process a test starts compiled our sources again: about 0.8
# CPU-seconds per simulated run, 1.5 for one on NIXL. They are compiled once,
# before the tests (about a second); Python still reads a .pyc when it may not
# write one, and ignores it once its source changed (until the next compile).
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 src tests examples

# the suite runs on two workers (pytest-xdist): most integration tests wait on
# sockets and child processes, so two overlap well on two cores. The tests that
# build network namespaces may run on both at once (their namespaces are named
# by the worker's pid). They were meant to share one worker, but under pytest
# 9.2 `--dist loadgroup` groups nothing (pytest-xdist issue 1386), and the runs
# that passed had them on both: that is what they run as now.
WORKERS ?= 2
test: sysdeps lint typecheck bytecode
	$(PY) -m pytest -q -n $(WORKERS) --dist load

unit: bytecode
	$(PY) -m pytest -q tests/unit

property: bytecode
	$(PY) -m pytest -q tests/property

integration: bytecode
	$(PY) -m pytest -q tests/integration

deep: bytecode
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest -q tests/property --timeout=0

bench: $(STAMP)
	$(VENV)/bin/pdlife bench --json bench.json

# A second venv with the real SGLang 0.5.23, for the differential tests in
# tests/field: torch 2.14.1 + torchvision 0.29.1 (a CUDA build that runs on
# the CPU; SGLang's import chain needs torchvision, and PyPI's torchvision
# does not load beside the CPU torch 2.13.0), sglang without its serving
# stack, and this project with extras dev,mooncake,nixl. Every package is
# pinned in field-env/requirements.txt and installed with --no-deps, through
# field-env/constraints.txt instead of constraints.txt; check_env.py then
# fails the build if anything but the deliberate omissions is missing. Any
# change to those files or to pyproject.toml rebuilds the venv from scratch.
FIELD_PYTHON ?= $(PYTHON)
FIELD_VENV   ?= .venv-field
FIELD_PY     := $(FIELD_VENV)/bin/python
FIELD_STAMP  := $(FIELD_VENV)/.installed-stamp
FIELD_FILES  := field-env/requirements.txt field-env/constraints.txt field-env/check_env.py

$(FIELD_STAMP): pyproject.toml $(FIELD_FILES)
	@$(FIELD_PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || \
	  { echo "make: $(FIELD_VENV) needs CPython 3.11 (the pinned torch 2.14.1 and sglang wheels are cp311): make field-env FIELD_PYTHON=python3.11"; exit 1; }
	rm -rf $(FIELD_VENV)
	$(FIELD_PYTHON) -m venv $(FIELD_VENV)
	$(FIELD_PY) -m pip install -q --no-deps -c field-env/constraints.txt -r field-env/requirements.txt
	$(FIELD_PY) -m pip install -q --no-deps -c field-env/constraints.txt -e ".[dev,mooncake,nixl]"
	$(FIELD_PY) field-env/check_env.py
	touch $(FIELD_STAMP)

field-env: sysdeps $(FIELD_STAMP)

# pdlife bench where SGLang is importable: its own calls timed beside ours on the
# same requests (gated against gated, ungated against ungated); -W ignore hides
# its import chain's warnings. FIELD_BENCH_JSON names the JSON it writes.
FIELD_BENCH_JSON ?= bench-field.json
field-bench: field-env
	$(FIELD_PY) -W ignore -m pdlife bench --sizes 64,1024,4096,16384 --reps 200 --json $(FIELD_BENCH_JSON)

# the scattered-pages case (8 buffers of 256 pages of 32 KiB, destinations
# shuffled) through SGLang 0.5.23's own connector and through ours, alternated
# in one session: three rounds of 12 requests each, Mooncake then NIXL
field-bench-transfer: field-env $(STAMP)
	for i in 1 2 3; do for b in mooncake nixl; do \
	  $(FIELD_PY) tests/field/sglang_transfer.py --backend $$b --reps 12 || exit 1; \
	  $(VENV)/bin/pdlife bench-transfer --backend $$b --reps 12 --buffers 8 --page-kib 32 --shuffle || exit 1; \
	done; done

field-test: field-env
	$(FIELD_PY) -m compileall -q -j 0 src tests
	$(FIELD_PY) -m pytest -q -p no:cacheprovider tests/field

# A third venv with the real vLLM 0.34.0, for the tests in tests/vllm: torch
# 2.14.1 (the CUDA build of .venv-field, running on the CPU), vllm without its
# serving stack, and this project with extras dev,mooncake,nixl. Not
# .venv-field: vLLM and SGLang pin tokenizers, xgrammar, compressed-tensors
# and openai at versions the other refuses (docs/vllm-env.md). Built the same
# way: every package pinned in vllm-env/requirements.txt, installed with
# --no-deps through vllm-env/constraints.txt, then vllm-env/check_env.py.
VLLM_PYTHON ?= $(FIELD_PYTHON)
VLLM_VENV   ?= .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed-stamp
VLLM_FILES  := vllm-env/requirements.txt vllm-env/constraints.txt vllm-env/check_env.py

$(VLLM_STAMP): pyproject.toml $(VLLM_FILES)
	@$(VLLM_PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || \
	  { echo "make: $(VLLM_VENV) needs CPython 3.11 (the pinned torch 2.14.1 wheel is cp311): make vllm-env VLLM_PYTHON=python3.11"; exit 1; }
	rm -rf $(VLLM_VENV)
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --no-deps -c vllm-env/constraints.txt -r vllm-env/requirements.txt
	$(VLLM_PY) -m pip install -q --no-deps -c vllm-env/constraints.txt -e ".[dev,mooncake,nixl]"
	$(VLLM_PY) vllm-env/check_env.py
	touch $(VLLM_STAMP)

vllm-env: sysdeps $(VLLM_STAMP)

# HF_HUB_OFFLINE: the tests build vLLM's configs from a local config.json and
# must never reach for the Hugging Face hub (CI has no route to it).
vllm-test: vllm-env
	$(VLLM_PY) -m compileall -q -j 0 src tests
	HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm
	$(MAKE) vllm-upstream-test

# vLLM 0.34.0's own scheduler-level connector tests, run with
# PdLifecycleConnector in place of the connector they name: fetched from
# vLLM's source release on PyPI (sha256-pinned, into .cache; not committed)
# and run with the plugin in tests/vllm/upstream (docs/vllm.md lists the
# tests that differ, and why).
vllm-upstream-test: vllm-env
	$(VLLM_PY) vllm-env/upstream_tests.py
	cd .cache/vllm-upstream && HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/tests/vllm/upstream \
	  $(CURDIR)/$(VLLM_PY) -m pytest -q -p no:cacheprovider -p pdlife_upstream \
	  --rootdir . tests/v1/kv_connector/unit

# The worker side's per-iteration overhead (get_finished with the agreement
# step) against vLLM's count-based aggregation, at 64 and 1,024 loads in
# flight, on 2 TP workers over gloo on 127.0.0.1: a table, and bench-worker.json.
# Timings need a quiet machine (see `uptime`); the test in tests/vllm checks
# only that every column is there.
VLLM_BENCH_REPS ?= 300
vllm-bench: vllm-env
	HF_HUB_OFFLINE=1 $(VLLM_PY) tests/vllm/bench_worker_overhead.py \
	  --reps $(VLLM_BENCH_REPS) --n 64 1024 --json bench-worker.json

clean:
	rm -rf $(VENV) $(FIELD_VENV) $(VLLM_VENV) .cache .demo .pytest_cache .mypy_cache .ruff_cache
	find src tests examples -name __pycache__ -prune -exec rm -rf {} +
