# stagetree: `make demo` runs the example study, `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)

.PHONY: demo test venv lock test-oldest-torch test-floors bench clean browser

# The versions in constraints.txt: CI and every fresh machine test what last passed together.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip -c constraints.txt
	$(PY) -m pip install --quiet -e '.[test]' -c constraints.txt
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

# The newest versions pyproject.toml allows, written to constraints.txt (run `make test` next).
lock: $(STAMP)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[test]'
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable --all; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/stagetree run examples/digits.py --workers 2 --out runs/demo

# Two test files at a time (pytest-xdist; each file's tests in one process, in their order): a
# Kafka or end-to-end test waits on brokers and subprocesses part of the time, though starting
# those processes keeps the 2 cores busy too (30.2 -> 26 min on this machine, 2026-12-06).
PARALLEL := -n 2 --dist loadfile

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q $(PARALLEL) tests

# Debian's Chromium and chromedriver for the dashboard's browser tests (apt-get as root; the
# tests run this themselves when the browser is missing, and skip, saying why, where it cannot).
browser:
	bash infra/browser.sh

# The worker and end-to-end tests on the oldest torch pyproject.toml allows (the compose image's),
# in .venv-oldest-torch, and the compose services' commands on the local Kafka and MinIO (started
# as `make test` starts them): a few minutes to install, about 6 minutes to run; not in `make test`.
OLDEST_TORCH := 2.5.1
test-oldest-torch:
	test -x .venv-oldest-torch/bin/python || $(PYTHON) -m venv .venv-oldest-torch
	grep -v -E '^(torch|triton|nvidia-|sympy|mpmath|setuptools)=' constraints.txt > .venv-oldest-torch/constraints.txt
	.venv-oldest-torch/bin/python -m pip install --quiet "torch==$(OLDEST_TORCH)" -e '.[test]' \
		-c .venv-oldest-torch/constraints.txt
	STAGETREE_INFRA_PYTHON=$(CURDIR)/.venv-oldest-torch/bin/python .venv-oldest-torch/bin/python -m pytest -q \
		-p no:cacheprovider tests/test_training_session.py \
		tests/test_checkpoint_store.py tests/test_executor.py tests/test_worker_processes.py tests/test_worker_pipe.py \
		tests/test_e2e.py tests/test_checkpoint_budget.py tests/test_wsd_example.py tests/test_multi_study.py \
		tests/test_audit.py tests/test_bad_input.py \
		tests/test_kafka_cluster.py::test_the_compose_services_commands_run_a_study_here -k 'not minio'

# Every dependency pyproject.toml lists at the lowest version it allows (torch at OLDEST_TORCH; the
# test extras and the transitive dependencies resolved against them), in .venv-floors, and the
# whole suite there, Kafka and MinIO started as `make test` starts them: pyproject's floors are
# tested, not guessed. Two minutes to install from pip's cache, about 25 to run; not in `make test`.
test-floors:
	test -x .venv-floors/bin/python || $(PYTHON) -m venv .venv-floors
	$(PYTHON) tests/floors.py torch=$(OLDEST_TORCH) > .venv-floors/constraints.txt
	.venv-floors/bin/python -m pip install --quiet -e '.[test]' -c .venv-floors/constraints.txt
	STAGETREE_INFRA_PYTHON=$(CURDIR)/.venv-floors/bin/python .venv-floors/bin/python -m pytest -q \
		-p no:cacheprovider $(PARALLEL) tests

bench: $(STAMP)
	$(PY) benchmarks/merge_savings.py

clean:
	rm -rf runs .pytest_cache

# Local Kafka (KRaft, 127.0.0.1:9092) and MinIO (127.0.0.1:9000) for Kafka mode and its tests;
# writes .infra/env (source it). First run builds MinIO from source: several minutes.
.PHONY: infra-up infra-down
infra-up: $(STAMP)
	bash infra/up.sh

infra-down:
	bash infra/down.sh
