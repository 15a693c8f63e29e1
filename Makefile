# Every target installs what it needs into .venv first; nothing else is required.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# uv installs the dependencies: the same set pip resolves, in a fraction of its time. Like
# pip, it compiles them to bytecode as it installs (uv does not unless asked): a Python run
# with PYTHONDONTWRITEBYTECODE set never writes it, and then compiles every module it
# imports, each time a process starts.
UV     := $(VENV)/bin/uv
UV_INSTALL := $(UV) pip install --quiet --compile-bytecode --python $(PY)
# pytest runs under gevent's monkey-patching launcher, so the standard library is
# patched before pytest, pymongo or requests import anything.
PYTEST := $(PY) -m gevent.monkey --module pytest

BENCH_STAMP := $(VENV)/.bench-stamp
FUZZ_EXAMPLES ?= 50000
SOAK_MINUTES ?= 10

VERSION   := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_TAG ?= fanout:$(VERSION)

.PHONY: setup demo test test-without-toolchains lint test-stress fuzz soak bench bench-operate clean trace-ui interop toolchains dist image image-smoke kube-play bench-group bench-dashboard bench-idle bench-alerts bench-profile docs docs-serve compat compat-engine ferretdb monitoring

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "Python 3.11 or newer is required")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv
	$(UV_INSTALL) -e ".[test,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fanout demo

# The demo's traces in a real Zipkin UI on loopback (Java 17; the jar comes from Maven Central).
# TRACE_UI_ARGS="--screenshots docs/tracing --exit" remakes the screenshots in docs/ (Chromium).
trace-ui: $(STAMP)
	$(VENV)/bin/fanout trace-ui $(TRACE_UI_ARGS)

# The whole suite. Tests needing a toolchain beyond Python (tests/support/toolchains.py:
# Thrift compiler, Go, Java, Maven, Node, podman) are skipped when it is missing, one line
# each in the header; FANOUT_REQUIRE_TOOLCHAINS=1 (as .ci/run sets) makes that an error.
# Five pytest processes at once (TEST_JOBS), each under gevent's patching, then the tests
# marked solo in one process alone: tests/parallel.py.
test: $(STAMP) lint
	$(PY) tests/parallel.py $(PYTEST_ARGS)

# Style and types, as `make test` checks them first: ruff's rules and formatting on the whole
# tree, mypy --strict on service/, lookups/ and tracing/, and on tests/ and bench/ with their
# functions' annotations optional (pyproject.toml says which rules, why).
# `ruff format .` and `ruff check --fix .` mend most of what they report.
lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --no-cache --check .
	$(VENV)/bin/mypy

# The tests that reach an optional program (redis-server, promtool, podman, the Thrift
# compiler, Java, openssl...), with all of those hidden from PATH: each must skip with the
# header's one line per toolchain, and none fail (tests/without_toolchains.py; CI runs it).
test-without-toolchains: $(STAMP)
	$(PY) tests/without_toolchains.py $(PYTEST_ARGS)

# The whole suite with two CPU-bound processes beside it, as a busy machine runs it: run it
# before you stop. STRESS_RUNS=N runs it N times in a row and stops at the first failure.
STRESS_RUNS ?= 1
test-stress: $(STAMP) lint
	$(PY) tests/stress.py --runs $(STRESS_RUNS) -- $(PYTEST_ARGS)

# Only the interop tests (about a minute on a clean machine, most of it downloads).
interop: $(STAMP) toolchains
	FANOUT_REQUIRE_TOOLCHAINS=1 $(PYTEST) tests/interop -p no:cacheprovider $(PYTEST_ARGS)

# The MongoDB panels on FerretDB 2 over PostgreSQL 15 with DocumentDB (about a minute on a
# fresh machine, 15 s once built): the engine is built and cached under build/compat (root:
# Debian's PostgreSQL packages, the extensions installed into PostgreSQL), then the MongoDB
# lookup tests and the end-to-end comparison with nx-27017 run on a throwaway cluster.
compat-engine:
	tests/compat/build-engine

# The tutorial's MongoDB-compatible server: FerretDB on that engine, seeded with the sample
# data, on 127.0.0.1:$(FERRETDB_PORT) until Ctrl-C (tests/compat/run-engine).
FERRETDB_PORT ?= 27018
ferretdb: $(STAMP) compat-engine
	$(PY) tests/compat/run-engine --port $(FERRETDB_PORT)

compat: $(STAMP) compat-engine
	FANOUT_TEST_MONGO_ENGINE=ferretdb FANOUT_REQUIRE_TOOLCHAINS=compat \
	  $(PYTEST) tests/test_lookups_mongo.py tests/test_cache_parts.py tests/test_compat.py -p no:cacheprovider $(PYTEST_ARGS)

# The Debian packages behind the commands those tests run, installed when missing and we may
# (root with apt-get); otherwise one line saying what is missing. Go, Java 17 with Maven and
# Node come with the machine.
TOOLCHAIN_PACKAGES := thrift:thrift-compiler podman:podman mmdebstrap:mmdebstrap runc:runc \
  redis-server:redis-server promtool:prometheus
toolchains:
	@missing=; for pair in $(TOOLCHAIN_PACKAGES); do command -v $${pair%%:*} >/dev/null 2>&1 \
	  || missing="$$missing $${pair#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing$$missing" >&2; apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "make: missing$$missing (apt-get install them as root); tests needing them are skipped" >&2; fi

# What operators install beside a service (deploy/monitoring/, docs/operations/): the SLO
# rules made from slos.yaml by Sloth (built once into build/tools with Go), and the
# Kubernetes PrometheusRule made from every rule file. Commit what it writes.
SLOTH := build/tools/sloth
$(SLOTH):
	GOBIN=$(abspath build/tools) go install github.com/slok/sloth/cmd/sloth@v0.16.0
monitoring: $(STAMP) $(SLOTH)
	$(SLOTH) generate --input deploy/monitoring/slos.yaml --out deploy/monitoring/rules/slo.rules.yaml
	$(PY) deploy/monitoring/prometheusrule.py

# The sdist and the wheel, as a release builds them, into build/dist.
dist: $(STAMP)
	rm -rf build/dist *.egg-info
	$(PY) -m build --outdir build/dist .

# The image (Containerfile) from that wheel, with podman state under ~/.cache/fanout/podman.
# BASE_IMAGE=docker.io/library/python:3.12-slim-bookworm builds on an official image instead.
image: dist toolchains
	deploy/image/build $(firstword $(wildcard build/dist/fanout-$(VERSION)-*.whl)) $(IMAGE_TAG)

# The image run with exactly the Deployment's command, args, env and security context.
# Requires only the image's toolchain (podman, mmdebstrap, runc), not every other one.
image-smoke: image
	FANOUT_REQUIRE_TOOLCHAINS=image FANOUT_IMAGE=localhost/$(IMAGE_TAG) \
	  $(PYTEST) tests/test_image.py -p no:cacheprovider $(PYTEST_ARGS)

# deploy/kubernetes played by `podman kube play` with that image: the pod starts, its probes
# answer, a call is answered, and it stops cleanly (the backends and ports substituted).
kube-play: image
	FANOUT_REQUIRE_TOOLCHAINS=image FANOUT_IMAGE=localhost/$(IMAGE_TAG) \
	  $(PYTEST) tests/test_image.py -k kube_play -p no:cacheprovider $(PYTEST_ARGS)

# The long fuzz run: the same properties as the suite's, many more examples.
fuzz: $(STAMP)
	FANOUT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTEST) tests/test_fuzz.py -p no:cacheprovider --timeout=0 $(PYTEST_ARGS)

# A bounded soak: mixed load, slow and failing backends, garbage connections.
soak: $(STAMP)
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(UV_INSTALL) -e ".[test,docs,bench]"
	touch $(BENCH_STAMP)

# The side-by-side benchmark (BENCH_ARGS=--quick for a short run); never part of `make test`.
bench: $(BENCH_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

# Probes and scrapes at 1,000 connections of overload, and reloads under load (about a minute).
bench-operate: $(BENCH_STAMP)
	$(PY) -m bench.operate $(OPERATE_ARGS)

# Several workers as one service: reloads, a killed and a stopped worker, the group's scrape,
# a backend going down, a slow TLS handshake (about two minutes; bench/group.py).
bench-group: $(BENCH_STAMP)
	$(PY) -m gevent.monkey --module bench.group $(GROUP_ARGS)

# Where a call's CPU goes: a sampling profile (py-spy) of the CPU-bound closed loop, by package
# and by our module, and strace's count of system calls per call, for Fanout and the
# hand-written gevent server (about two minutes; bench/profile.py).
bench-profile: $(BENCH_STAMP)
	$(PY) -m bench.profile $(PROFILE_ARGS)

# One idle `fanout serve` as shipped over the sample backends: its CPU a second, by thread,
# and with the hub monitor off (about two and a half minutes; bench/idle.py).
bench-idle: $(BENCH_STAMP)
	$(PY) -m bench.idle $(IDLE_ARGS)

# The shipped alerts on a real Prometheus (Debian's), with their own `for:`: two workers under
# traffic, MongoDB killed for 7 minutes and back, then a 20-second burst of refusals; each
# alert's state change, second by second (about 15 minutes; bench/alerts_trial.py).
bench-alerts: $(BENCH_STAMP)
	$(PY) -m gevent.monkey --module bench.alerts_trial --out docs/performance/alerts-trial.json $(ALERTS_ARGS)

# The results cache against no cache on FerretDB 2 (make compat first) and nx-27017, with many
# viewers of a sliding 24-hour dashboard, each run a whole bucket cycle; on FerretDB 2 also
# three instances sharing Redis, and Redis killed (about 25 minutes).
bench-dashboard: $(BENCH_STAMP)
	$(PY) -m gevent.monkey --module bench.dashboard $(DASHBOARD_ARGS)

# The manual (MkDocs, mkdocs.yml) into build/site, strict: a broken link, anchor or nav entry
# fails. Its reference and performance pages are made from the code and docs/performance/*.json.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The manual served at http://127.0.0.1:8000, rebuilt as pages change.
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
