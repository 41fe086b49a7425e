# `make test` and `make serve` are the two commands a new user runs; both are idempotent and
# quick when nothing changed (the venv is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: the suite waits on servers, subprocesses and Ray as much as it computes,
# so two workers finish it sooner on a 2-core machine. A file runs whole on one worker (its
# fixtures set up once), the longest files first (`tests/conftest.py`'s LONGEST_FIRST; hence
# `--no-loadscope-reorder`, which keeps that order); two Ray-starting files may run at once,
# each on a Ray of its own. (`--dist loadgroup` would keep them apart, but xdist 3.8 marks groups
# in a node id field that pytest 9.2 no longer reads: it silently ran as `--dist load`.)
TEST_WORKERS ?= 2
# The suite's processes write and read bytecode (`env -u PYTHONDONTWRITEBYTECODE`: this image
# sets it, so each of the suite's few hundred processes, Ray's replicas and engine actors among
# them, compiled Cleave's modules anew: 0.24-0.36 s more CPU per process for the router's or
# an engine's imports) and run one torch thread each (`OMP_NUM_THREADS=1` unless set: two
# workers' two-thread torch spun on two shared cores). On this 2-core machine, 2026-11-30, runs
# one after another: 753 and 760 s of pytest as before, 726 s with one thread, 498 s with
# bytecode, 423 s with both.

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
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	    $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

serve: $(STAMP)
	$(VENV)/bin/cleave serve

clean:
	rm -rf $(VENV)
