# Two commands a newcomer needs: `make demo` and `make test`.
# Every install goes through constraints.txt (torch==2.13.0, a CPU build here).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS ?= dev,plot,mooncake,nixl,metrics
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test lint typecheck unit property integration bench deep clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install -q -c constraints.txt "torch==2.13.0"
	$(PIP) install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdlife simulate --out .demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy --strict src

test: lint typecheck
	$(PY) -m pytest -q

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

property: $(STAMP)
	$(PY) -m pytest -q tests/property

integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

deep: $(STAMP)
	HYPOTHESIS_PROFILE=deep $(PY) -m pytest -q tests/property --timeout=0

bench: $(STAMP)
	$(VENV)/bin/pdlife bench --json bench.json

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache
