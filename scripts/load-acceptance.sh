#!/usr/bin/env bash
# load-acceptance.sh OUT_DIR CONDITION [EXTENDED_RUNS] [PLANT_ROUNDS] [BENCH_RUNS] [PLANTS_K]
# Issue 18's acceptance runs on a GPU machine under one CONDITION (reports land in OUT_DIR/<CONDITION>/):
#   quiet   one suite job on the host at a time, on GPU 0: the extended runs, then the planted-defect rounds
#           (selftest-gpu -k round --plant-repeats N), then the benchmark bars
#           PLANTS_K narrows the plant rounds with a pytest -k expression (default: every plant, 'round')
#   paired  two suite jobs at once, one per GPU: GPU 0 runs the extended runs; GPU 1 the plant rounds, then the bars
#   loaded  as paired (as quiet on a one-GPU machine), under scripts/with-load.sh: a CPU burner on every core
#           and a GPU neighbour at 40% duty on every GPU
# The benchmark bars are the bench's timed verdicts (cupy vs PEFT per layer shape, dequantisation vs copy).
# Afterwards: python -m lora_suite.results.acceptance OUT_DIR writes acceptance.md / acceptance.json (every run's judged
# figures against their allowances).
set -uo pipefail
OUT_DIR="${1:?usage: scripts/load-acceptance.sh OUT_DIR quiet|paired|loaded [EXTENDED_RUNS] [PLANT_ROUNDS] [BENCH_RUNS] [PLANTS_K]}"
CONDITION="${2:?usage: scripts/load-acceptance.sh OUT_DIR quiet|paired|loaded [EXTENDED_RUNS] [PLANT_ROUNDS] [BENCH_RUNS] [PLANTS_K]}"
EXTENDED="${3:-2}"; PLANTS="${4:-1}"; BENCH="${5:-1}"; PLANTS_K="${6:-round}"
case "$CONDITION" in quiet|paired|loaded) ;; *) echo "load-acceptance.sh: CONDITION must be quiet, paired or loaded, got '$CONDITION'" >&2; exit 2 ;; esac
for n in "$EXTENDED" "$PLANTS" "$BENCH"; do
  [[ "$n" =~ ^[0-9]+$ ]] || { echo "load-acceptance.sh: run counts must be whole numbers >= 0, got '$n'" >&2; exit 2; }
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DIR="$OUT_DIR/$CONDITION"
mkdir -p "$DIR"
export DIR EXTENDED PLANTS BENCH PLANTS_K PYTHONUNBUFFERED=1
BARS="ratio_not_above_peft or dequant_bandwidth"
export BARS
extended_runs='for i in $(seq "$EXTENDED"); do ./scripts/gpu-test.sh extended --report-dir "$DIR" > "$DIR/extended-$1-$i.log" 2>&1; done'
plant_rounds='[[ "$PLANTS" -eq 0 ]] || ./scripts/gpu-test.sh selftest-gpu --report-dir "$DIR" -- -k "$PLANTS_K" --plant-repeats "$PLANTS" > "$DIR/plants-$1.log" 2>&1'
bench_runs='for i in $(seq "$BENCH"); do ./scripts/gpu-test.sh bench --report-dir "$DIR" -- -k "$BARS" > "$DIR/bench-$1-$i.log" 2>&1; done'
export extended_runs plant_rounds bench_runs
gpus="$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
if [[ "$CONDITION" == quiet || "$gpus" -lt 2 ]]; then
  job='CUDA_VISIBLE_DEVICES=0 bash -c "$extended_runs; $plant_rounds; $bench_runs" _ gpu0'
else
  job='CUDA_VISIBLE_DEVICES=0 bash -c "$extended_runs" _ gpu0 & CUDA_VISIBLE_DEVICES=1 bash -c "$plant_rounds; $bench_runs" _ gpu1 & wait'
fi
if [[ "$CONDITION" == loaded ]]; then
  scripts/with-load.sh -- bash -c "$job"
else
  bash -c "$job"
fi
grep -h -E "^(extended|bench|selftest-gpu) +(PASS|FAIL)" "$DIR"/*.log
