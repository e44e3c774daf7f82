#!/usr/bin/env bash
# load-acceptance.sh OUT_DIR: issue 8's acceptance runs on a GPU machine, under host load.
#
# Under scripts/with-load.sh (a CPU burner on every core and a second GPU process), at once:
#   - three extended-tier runs, started together (each also has the other two as GPU neighbours);
#   - three benchmark runs, one after the other, then one with a planted 20% slowdown of the cupy rows
#     (tiers/selftest_gpu/planted_slowdown.py), then the planted-defect self-test (selftest-gpu).
# Then the regression gate: bench run 1 vs run 2 (same commit, expected exit 0) and run 1 vs the planted
# run (expected exit 1). Every run's report lands under OUT_DIR; logs beside them.
set -uo pipefail
OUT_DIR="${1:?usage: scripts/load-acceptance.sh OUT_DIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p "$OUT_DIR/extended" "$OUT_DIR/bench" "$OUT_DIR/bench-planted" "$OUT_DIR/selftest-gpu"
export OUT_DIR PYTHONUNBUFFERED=1
scripts/with-load.sh -- bash -c '
  for i in 1 2 3; do ./scripts/gpu-test.sh extended --report-dir "$OUT_DIR/extended" > "$OUT_DIR/extended-$i.log" 2>&1 & done
  for i in 1 2 3; do ./scripts/gpu-test.sh bench --report-dir "$OUT_DIR/bench" > "$OUT_DIR/bench-$i.log" 2>&1; done
  PYTHONPATH="tiers/selftest_gpu" ./scripts/gpu-test.sh bench --report-dir "$OUT_DIR/bench-planted" \
    -- -p planted_slowdown > "$OUT_DIR/bench-planted.log" 2>&1
  ./scripts/gpu-test.sh selftest-gpu --report-dir "$OUT_DIR/selftest-gpu" > "$OUT_DIR/selftest-gpu.log" 2>&1
  wait
'
runs=("$OUT_DIR"/bench/*-bench*)
planted=("$OUT_DIR"/bench-planted/*-bench*)
{
  echo "== compare ${runs[0]##*/} ${runs[1]##*/} (same commit) =="
  ./scripts/gpu-test.sh compare "${runs[0]}" "${runs[1]}"; echo "exit $?"
  echo "== compare ${runs[0]##*/} ${planted[0]##*/} (planted 20% slowdown of the cupy rows) =="
  ./scripts/gpu-test.sh compare "${runs[0]}" "${planted[0]}"; echo "exit $?"
} > "$OUT_DIR/compare.log" 2>&1
grep -h -E "^(extended|bench|selftest-gpu) +(PASS|FAIL)" "$OUT_DIR"/*.log
grep -E "^== |^exit |regression" "$OUT_DIR/compare.log"
