#!/usr/bin/env bash
# gpu-test.sh: run the LoRA GPU validation tiers (or the CPU self-tests) and summarise them.
# Thin on purpose: parse flags, pick the tiers, set up Python if needed, call pytest, print a summary.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TIERS_ALL=(quick convergence memory extended full)

usage() {
  cat <<'EOF'
Usage: scripts/gpu-test.sh TARGET [options] [-- extra pytest args]

TARGET
  quick         SmolLM2-135M architecture smoke run (10 steps) + the LoRA layer's GPU parity tests
  convergence   SmolLM2-135M architecture, 100 steps: loss falls; cupy matches the torch reference (and PEFT)
  memory        TinyLlama-1.1B architecture, 50 steps, batch 1: peak VRAM within budget
  extended      TinyLlama-1.1B architecture, 500 steps: no memory leak, loss keeps falling, steady speed
  full          Llama-2-7B architecture, 1000 steps: VRAM budget, convergence, checkpoint round trip
  all           the five tiers above, in that order
  bench         pytest-benchmark suite of the LoRA layer (forward+backward vs the frozen base and PEFT)
  selftest      the framework's own CPU tests (what CI runs)

Options
  --check-vram          before each tier compare the LoRA-aware VRAM estimate with NVML free memory (skip if short)
  --strict-vram         with --check-vram: fail instead of skipping when memory is short
  --continue-on-error   run the remaining targets after a failure (the exit code is still non-zero)
  --report-dir DIR      where run reports go (default: reports/, or reports/_local/ without a GPU);
                        each run gets DIR/<run-id>/
  --backend NAME        cupy | torch: the LoRA backend under test (default: cupy on a GPU)
  --weights MODE        auto | pretrained | random: override the tiers' model weights mode
  --verbose             verbose pytest output with live progress lines
  -h, --help            this help

Exit codes: 0 all passed (GPU tests skip, with a reason, on a machine without a GPU),
            1 a target failed, 2 bad usage, 3 the Python environment could not be set up.
EOF
}

# ---------------------------------------------------------------- colours (only on a terminal)
if [[ -t 1 && -z "${NO_COLOR:-}" ]]; then
  RED=$'\e[31m'; GREEN=$'\e[32m'; YELLOW=$'\e[33m'; BOLD=$'\e[1m'; RESET=$'\e[0m'
else
  RED=""; GREEN=""; YELLOW=""; BOLD=""; RESET=""
fi
say() { printf '%s\n' "$*"; }
die_usage() { printf '%sgpu-test.sh: %s%s\n' "$RED" "$1" "$RESET" >&2; printf "Run 'scripts/gpu-test.sh --help' for usage.\n" >&2; exit 2; }

# ---------------------------------------------------------------- arguments
TARGET=""; CHECK_VRAM=0; STRICT_VRAM=0; CONTINUE=0; VERBOSE=0; REPORT_ROOT=""
BACKEND=""; WEIGHTS=""; EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --check-vram) CHECK_VRAM=1 ;;
    --strict-vram) STRICT_VRAM=1 ;;
    --continue-on-error) CONTINUE=1 ;;
    --verbose|-v) VERBOSE=1 ;;
    --report-dir) [[ $# -ge 2 && -n "$2" ]] || die_usage "--report-dir needs a directory"; REPORT_ROOT="$2"; shift ;;
    --report-dir=*) REPORT_ROOT="${1#*=}" ;;
    --backend) [[ $# -ge 2 ]] || die_usage "--backend needs a value (cupy or torch)"; BACKEND="$2"; shift ;;
    --weights) [[ $# -ge 2 ]] || die_usage "--weights needs a value (auto, pretrained or random)"; WEIGHTS="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) die_usage "unknown option '$1'" ;;
    *) [[ -z "$TARGET" ]] || die_usage "only one target allowed, got '$TARGET' and '$1'"; TARGET="$1" ;;
  esac
  shift
done
[[ -n "$TARGET" ]] || die_usage "no target given (quick, convergence, memory, extended, full, all, bench or selftest)"
case "$BACKEND" in ""|cupy|torch) ;; *) die_usage "--backend must be cupy or torch, got '$BACKEND'" ;; esac
case "$WEIGHTS" in ""|auto|pretrained|random) ;; *) die_usage "--weights must be auto, pretrained or random, got '$WEIGHTS'" ;; esac
[[ $STRICT_VRAM -eq 0 || $CHECK_VRAM -eq 1 ]] || die_usage "--strict-vram only makes sense with --check-vram"
case "$TARGET" in
  quick|convergence|memory|extended|full|bench|selftest) TARGETS=("$TARGET") ;;
  all) TARGETS=("${TIERS_ALL[@]}") ;;
  *) die_usage "unknown target '$TARGET' (expected quick, convergence, memory, extended, full, all, bench or selftest)" ;;
esac
[[ "${GPU_TEST_DRY_RUN:-0}" != "1" ]] || { say "targets: ${TARGETS[*]}"; exit 0; }  # for the CPU tests of this script

# Progress lines appear as they happen when output is piped (CI logs), not at exit.
export PYTHONUNBUFFERED=1
# No network at run time: models and tokenizers come from a local path or the local HF cache only.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"

# ---------------------------------------------------------------- Python environment
# Use an interpreter that already has everything (the lent GPU machines have no network); otherwise
# bootstrap .venv. torch is pinned first so that pip does not resolve a multi-GB build we do not want.
NEEDED="import torch, transformers, yaml, pynvml, pytest, pytest_benchmark, safetensors, matplotlib"
pick_python() {
  local cand
  for cand in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3; do
    [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c "$NEEDED" >/dev/null 2>&1 && { PY="$cand"; return 0; }
  done
  return 1
}
if ! pick_python; then
  say "${YELLOW}Setting up .venv (first run): torch ${LORA_TORCH_SPEC:-==2.13.0}, then this project and its dependencies${RESET}"
  { [[ -x .venv/bin/python ]] || python3 -m venv .venv; } &&
    .venv/bin/python -m pip install -q --upgrade pip &&
    .venv/bin/python -m pip install -q "torch${LORA_TORCH_SPEC:-==2.13.0}" &&
    .venv/bin/python -m pip install -q -e ".[peft]" ||
    { say "${RED}Could not set up the Python environment in .venv (see pip's messages above).${RESET}"; exit 3; }
  PY="$ROOT/.venv/bin/python"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- GPU pre-check (NVML / nvidia-smi)
HAVE_GPU=0
if [[ "$TARGET" != "selftest" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && gpu_line=$(nvidia-smi --query-gpu=name,memory.total,memory.used,memory.free,driver_version --format=csv,noheader 2>/dev/null) && [[ -n "$gpu_line" ]]; then
    HAVE_GPU=1
    say "${BOLD}GPU:${RESET} $gpu_line  (name, total, used, free, driver)"
  elif "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    HAVE_GPU=1
    say "${BOLD}GPU:${RESET} $("$PY" -c 'import torch; print(torch.cuda.get_device_name())') (nvidia-smi not found)"
  else
    say "${YELLOW}${BOLD}No NVIDIA GPU found${RESET}${YELLOW} (no nvidia-smi / NVML device, torch.cuda.is_available() is False).${RESET}"
    say "${YELLOW}The GPU tests of '$TARGET' will be skipped with that reason (the CPU self-tests are 'selftest').${RESET}"
  fi
fi

# Reports of GPU runs go to reports/ (committed evidence); runs without a GPU to reports/_local/ (ignored).
if [[ -z "$REPORT_ROOT" ]]; then
  REPORT_ROOT="$ROOT/reports"; [[ $HAVE_GPU -eq 1 ]] || REPORT_ROOT="$ROOT/reports/_local"
fi

# ---------------------------------------------------------------- run
declare -a ROWS=()
FAILED=0
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
for t in "${TARGETS[@]}"; do
  args=(-m pytest -p no:cacheprovider)
  [[ $VERBOSE -eq 1 ]] && args+=(-v -o log_cli=true --log-cli-level=INFO)
  [[ -n "$BACKEND" ]] && args+=(--backend "$BACKEND")
  [[ -n "$WEIGHTS" ]] && args+=(--weights "$WEIGHTS")
  run_dir=""
  case "$t" in
    selftest) args+=(tests) ;;
    bench)
      run_dir="$REPORT_ROOT/$STAMP-bench"
      args+=(benchmarks -m benchmark --benchmark-json="$run_dir/benchmark.json" --report-dir "$run_dir" --junitxml="$run_dir/junit.xml") ;;
    *)
      run_dir="$REPORT_ROOT/$STAMP-$t"
      args+=(tiers -m "$t" --report-dir "$run_dir" --junitxml="$run_dir/junit.xml")
      [[ $CHECK_VRAM -eq 1 ]] && args+=(--check-vram)
      [[ $STRICT_VRAM -eq 1 ]] && args+=(--strict-vram) ;;
  esac
  [[ -n "$run_dir" ]] && mkdir -p "$run_dir"
  say ""
  say "${BOLD}=== $t ===${RESET}  $PY ${args[*]} ${EXTRA[*]:-}"
  start=$(date +%s)
  "$PY" "${args[@]}" "${EXTRA[@]}"
  rc=$?
  secs=$(( $(date +%s) - start ))
  case $rc in
    0) verdict="PASS" ;;
    5) verdict="FAIL (no tests collected)" ;;
    *) verdict="FAIL (pytest exit $rc)" ;;
  esac
  ROWS+=("$(printf '%-12s %-28s %6ss  %s' "$t" "$verdict" "$secs" "${run_dir:-"-"}")")
  if [[ $rc -ne 0 ]]; then
    FAILED=1
    if [[ $CONTINUE -eq 0 && ${#TARGETS[@]} -gt 1 ]]; then
      say "${RED}$t failed; stopping (use --continue-on-error to run the rest).${RESET}"
      break
    fi
  fi
done

# ---------------------------------------------------------------- summary
say ""
say "${BOLD}Summary$([[ $HAVE_GPU -eq 0 && "$TARGET" != selftest ]] && printf ' (no GPU: GPU tests were skipped)')${RESET}"
say "$(printf '%-12s %-28s %7s  %s' target result time report)"
for row in "${ROWS[@]}"; do
  case "$row" in
    *PASS*) say "${GREEN}${row}${RESET}" ;;
    *) say "${RED}${row}${RESET}" ;;
  esac
done
exit $FAILED
