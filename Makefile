# Every target installs what it needs into .venv first; nothing else is required.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# pytest runs under gevent's monkey-patching launcher, so the standard library is
# patched before pytest, pymongo or requests import anything.
PYTEST := $(PY) -m gevent.monkey --module pytest

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11 or newer is required")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fanout demo

test: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
