# `make test` and `make serve` are the two commands a new user runs; both are idempotent and
# quick when nothing changed (the venv is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: the suite waits on servers, subprocesses and Ray as much as it computes,
# so two workers finish it sooner on a 2-core machine (a module stays on one worker; the modules
# that start a Ray run one after another: tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: test serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulls gigabytes of CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Lint and types first: they take seconds (mypy's first run a minute or two, then its cache) and
# fail before the long pytest run. Their settings are pyproject.toml's [tool.ruff] and [tool.mypy].
test: $(STAMP)
	$(PY) -m ruff check cluster router workers kvtransfer
	$(PY) -m mypy cluster router workers kvtransfer
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

serve: $(STAMP)
	$(VENV)/bin/cleave serve

clean:
	rm -rf $(VENV)
