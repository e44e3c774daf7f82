#!/usr/bin/env bash
# scorecard.sh [--lora-impl a,b,...] [--report-dir DIR] [--check-vram] [--jobs N] [--no-bench]
# (also: scripts/gpu-test.sh scorecard ...) Issue 19's scorecard: every selected LoRA implementation (default:
# every one installed, lora_suite.implementations.installed_names) through the quick, convergence and memory
# tiers (each with --lora-impl; a tier whose configuration an implementation cannot run ends as a finding, not a
# suite error), then the interleaved end-to-end training benchmark once, then lora_suite.scorecard writes
# DIR/scorecard.md, scorecard.html and scorecard.json from every run under DIR (default reports/<stamp>-scorecard).
# --jobs N: up to N implementations run their tiers at once on the GPU (each in its own process; its output goes to
# DIR/lane-<impl>.log). The tiers judge no timing, and each process measures its own peak, so lanes do not move
# their verdicts; --check-vram then reads NVML's free memory with the other lanes' models in it. The benchmark
# always runs alone, after the lanes. --no-bench: the tiers only (a bench run made later into the same DIR joins
# the scorecard when it is built again: python -m lora_suite.scorecard DIR DIR).
# SCORECARD_DRY_RUN=1 prints the commands instead of running them.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
IMPLS=""; DIR=""; VRAM=(); JOBS=1; BENCH=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --lora-impl) [[ $# -ge 2 && -n "$2" && "$2" != -* ]] || { echo "scorecard: --lora-impl needs a comma-separated list, got '${2:-}'" >&2; exit 2; }
                 IMPLS="$2"; shift ;;
    --lora-impl=*) IMPLS="${1#*=}"; [[ -n "$IMPLS" ]] || { echo "scorecard: --lora-impl needs a comma-separated list, got ''" >&2; exit 2; } ;;
    --report-dir) [[ $# -ge 2 && -n "$2" && "$2" != -* ]] || { echo "scorecard: --report-dir needs a directory, got '${2:-}'" >&2; exit 2; }
                  DIR="$2"; shift ;;
    --check-vram) VRAM=(--check-vram) ;;
    --no-bench) BENCH=0 ;;
    --jobs) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || { echo "scorecard: --jobs needs a whole number >= 1, got '${2:-}'" >&2; exit 2; }
            JOBS="$2"; shift ;;
    *) echo "scorecard: unknown argument '$1' (expected --lora-impl a,b,..., --report-dir DIR, --check-vram, --jobs N, --no-bench)" >&2; exit 2 ;;
  esac
  shift
done
PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
if [[ -z "$IMPLS" ]]; then
  IMPLS="$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'from lora_suite.implementations import installed_names; print(",".join(installed_names()))' 2>/dev/null)" \
    || { echo "scorecard: could not list the installed implementations with $PY" >&2; exit 3; }
fi
[[ "$IMPLS" =~ ^[A-Za-z0-9_.:,-]+$ ]] || { echo "scorecard: --lora-impl must be names separated by commas, got '$IMPLS'" >&2; exit 2; }
DIR="${DIR:-reports/$(date -u +%Y%m%dT%H%M%SZ)-scorecard}"
run() { if [[ "${SCORECARD_DRY_RUN:-0}" == 1 ]]; then echo "would run: $*"; else "$@"; fi; }
run mkdir -p "$DIR"
IFS=, read -ra LIST <<< "$IMPLS"
lane() {  # one implementation's tiers, one after another (a failing tier is its finding: the next one still runs)
  local impl="$1" tier
  for tier in quick convergence memory; do
    run ./scripts/gpu-test.sh "$tier" --lora-impl "$impl" --report-dir "$DIR" "${VRAM[@]}"
  done
}
for impl in "${LIST[@]}"; do
  if [[ "$JOBS" == 1 ]]; then
    lane "$impl"
  else
    while [[ "$(jobs -rp | wc -l)" -ge "$JOBS" ]]; do wait -n; done
    echo "scorecard: $impl's tiers started (output: $DIR/lane-$impl.log)"
    lane "$impl" > "$DIR/lane-$impl.log" 2>&1 &
  fi
done
wait
[[ "$BENCH" == 1 ]] && run ./scripts/gpu-test.sh bench --report-dir "$DIR" -- -k speed_interleaved --bench-impls "$IMPLS"
run "$PY" -m lora_suite.scorecard "$DIR" "$DIR"
