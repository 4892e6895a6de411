#!/usr/bin/env bash
# Installable (issue 15.9): every distribution builds a wheel with `python -m build --wheel`, and a
# fresh venv holding only those wheels and their dependencies (pinned by constraints.txt) runs the
# whole mesh: `kvmesh up --tls` must serve its demo request over mTLS.
# --wheel builds from the source tree (an sdist would leave ../../protos behind: the kvmesh wheel
# generates its stubs from it at build time).
set -euo pipefail
cd "$(dirname "$0")/.."
DISTS=(libs/kvmesh services/worker services/router services/frontend services/planner bench cli)
work="$(mktemp -d /tmp/kvmesh-wheels.XXXXXX)"
trap 'rm -rf "$work"' EXIT
for dist in "${DISTS[@]}"; do
  .venv/bin/python -m build --wheel --outdir "$work/dist" "$dist" >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log"; echo "test-wheels: $dist did not build" >&2; exit 1; }
done
ls "$work/dist"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q -c constraints.txt "$work"/dist/*.whl
cd "$work"  # nothing from the checkout on sys.path
for daemon in kvmesh-worker kvmesh-router kvmesh-frontend kvmesh-planner; do
  "$work/venv/bin/$daemon" --help >/dev/null
done
mkdir -m 700 "$work/discovery"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$work/venv/bin/kvmesh" up --tls --grpc-port "$port" --speedup-ratio 0 --discovery "file://$work/discovery/d" \
  --log-dir "$work/logs" --ready-timeout 90 >"$work/up.out" 2>&1 &
up=$!
for _ in $(seq 1 120); do
  grep -q "demo request" "$work/up.out" && break
  kill -0 "$up" 2>/dev/null || break
  sleep 1
done
kill -TERM "$up" 2>/dev/null || true  # not INT: background jobs of a script ignore SIGINT
wait "$up" || true
grep -q "demo request: " "$work/up.out" || {
  cat "$work/up.out"; tail -20 "$work"/logs/*.log; echo "test-wheels: the mesh from wheels did not serve" >&2; exit 1; }
echo "test-wheels: ${#DISTS[@]} wheels built; a venv with only them (+ dependencies) served kvmesh up --tls"
