#!/usr/bin/env bash
# sharing-acceptance.sh OUT_DIR pair|plants [EXTENDED_RUNS] [MEMORY_RUNS]  |  OUT_DIR churn [PLANT_ROUNDS]
# Issue 28's proof that the verdicts judge the code under test, not the other tenants of its GPU. Every job here
# runs on the SAME GPU (CUDA_VISIBLE_DEVICES as the caller set it, default 0); reports land in OUT_DIR/<lane>/:
#   pair   two suite jobs at once (lanes job1 and job2), each running the extended tier EXTENDED_RUNS times
#          (default 3), then the memory tier MEMORY_RUNS times (default 1): every run must pass (no false alarm)
#   plants the planted leaks of selftest-gpu (-k leak, one round) while a second suite job (lane job1) runs the
#          extended tier EXTENDED_RUNS times and the memory tier MEMORY_RUNS times on the same GPU: every plant
#          caught and every run of the other job passed
#   churn  the planted leaks of selftest-gpu (-k leak: GPU memory kept per step, in torch's allocator and in CuPy's
#          pool, and host memory, the last PLANT_ROUNDS times, default 3) while a neighbour
#          (python -m lora_suite.scenarios.memory_churn) holds 6 GiB of the same GPU and takes and frees up to 4 GiB
#          more ten times a second: every plant must still be caught (lane churn; its log: churn/neighbour.log)
# Afterwards: python -m lora_suite.results.acceptance OUT_DIR writes acceptance.md / acceptance.json (every run's
# judged figures against their allowances; exit 1 if a run failed), and lora-suite ledger record OUT_DIR/<lane>
# --group G keeps the figures in the results ledger.
set -uo pipefail
usage="usage: scripts/sharing-acceptance.sh OUT_DIR pair|plants [EXTENDED_RUNS] [MEMORY_RUNS] | OUT_DIR churn [PLANT_ROUNDS]"
OUT_DIR="${1:?$usage}"
PHASE="${2:?$usage}"
EXTENDED="${3:-3}"; MEMORY="${4:-1}"; ROUNDS="${3:-3}"
case "$PHASE" in pair|plants|churn) ;; *) echo "sharing-acceptance.sh: the phase must be pair, plants or churn, got '$PHASE'" >&2; exit 2 ;; esac
for n in "$EXTENDED" "$MEMORY" "$ROUNDS"; do
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "sharing-acceptance.sh: run counts must be whole numbers >= 0, got '$n'" >&2; exit 2; }
done
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

lane() {  # lane NAME: the extended runs, then the memory runs, each with its own log
  local dir="$OUT_DIR/$1" i
  mkdir -p "$dir"
  for i in $(seq "$EXTENDED"); do ./scripts/gpu-test.sh extended --report-dir "$dir" >"$dir/extended-$i.log" 2>&1; done
  for i in $(seq "$MEMORY"); do ./scripts/gpu-test.sh memory --report-dir "$dir" >"$dir/memory-$i.log" 2>&1; done
}

if [[ "$PHASE" == pair ]]; then
  echo "sharing-acceptance.sh: two jobs on GPU $CUDA_VISIBLE_DEVICES: $EXTENDED extended + $MEMORY memory runs each" >&2
  lane job1 & a=$!
  sleep 20  # the second job starts while the first trains, so each sees the other allocate and free mid-run
  lane job2 & b=$!
  wait "$a" "$b"
  grep -h -E "^(extended|memory) +(PASS|FAIL)" "$OUT_DIR"/job*/*.log
elif [[ "$PHASE" == plants ]]; then
  echo "sharing-acceptance.sh: leak plants beside a suite job on GPU $CUDA_VISIBLE_DEVICES ($EXTENDED extended + $MEMORY memory runs)" >&2
  lane job1 & a=$!
  sleep 20  # the plants start while the other job trains
  dir="$OUT_DIR/plants"
  mkdir -p "$dir"
  ./scripts/gpu-test.sh selftest-gpu --report-dir "$dir" -- -k leak >"$dir/selftest-gpu.log" 2>&1
  wait "$a"
  grep -h -E "^(extended|memory|selftest-gpu) +(PASS|FAIL)" "$OUT_DIR"/job1/*.log "$dir/selftest-gpu.log"
else
  dir="$OUT_DIR/churn"
  mkdir -p "$dir"
  "$PY" -m lora_suite.scenarios.memory_churn --hold-gib 6 --churn-gib 4 --period-s 0.1 >"$dir/neighbour.log" 2>&1 &
  neighbour=$!
  trap 'kill "$neighbour" 2>/dev/null' EXIT
  sleep 5
  ./scripts/gpu-test.sh selftest-gpu --report-dir "$dir" -- -k leak --plant-repeats "$ROUNDS" >"$dir/selftest-gpu.log" 2>&1
  kill "$neighbour" 2>/dev/null; wait "$neighbour" 2>/dev/null
  tail -3 "$dir/neighbour.log"
  grep -h -E "^selftest-gpu +(PASS|FAIL)" "$dir/selftest-gpu.log"
fi
