# stagetree: `make demo` runs the example study, `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)

.PHONY: demo test venv bench clean browser

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/stagetree run examples/digits.py --workers 2 --out runs/demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q tests

# Debian's Chromium and chromedriver for the dashboard's browser tests (apt-get as root; the
# tests run this themselves when the browser is missing, and skip, saying why, where it cannot).
browser:
	bash infra/browser.sh

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
