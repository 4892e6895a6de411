#!/usr/bin/env bash
# systemd-analyze verify every unit in packaging/systemd (systemd need not be PID 1).
# Why the rewriting: verify fails on an ExecStart that does not exist here, so /opt/kvmesh/venv/bin is
# pointed at this checkout's venv (a daemon not built in this tree, e.g. the planner, at the venv's python);
# templates are verified as a concrete instance (@01). Its exit code is 0 even for unknown keys or bad
# values ("...ignoring"), so any output at all is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v systemd-analyze >/dev/null || { echo "verify-units: systemd-analyze not installed: skipping"; exit 0; }
venv_bin="$(cd .venv/bin && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
units=()
for unit in packaging/systemd/*.service; do
  name="$(basename "$unit")"
  exe="$(sed -n 's|^ExecStart=/opt/kvmesh/venv/bin/\([^ ]*\).*|\1|p' "$unit")"
  target="$venv_bin/$exe"
  [ -x "$target" ] || target="$venv_bin/python"
  sed "s|^ExecStart=/opt/kvmesh/venv/bin/[^ ]*|ExecStart=$target|" "$unit" >"$work/$name"
  units+=("${name/@./@01.}")
done
status=0
for unit in "${units[@]}"; do
  out="$(cd "$work" && systemd-analyze verify "$unit" 2>&1)" || status=1
  if [ -n "$out" ]; then echo "$unit:"; echo "$out"; status=1; fi
done
[ "$status" = 0 ] && echo "verify-units: ${#units[@]} units verified"
exit "$status"
