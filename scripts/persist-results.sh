#!/usr/bin/env bash
# persist-results.sh RUNS_DIR GROUP: keep a night's run folders past their artifacts (issue 45).
#
# - With $LORA_SUITE_STORE set (a team's PostgreSQL URL, from a CI secret): `lora-suite ledger record` into it. The URL,
#   password included, is never printed: the suite names a store by its URL with the password replaced by ***.
# - Without it: the rows are appended to ledger.jsonl on a results branch ($RESULTS_BRANCH, default `results`) of the
#   remote ($RESULTS_REMOTE, default `origin`), as github-action-benchmark keeps its data branch. Two runners pushing
#   at once: the one whose push is refused fetches the branch again, records again (a run already on it is not added
#   twice) and retries, up to five times.
# Exit: 0 persisted, 1 not persisted (the reason printed), 2 bad usage.
set -euo pipefail
if [[ $# -ne 2 || ! -d "$1" ]]; then
  echo "usage: persist-results.sh RUNS_DIR GROUP (RUNS_DIR: a folder holding run folders; got ${1:-nothing})" >&2
  exit 2
fi
RUNS="$(cd "$1" && pwd)" GROUP="$2"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
suite() { "$ROOT/scripts/gpu-test.sh" "$@"; }

if [[ -n "${LORA_SUITE_STORE:-}" ]]; then
  suite ledger record "$RUNS" --group "$GROUP"  # reads $LORA_SUITE_STORE
  exit $?
fi

BRANCH="${RESULTS_BRANCH:-results}" REMOTE="${RESULTS_REMOTE:-origin}"
REPO="$(git rev-parse --show-toplevel)"  # the checkout this runs in (the workflow's), whose remote gets the branch
WORK="$(mktemp -d)"
trap 'git -C "$REPO" worktree remove --force "$WORK/branch" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
for attempt in 1 2 3 4 5; do
  git -C "$REPO" worktree remove --force "$WORK/branch" >/dev/null 2>&1 || true
  if git -C "$REPO" fetch -q "$REMOTE" "$BRANCH" 2>/dev/null; then
    git -C "$REPO" worktree add -q --detach "$WORK/branch" FETCH_HEAD
  else  # the first night: the branch starts empty, sharing no history with the code
    git -C "$REPO" worktree add -q --detach "$WORK/branch"
    git -C "$WORK/branch" checkout -q --orphan "$BRANCH"
    git -C "$WORK/branch" rm -rq --cached . >/dev/null 2>&1 || true
    find "$WORK/branch" -mindepth 1 -maxdepth 1 ! -name .git -exec rm -rf {} +
  fi
  suite ledger record "$RUNS" --group "$GROUP" --ledger "$WORK/branch/ledger.jsonl"
  git -C "$WORK/branch" add ledger.jsonl
  if git -C "$WORK/branch" diff --cached --quiet; then
    echo "persist-results: every run of $RUNS is on $REMOTE/$BRANCH already"
    exit 0
  fi
  git -C "$WORK/branch" -c user.name="lora-suite nightly" -c user.email="lora-suite@localhost" \
    commit -q -m "results: $GROUP"
  if git -C "$WORK/branch" push -q "$REMOTE" "HEAD:refs/heads/$BRANCH" 2>"$WORK/push.err"; then
    echo "persist-results: $GROUP appended to $REMOTE/$BRANCH (ledger.jsonl)"
    exit 0
  fi
  echo "persist-results: push refused (attempt $attempt: another runner pushed first); fetching again" >&2
  sleep $((attempt * 2))
done
echo "persist-results: not persisted after 5 attempts: $(tail -1 "$WORK/push.err")" >&2
exit 1
