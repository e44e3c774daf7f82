#!/usr/bin/env bash
# gpu-test.sh: run the LoRA GPU validation tiers (or the CPU self-tests) and summarise them.
# Thin on purpose: parse flags, pick the tiers, set up Python if needed, call pytest, print a summary.
set -uo pipefail
export GPU_TEST_T0="${GPU_TEST_T0:-$(date +%s.%N)}"  # the run's start: the report's wall-time breakdown counts from it

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
  multigpu      TinyLlama-1.1B architecture on N GPUs with DDP via torchrun: ranks agree, N GPUs match one,
                a failing rank ends the job (skips with fewer than two GPUs)
  all           the five tiers above, in that order, then multigpu when two or more GPUs are visible
  bench         pytest-benchmark suite of the LoRA layer (forward+backward vs the frozen base and PEFT)
  selftest      the framework's own CPU tests (what CI runs)
  selftest-gpu  planted defects (stale activation, missing scale, accumulation, leak, slow paths) that the
                tiers' criteria must catch: the suite's own sensitivity, on a GPU
  scorecard [--lora-impl a,b,...] [--report-dir DIR] [--check-vram] [--jobs N] [--no-bench]
                every selected (default: installed) LoRA implementation through quick, convergence and
                memory, then the interleaved training benchmark; writes scorecard.md / .html (scripts/scorecard.sh)
  history [DIR...] [--html OUT.html]
                every report under DIR (default reports/) over time, per GPU, implementation and tier:
                judged figures with their allowances, bench rows, regressions the compare gate finds;
                writes OUT.html (self-contained) and history.md beside it (default reports/history/)
  compare BASELINE RUN
                compare two run directories (report.json, benchmark.json): exit 1 on a regression

Options
  --check-vram          before each tier compare the LoRA-aware VRAM estimate with NVML free memory (skip if short)
  --strict-vram         with --check-vram: fail instead of skipping when memory is short
  --continue-on-error   run the remaining targets after a failure (the exit code is still non-zero)
  --report-dir DIR      where run reports go (default: reports/, or reports/_local/ without a GPU);
                        each run gets DIR/<run-id>/
  --lora-impl SPEC      the LoRA implementation under test: cupy (default), torch, peft, an entry point
                        of lora_suite.implementations, or package.module:factory
  --weights MODE        auto | pretrained | random: override the tiers' model weights mode
  --gpus N              multigpu: processes (GPUs) per torchrun job (default: every visible GPU)
  --baseline DIR|auto   after each target, compare its run with DIR/<target> (or DIR itself when it holds a
                        run); a regression fails the target. auto: reports/baselines/<this GPU's name>
  --verbose             verbose pytest output with live progress lines
  -h, --help            this help

Exit codes: 0 all passed (GPU tests skip, with a reason, on a machine without a GPU),
            1 a target failed (or compare found a regression), 2 bad usage (also an unwritable report
            directory), 3 the Python environment could not be set up, 130 interrupted (Ctrl-C).
Environment: GPU_TEST_BOOTSTRAP_DRY_RUN=1 prints what setting up .venv would install, and stops.
EOF
}

[[ "${1:-}" == scorecard ]] && { shift; exec "$ROOT/scripts/scorecard.sh" "$@"; }
if [[ "${1:-}" == history ]]; then  # history [DIR...] [--html OUT]: every report under DIR (default reports/) over time
  shift; HTML="$ROOT/reports/history/history.html"; DIRS=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --html) [[ $# -ge 2 && "$2" == *.html ]] || { echo "history: --html needs a path ending in .html, got '${2:-}'" >&2; exit 2; }
              HTML="$2"; shift ;;
      -*) echo "history: unknown option '$1' (expected report directories and --html OUT.html)" >&2; exit 2 ;;
      *) [[ -d "$1" ]] || { echo "history: '$1' is not a directory of reports" >&2; exit 2; }
         DIRS+=("$1") ;;
    esac
    shift
  done
  [[ ${#DIRS[@]} -gt 0 ]] || DIRS=("$ROOT/reports")
  PY="${PYTHON:-$([[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || echo python3)}"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m lora_suite.history "$HTML" "${DIRS[@]}"
fi

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
LORA_IMPL=""; WEIGHTS=""; BASELINE=""; GPUS=""; EXTRA=(); POSITIONAL=()
# An option's value must not be another flag: `--report-dir --check-vram` is a mistake, not a folder.
value_of() { [[ $# -ge 3 && -n "$3" && "$3" != -* ]] || die_usage "$1 needs $2, got '${3:-}'"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --check-vram) CHECK_VRAM=1 ;;
    --strict-vram) STRICT_VRAM=1 ;;
    --continue-on-error) CONTINUE=1 ;;
    --verbose|-v) VERBOSE=1 ;;
    --report-dir) value_of "$1" "a directory" "${2:-}"; REPORT_ROOT="$2"; shift ;;
    --report-dir=*) REPORT_ROOT="${1#*=}"; [[ -n "$REPORT_ROOT" && "$REPORT_ROOT" != -* ]] || die_usage "--report-dir needs a directory, got '$REPORT_ROOT'" ;;
    --lora-impl) value_of "$1" "a value (cupy, torch, peft or package.module:factory)" "${2:-}"; LORA_IMPL="$2"; shift ;;
    --backend) die_usage "--backend was replaced by --lora-impl (cupy, torch, peft or package.module:factory)" ;;
    --weights) value_of "$1" "a value (auto, pretrained or random)" "${2:-}"; WEIGHTS="$2"; shift ;;
    --baseline) value_of "$1" "a directory" "${2:-}"; BASELINE="$2"; shift ;;
    --gpus) value_of "$1" "a number of GPUs (2 or more)" "${2:-}"; GPUS="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) die_usage "unknown option '$1'" ;;
    *) if [[ -z "$TARGET" ]]; then TARGET="$1"
       elif [[ "$TARGET" == compare ]]; then POSITIONAL+=("$1")
       else die_usage "only one target allowed, got '$TARGET' and '$1'"; fi ;;
  esac
  shift
done
[[ -n "$TARGET" ]] || die_usage "no target given (quick, convergence, memory, extended, full, multigpu, all, bench, selftest, selftest-gpu, scorecard, history or compare)"
[[ -z "$GPUS" || "$GPUS" =~ ^[1-9][0-9]*$ ]] || die_usage "--gpus must be a positive whole number, got '$GPUS'"
[[ -z "$LORA_IMPL" || "$LORA_IMPL" =~ ^[A-Za-z_][A-Za-z0-9_.-]*(:[A-Za-z_][A-Za-z0-9_]*)?$ ]] \
  || die_usage "--lora-impl must be a name or package.module:factory, got '$LORA_IMPL'"
case "$WEIGHTS" in ""|auto|pretrained|random) ;; *) die_usage "--weights must be auto, pretrained or random, got '$WEIGHTS'" ;; esac
[[ $STRICT_VRAM -eq 0 || $CHECK_VRAM -eq 1 ]] || die_usage "--strict-vram only makes sense with --check-vram"
case "$TARGET" in
  quick|convergence|memory|extended|full|multigpu|bench|selftest|selftest-gpu) TARGETS=("$TARGET") ;;
  all) TARGETS=("${TIERS_ALL[@]}") ;;
  compare) [[ ${#POSITIONAL[@]} -eq 2 ]] || die_usage "compare needs two run directories: compare BASELINE RUN"
           TARGETS=(compare) ;;
  *) die_usage "unknown target '$TARGET' (expected quick, convergence, memory, extended, full, multigpu, all, bench, selftest, selftest-gpu, scorecard, history or compare)" ;;
esac
[[ -z "$BASELINE" || "$BASELINE" == auto || -d "$BASELINE" ]] || die_usage "--baseline $BASELINE is not a directory"
# The report directory must be writable before anything runs (not after a tier ran for minutes).
if [[ -n "$REPORT_ROOT" ]]; then
  { mkdir -p "$REPORT_ROOT" 2>/dev/null && probe="$(mktemp "$REPORT_ROOT/.write-test.XXXXXX" 2>/dev/null)" && rm -f "$probe"; } ||
    die_usage "--report-dir $REPORT_ROOT is not a writable directory"
fi
# 'all' adds the multigpu tier where two or more GPUs are visible (GPU_TEST_GPU_COUNT overrides the count: tests).
if [[ "$TARGET" == all ]]; then
  n_gpus="${GPU_TEST_GPU_COUNT:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}"
  if [[ "${n_gpus:-0}" -ge 2 ]]; then TARGETS+=(multigpu)
  else say "multigpu: not part of this 'all' run (it needs 2 or more GPUs; found ${n_gpus:-0})"; fi
fi
[[ "${GPU_TEST_DRY_RUN:-0}" != "1" ]] || { say "targets: ${TARGETS[*]}"; exit 0; }  # for the CPU tests of this script

# Progress lines appear as they happen when output is piped (CI logs), not at exit.
export PYTHONUNBUFFERED=1
# No network at run time: models and tokenizers come from a local path or the local HF cache only.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"

# ---------------------------------------------------------------- Python environment
# Use an interpreter that already has everything (the lent GPU machines have no network); otherwise
# bootstrap .venv. torch is pinned first so that pip does not resolve a multi-GB build we do not want;
# on a machine with an NVIDIA GPU the system under test also needs CuPy and nvmath-python's cuBLAS binding,
# built for the CUDA major of the torch that is installed (the cuda12 or cuda13 extra), and PEFT for the
# reference rows.
# The check finds the packages without importing them (importing torch, transformers, CuPy and PEFT here took
# ~6 s of a 46 s quick tier on a fresh machine, reports/20261122T104642Z-quick); a package that is present but
# broken fails at import in pytest, which names it.
NEEDED="torch transformers yaml pynvml pytest pytest_benchmark safetensors matplotlib"
NVIDIA=0
if [[ "${GPU_TEST_ASSUME_GPU:-}" == 1 ]] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  NVIDIA=1; NEEDED="$NEEDED cupy nvmath peft"
fi
[[ "$TARGET" == selftest ]] && NEEDED="$NEEDED jsonschema"  # the CPU tests validate committed reports
pick_python() {
  local cand has_all="import importlib.util, sys; sys.exit(0 if all(importlib.util.find_spec(m) for m in '$NEEDED'.split()) else 1)"
  for cand in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3; do
    [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c "$has_all" >/dev/null 2>&1 && { PY="$cand"; return 0; }
  done
  return 1
}
torch_cuda_major() {  # of the torch installed in .venv ("" for a CPU build); GPU_TEST_TORCH_CUDA overrides (tests)
  local v="${GPU_TEST_TORCH_CUDA-$(.venv/bin/python -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)}"
  printf '%s' "${v%%.*}"
}
bootstrap() {
  local dry="${GPU_TEST_BOOTSTRAP_DRY_RUN:-0}" major extras=".[peft,test,loralib,torchtune,peft-bnb]"
  run_step() { if [[ "$dry" == 1 ]]; then say "would run: $*"; else "$@"; fi; }
  say "${YELLOW}Setting up .venv: torch ${LORA_TORCH_SPEC:-==2.13.0}, then this project and its dependencies${RESET}"
  { [[ -x .venv/bin/python ]] || run_step python3 -m venv .venv; } &&
    run_step .venv/bin/python -m pip install -q --upgrade pip &&
    run_step .venv/bin/python -m pip install -q "torch${LORA_TORCH_SPEC:-==2.13.0}" || return 1
  if [[ $NVIDIA -eq 1 ]]; then
    major="$(torch_cuda_major)"
    case "$major" in
      12|13) extras=".[peft,test,loralib,torchtune,peft-bnb,cuda$major]" ;;
      "") say "${YELLOW}An NVIDIA GPU is present but the installed torch is a CPU build: no CuPy (the GPU tiers will skip).${RESET}" ;;
      *) say "${RED}torch is built for CUDA $major; CuPy wheels exist for CUDA 12 and 13 only.${RESET}"; return 1 ;;
    esac
  fi
  run_step .venv/bin/python -m pip install -q -e "$extras"
}
if [[ "${GPU_TEST_BOOTSTRAP_DRY_RUN:-0}" == 1 ]]; then bootstrap; exit $?; fi
if ! pick_python; then
  bootstrap || { say "${RED}Could not set up the Python environment in .venv (see pip's messages above).${RESET}"; exit 3; }
  PY="$ROOT/.venv/bin/python"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ---------------------------------------------------------------- GPU pre-check (NVML / nvidia-smi)
HAVE_GPU=0
if [[ "$TARGET" != "selftest" && "$TARGET" != compare ]]; then
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
INTERRUPTED=0
# Ctrl-C reaches pytest too (same process group), which stops and writes its report; then the whole run
# stops here instead of going on with the next target.
trap 'INTERRUPTED=1' INT
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
new_run_dir() {  # unique even when two runs start in the same second: mkdir is atomic
  local base="$REPORT_ROOT/$STAMP-$1" dir n=1
  mkdir -p "$REPORT_ROOT"
  dir="$base"
  until mkdir "$dir" 2>/dev/null; do n=$((n + 1)); dir="$base-$n"; done
  printf '%s' "$dir"
}
if [[ "$BASELINE" == auto ]]; then  # reports/baselines/<GPU name, non-alphanumerics as _>
  gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  BASELINE="$ROOT/reports/baselines/$(printf '%s' "${gpu_name:-none}" | tr -c 'A-Za-z0-9' '_' | sed 's/_*$//')"
fi
baseline_for() {  # DIR/<target>, or DIR itself when it holds a run, or "" when there is none
  if [[ -f "$BASELINE/$1/report.json" || -f "$BASELINE/$1/benchmark.json" ]]; then printf '%s' "$BASELINE/$1"
  elif [[ -f "$BASELINE/report.json" || -f "$BASELINE/benchmark.json" ]]; then printf '%s' "$BASELINE"; fi
}
for t in "${TARGETS[@]}"; do
  args=(-m pytest -p no:cacheprovider --rootdir "$ROOT")
  [[ $VERBOSE -eq 1 ]] && args+=(-v -o log_cli=true --log-cli-level=INFO)
  [[ -n "$LORA_IMPL" ]] && args+=(--lora-impl "$LORA_IMPL")
  [[ -n "$WEIGHTS" ]] && args+=(--weights "$WEIGHTS")
  [[ -n "$GPUS" ]] && args+=(--gpus "$GPUS")
  run_dir=""
  case "$t" in
    compare) args=(-m lora_suite.compare "${POSITIONAL[@]}") ;;
    selftest) args+=(tests) ;;
    bench)
      run_dir="$(new_run_dir "bench${LORA_IMPL:+-${LORA_IMPL//[^A-Za-z0-9]/_}}")"
      args+=(benchmarks -m benchmark "--benchmark-json=$run_dir/benchmark.json" "--report-dir=$run_dir" "--junitxml=$run_dir/junit.xml") ;;
    selftest-gpu)
      run_dir="$(new_run_dir selftest-gpu)"
      args+=(tiers -m selftest_gpu "--report-dir=$run_dir" "--junitxml=$run_dir/junit.xml") ;;
    *)
      run_dir="$(new_run_dir "$t${LORA_IMPL:+-${LORA_IMPL//[^A-Za-z0-9]/_}}")"
      args+=(tiers -m "$t" "--report-dir=$run_dir" "--junitxml=$run_dir/junit.xml")
      [[ $CHECK_VRAM -eq 1 ]] && args+=(--check-vram)
      [[ $STRICT_VRAM -eq 1 ]] && args+=(--strict-vram) ;;
  esac
  say ""
  say "${BOLD}=== $t ===${RESET}  $PY ${args[*]} ${EXTRA[*]:-}"
  start=$(date +%s)
  "$PY" "${args[@]}" "${EXTRA[@]}"
  rc=$?
  if [[ -n "$BASELINE" && -n "$run_dir" && $INTERRUPTED -eq 0 ]]; then
    base="$(baseline_for "$t")"
    if [[ -z "$base" ]]; then
      say "${YELLOW}no baseline for $t under $BASELINE: not compared${RESET}"
    else
      say "${BOLD}--- $t vs baseline $base ---${RESET}"
      "$PY" -m lora_suite.compare "$base" "$run_dir"
      crc=$?
      [[ $crc -eq 1 ]] && rc=6  # 6: this script's code for "regression against the baseline"
      [[ $crc -eq 2 && $rc -eq 0 ]] && rc=2
    fi
  fi
  secs=$(( $(date +%s) - start ))
  case $rc in
    0) verdict="PASS" ;;
    5) verdict="FAIL (no tests collected)" ;;
    6) verdict="FAIL (regression vs baseline)" ;;
    *) verdict="FAIL (exit $rc)" ;;
  esac
  [[ $INTERRUPTED -eq 1 ]] && verdict="INTERRUPTED"
  ROWS+=("$(printf '%-12s %-30s %6ss  %s' "$t" "$verdict" "$secs" "${run_dir:-"-"}")")
  [[ $INTERRUPTED -eq 1 ]] && break
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
say "${BOLD}Summary$([[ $HAVE_GPU -eq 0 && "$TARGET" != selftest && "$TARGET" != compare ]] && printf ' (no GPU: GPU tests were skipped)')${RESET}"
say "$(printf '%-12s %-30s %7s  %s' target result time report)"
for row in "${ROWS[@]}"; do
  case "$row" in
    *PASS*) say "${GREEN}${row}${RESET}" ;;
    *) say "${RED}${row}${RESET}" ;;
  esac
done
if [[ $INTERRUPTED -eq 1 ]]; then
  say "${RED}Interrupted (Ctrl-C): the targets after it did not run.${RESET}"
  exit 130
fi
exit $FAILED
