#!/usr/bin/env bash
# gpu-test.sh: a thin wrapper around the suite's command line (`lora-suite`, lora_suite/cli): it makes sure a Python
# environment with what the suite needs exists (bootstrapping .venv on a fresh machine), then hands over:
#   scripts/gpu-test.sh TARGET [options] [-- extra pytest args]  ==  lora-suite TARGET [options] [-- ...]
# `scripts/gpu-test.sh --help` lists the targets (every tier of the registry in configs/, all, bench, selftest,
# selftest-gpu, scorecard, render-scorecard, history, compare, ledger). Exit codes are the CLI's (0 passed, 1 a target
# failed or regressed, 2 bad usage, 4 not judged, 130 interrupted) plus 3: the Python environment could not be set up.
set -uo pipefail
export GPU_TEST_T0="${GPU_TEST_T0:-$(date +%s.%N)}"  # the run's start: the report's wall-time breakdown counts from it

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -t 1 && -z "${NO_COLOR:-}" ]]; then YELLOW=$'\e[33m'; RED=$'\e[31m'; RESET=$'\e[0m'; else YELLOW=""; RED=""; RESET=""; fi
say() { printf '%s\n' "$*"; }
CALLER="$PWD"  # relative paths in the arguments (--report-dir, compare's folders) are the caller's: exec from here
cd "$ROOT"

# ---------------------------------------------------------------- Python environment
# Use an interpreter that already has everything (GPU runners without network access); otherwise
# bootstrap .venv. torch is pinned first so that pip does not resolve a multi-GB build we do not want;
# on a machine with an NVIDIA GPU the system under test also needs CuPy and nvmath-python's cuBLAS binding,
# built for the CUDA major of the torch that is installed (the cuda12 or cuda13 extra), and PEFT for the
# reference rows.
# The check finds the packages without importing them (importing torch, transformers, CuPy and PEFT here took
# ~6 s of a 46 s quick tier on a fresh machine, reports/20261122T104642Z-quick); a package that is present but
# broken fails at import in pytest, which names it.
NEEDED="torch transformers yaml pynvml pytest pytest_benchmark safetensors matplotlib"
# the results store and the history page: for the targets that read or write them (a tier's --record names what is
# missing instead; an offline GPU runner need not carry them to run the tiers)
case "${1:-}" in history|ledger|render-scorecard|scorecard|selftest) NEEDED="$NEEDED sqlalchemy plotly" ;; esac
NVIDIA=0
if [[ "${GPU_TEST_ASSUME_GPU:-}" == 1 ]] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  NVIDIA=1; NEEDED="$NEEDED cupy nvmath peft"
fi
# the CPU tests validate reports; lint; test the mutation operators, the PostgreSQL store and the history page
[[ "${1:-}" == selftest ]] && NEEDED="$NEEDED jsonschema ruff cosmic_ray psycopg playwright mypy"
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
  local dry="${GPU_TEST_BOOTSTRAP_DRY_RUN:-0}" major extras=".[peft,test,mutate,loralib,torchtune,peft-bnb,postgres]"
  run_step() { if [[ "$dry" == 1 ]]; then say "would run: $*"; else "$@"; fi; }
  step() { say "${YELLOW}[set-up $(( SECONDS - T_SETUP ))s] $*${RESET}"; }  # a line per step: pip itself runs quiet
  T_SETUP=$SECONDS
  say "${YELLOW}Setting up .venv (once per checkout): torch ${LORA_TORCH_SPEC:-==2.13.0}, then this project and its dependencies${RESET}"
  { [[ -x .venv/bin/python ]] || { step "creating .venv"; run_step python3 -m venv .venv; }; } &&
    { step "upgrading pip"; run_step .venv/bin/python -m pip install -q --upgrade pip; } &&
    { step "installing torch (the largest download)"; run_step .venv/bin/python -m pip install -q "torch${LORA_TORCH_SPEC:-==2.13.0}"; } || return 1
  if [[ $NVIDIA -eq 1 ]]; then
    major="$(torch_cuda_major)"
    case "$major" in
      12|13) extras=".[peft,test,mutate,loralib,torchtune,peft-bnb,postgres,cuda$major]" ;;
      "") say "${YELLOW}An NVIDIA GPU is present but the installed torch is a CPU build: no CuPy (the GPU tiers will skip).${RESET}" ;;
      *) say "${RED}torch is built for CUDA $major; CuPy wheels exist for CUDA 12 and 13 only.${RESET}"; return 1 ;;
    esac
  fi
  step "installing this project with $extras (transformers, PEFT, pytest and the rest)"
  run_step .venv/bin/python -m pip install -q -e "$extras" || return 1
  step "done: the command line is $ROOT/.venv/bin/lora-suite (or run 'source .venv/bin/activate', then 'lora-suite')"
}
if [[ "${GPU_TEST_BOOTSTRAP_DRY_RUN:-0}" == 1 ]]; then bootstrap; exit $?; fi
if ! pick_python; then
  bootstrap || { say "${RED}Could not set up the Python environment in .venv (see pip's messages above).${RESET}"; exit 3; }
  PY="$ROOT/.venv/bin/python"
fi
# The checkout's package wins over an installed copy; PYTHON tells the CLI which interpreter runs pytest.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHON="$PY"
cd "$CALLER" 2>/dev/null || cd "$ROOT"
exec "$PY" -m lora_suite "$@"
