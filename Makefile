# kvmesh developer entry points. `make run` and `make test` work on a fresh Debian machine as root;
# both call `make setup` (run: Python only; test: also `setup-dev`, the test tools), idempotently.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DISTS := libs/kvmesh services/worker services/router services/frontend services/planner bench cli
STAMP := $(VENV)/.kvmesh-setup-$(shell cat constraints.txt $(addsuffix /pyproject.toml,$(DISTS)) 2>/dev/null | md5sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: help setup setup-dev system-deps dev-deps protos lint typecheck test test-python test-bazel run bench clean

help:
	@echo "make run    - set up everything and start the local mesh (kvmesh up)"
	@echo "make test   - set up everything and run every check and test"
	@echo "make setup  - the Python venv and stubs that make run needs (idempotent)"
	@echo "make setup-dev - setup, plus the test tools: etcd, bazel, node + buf (idempotent)"

# `make run` needs only Python; the test tools (etcd, bazel, node for buf) come with setup-dev.
setup: system-deps $(STAMP) protos

setup-dev: setup dev-deps node_modules/.stamp

# apt-get install the Debian packages named by "command:package ..." pairs whose command is missing.
define apt_need
	@missing=""; \
	for pair in $(1); do command -v "$${pair%%:*}" >/dev/null || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "setup: installing$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "setup: need root to apt-get install$$missing" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
endef

system-deps:
	@python3 -c 'import venv, ensurepip' 2>/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null)

dev-deps:
	$(call apt_need,etcd:etcd-server etcdctl:etcd-client bazel:bazel-bootstrap node:nodejs npm:npm)

$(STAMP): constraints.txt $(addsuffix /pyproject.toml,$(DISTS))
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip 'setuptools>=68' wheel
	$(PIP) install -q -r constraints.txt
	$(PY) libs/kvmesh/gen_protos.py >/dev/null
	$(PIP) install -q --no-deps --no-build-isolation $(addprefix -e ,$(DISTS))
	@rm -f $(VENV)/.kvmesh-setup-*; touch $@

node_modules/.stamp: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# Stubs are build outputs: regenerate whenever a contract changes.
protos: $(STAMP)
	@$(PY) libs/kvmesh/gen_protos.py >/dev/null

lint: setup-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	node_modules/.bin/buf lint
	scripts/buf-breaking.sh
	$(MAKE) --no-print-directory typecheck

# mypy over every distribution's sources; the settings (strictness, paths) are in pyproject.toml.
typecheck: setup
	$(VENV)/bin/mypy

# tests/kserve_clients run stock tritonclient, whose stubs declare proto package `inference` like
# ours: the two cannot share one process's descriptor pool, hence two pytest processes.
test-python: setup-dev
	$(VENV)/bin/python -m pytest --ignore=tests/kserve_clients $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest tests/kserve_clients $(PYTEST_ARGS)

test-bazel: setup-dev
	@if command -v bazel >/dev/null; then \
	  PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel test //... || exit 1; \
	else echo "bazel not installed: skipping bazel test //..."; fi

test: lint test-python test-bazel

run: setup
	$(VENV)/bin/kvmesh up

clean:
	rm -rf $(VENV) node_modules .pytest_cache .ruff_cache .mypy_cache
	-command -v bazel >/dev/null && bazel clean --expunge
