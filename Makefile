# Every target installs what it needs into .venv first; nothing else is required.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# pytest runs under gevent's monkey-patching launcher, so the standard library is
# patched before pytest, pymongo or requests import anything.
PYTEST := $(PY) -m gevent.monkey --module pytest

BENCH_STAMP := $(VENV)/.bench-stamp
FUZZ_EXAMPLES ?= 50000
SOAK_MINUTES ?= 10

.PHONY: setup demo test fuzz soak bench clean trace-ui

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11 or newer is required")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fanout demo

# The demo's traces in a real Zipkin UI on loopback (Java 17; the jar comes from Maven Central).
# TRACE_UI_ARGS="--screenshots docs/tracing --exit" remakes the screenshots in docs/ (Chromium).
trace-ui: $(STAMP)
	$(VENV)/bin/fanout trace-ui $(TRACE_UI_ARGS)

test: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

# The long fuzz run: the same properties as the suite's, many more examples.
fuzz: $(STAMP)
	FANOUT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTEST) tests/test_fuzz.py -p no:cacheprovider --timeout=0 $(PYTEST_ARGS)

# A bounded soak: mixed load, slow and failing backends, garbage connections.
soak: $(STAMP)
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(BENCH_STAMP)

# The side-by-side benchmark (BENCH_ARGS=--quick for a short run); never part of `make test`.
bench: $(BENCH_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
