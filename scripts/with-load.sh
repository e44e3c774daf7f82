#!/usr/bin/env bash
# with-load.sh: run a command while the machine is loaded the way a shared nightly runner is, then stop the load.
#   scripts/with-load.sh [--cpu N] [--gpu-duty F] -- COMMAND...
# Load: N CPU burners (default: one per core) and, on every visible GPU, a second GPU process that keeps that GPU
# busy about F of the time (default 0.4) with bf16 4096x4096 matmuls, as another job on the same GPU would.
# Exit code: COMMAND's.
set -uo pipefail
CPUS="$(nproc)"; DUTY=0.4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) CPUS="$2"; shift 2 ;;
    --gpu-duty) DUTY="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { echo "with-load.sh: no command given" >&2; exit 2; }
PY="${PYTHON:-python3}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq "$CPUS"); do "$PY" -c "while True: pass" & pids+=($!); done
GPUS=0
if [[ "$DUTY" != "0" ]]; then
  GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
  for ((g = 0; g < GPUS; g++)); do
    "$PY" - "$DUTY" "$g" <<'PYEOF' &
import sys, time, torch
duty, device = float(sys.argv[1]), int(sys.argv[2])
torch.cuda.set_device(device)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
while True:
    start.record()
    for _ in range(20):
        a @ a
    end.record()
    end.synchronize()
    busy = start.elapsed_time(end) / 1e3
    time.sleep(busy * (1 - duty) / duty)
PYEOF
    pids+=($!)
  done
fi
echo "with-load.sh: $CPUS CPU burners and a GPU neighbour at ~${DUTY} duty on each of $GPUS GPU(s) are running" >&2
sleep 3
"$@"
