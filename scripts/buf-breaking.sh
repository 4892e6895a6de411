#!/usr/bin/env bash
# buf breaking over protos/: fail if the contracts changed incompatibly (wire or generated code)
# relative to a base commit. Run from anywhere inside the repository, after `npm ci`.
#
# Which base (first match wins):
#   1. $BUF_BREAKING_AGAINST, any git revision (e.g. origin/main, a tag, a sha);
#   2. HEAD is not on main's history tip (a branch / PR checkout): the merge-base of HEAD and main
#      (origin/main, else local main), i.e. the main commit the change started from;
#   3. HEAD is main (CI on a push to main; a fresh clone of main): HEAD~1, the previous commit of
#      main, so each commit is checked against the one before it.
# No base commit, or a base without protos/ (first commit, first contract): nothing to compare,
# exit 0. A shallow clone (CI default depth 1) is deepened by one commit when possible; CI should
# clone with fetch-depth >= 2 (or 0) so that HEAD~1 exists.
#
# Only committed protos are the base; the working tree (including uncommitted edits) is checked.
set -euo pipefail

ROOT="$(git rev-parse --show-toplevel)"
cd "$ROOT"

BUF="${BUF:-}"
if [[ -z "$BUF" ]]; then
  if [[ -x node_modules/.bin/buf ]]; then BUF=node_modules/.bin/buf
  elif command -v buf >/dev/null 2>&1; then BUF=buf
  else echo "buf-breaking: buf not found; run 'npm ci' first" >&2; exit 2
  fi
fi

have() { git rev-parse --verify --quiet "$1^{commit}" >/dev/null; }

main_ref=""
for r in origin/main main; do
  if have "$r"; then main_ref="$r"; break; fi
done

if [[ -n "${BUF_BREAKING_AGAINST:-}" ]]; then
  base_rev="$BUF_BREAKING_AGAINST"; why="\$BUF_BREAKING_AGAINST"
elif ! have HEAD; then
  echo "buf-breaking: no commits yet; nothing to compare against."; exit 0
elif [[ -n "$main_ref" && "$(git rev-parse HEAD)" != "$(git rev-parse "$main_ref")" ]] \
     && git merge-base HEAD "$main_ref" >/dev/null 2>&1; then
  base_rev="$(git merge-base HEAD "$main_ref")"; why="merge-base of HEAD and $main_ref"
  if [[ "$base_rev" == "$(git rev-parse HEAD)" ]]; then  # HEAD is behind main: compare to its parent
    base_rev="HEAD~1"; why="HEAD~1 (HEAD is an ancestor of $main_ref)"
  fi
else
  base_rev="HEAD~1"; why="HEAD~1 (previous commit of main)"
fi

if ! have "$base_rev" && [[ "$(git rev-parse --is-shallow-repository)" == "true" ]]; then
  git fetch --quiet --deepen=1 2>/dev/null || true
fi
if ! have "$base_rev"; then
  if [[ "$(git rev-parse --is-shallow-repository)" == "true" ]]; then
    echo "buf-breaking: WARNING: $base_rev is not in this shallow clone, so nothing is compared;" \
         "clone with fetch-depth >= 2 (or set BUF_BREAKING_AGAINST) to check compatibility" >&2
    exit 0
  fi
  echo "buf-breaking: no base commit ($why does not exist); nothing to compare against."; exit 0
fi
base_sha="$(git rev-parse "$base_rev^{commit}")"

if ! git cat-file -e "$base_sha:protos" 2>/dev/null \
   || [[ -z "$(git ls-tree -r --name-only "$base_sha" -- protos | grep '\.proto$' || true)" ]]; then
  echo "buf-breaking: base ${base_sha:0:12} ($why) has no protos; nothing to compare against."; exit 0
fi

echo "buf-breaking: protos/ (working tree) against ${base_sha:0:12} ($why)"
exec "$BUF" breaking protos --against ".git#ref=${base_sha},subdir=protos"
