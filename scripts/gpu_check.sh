#!/usr/bin/env bash
# The one command of the GPU KV check (issue 22), run in the repository root of the device machine.
#
#   bash scripts/gpu_check.sh [--device auto|cuda|cpu] [--smoke] [--budget-s 540]
#
# Needs: Python 3.12 with torch + numpy (the device's own), the wheels of scripts/gpu_wheels.sh in
# gpu_wheels/ (carried: `run(carry=["gpu_wheels"])`), no network, no Ray, no vLLM. Writes under $OUT
# (default ./gpu_check_out):
#   gpu_kv.txt, gpu_kv.json   the benchmark (benchmarks/gpu_kv.py) with the transport that worked
#   gpu_check.log             environment, wheel install, every UCX_TLS probe and its verdict
#   probe-<n>.log             each probe's output (UCX_PROTO_INFO=y: which transport UCX chose)
#
# Steps: install the carried wheels into a temporary target (pip --no-deps --target; plain unzip when
# pip is missing), PYTHONPATH = that target + the tree, then probe UCX_TLS variants with a one-pull
# run (`gpu_kv.py --quick`) until one passes; the full benchmark runs with the first that passed. If no
# VRAM variant passes, the log says which failed how, and the full run measures the best path that
# works: the same pulls between DRAM caches (--device cpu) on this machine.
#   --smoke     tiny shapes for the full run (tries the script end to end on a CPU box)
#   --budget-s  stop probing and size the full run's timeout to fit this many seconds in all
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=auto SMOKE=0 BUDGET=540
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --budget-s) BUDGET=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 64 ;;
  esac
done
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
log() { echo "$*" | tee -a "$LOG"; }
START=$SECONDS

log "# gpu_check $(date -Is) in $PWD (commit ${RAYPD_COMMIT:-from git or unknown})"
log "## environment"
{ "$PY" --version; nproc; uname -a; cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null | sed 's/^/ptrace_scope /';
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())";
} >> "$LOG" 2>&1

log "## wheels"
LIB=$(mktemp -d "${TMPDIR:-/tmp}/raypd-pylib.XXXXXX")
trap 'rm -rf "$LIB"' EXIT  # the wheels' temporary install goes with the run
shopt -s nullglob
WHEELS=(gpu_wheels/*.whl)
if [ ${#WHEELS[@]} -eq 0 ]; then
  log "no wheels in gpu_wheels/ (run scripts/gpu_wheels.sh here, carry gpu_wheels)"
elif "$PY" -m pip --version >/dev/null 2>&1 && "$PY" -m pip install --quiet --no-deps --no-index --target "$LIB" "${WHEELS[@]}" >> "$LOG" 2>&1; then
  log "installed ${WHEELS[*]} into $LIB (pip --no-deps --target)"
else
  log "pip could not install them for $("$PY" -V 2>&1); unzipping what fits this interpreter"
  "$PY" - "$LIB" "${WHEELS[@]}" >> "$LOG" 2>&1 <<'PY'
import sys, sysconfig, zipfile
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
for whl in sys.argv[2:]:
    if "-py3-none-any" in whl or f"-{tag}-" in whl:
        zipfile.ZipFile(whl).extractall(sys.argv[1]); print("unzipped", whl)
    else:
        print("skipped", whl, "(not for", tag + ")")
PY
fi
export PYTHONPATH="$LIB:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False  # CUDA IPC cannot share VMM allocations
if ! "$PY" -c "import nixl, sys; from nixl import _api; print('nixl from', nixl.__file__)" >> "$LOG" 2>&1; then
  log "nixl is not importable: nothing to measure"; exit 3
fi
if [ "$DEVICE" = auto ]; then
  DEVICE=$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
fi
log "device: $DEVICE"

SHAPE=()
[ "$SMOKE" = 1 ] && SHAPE=(--layers 2 --heads 2 --head-size 32 --tokens 64,128 --reps 2 --handshake-reps 2)
if [ "$DEVICE" = cuda ]; then
  VARIANTS=("cuda_ipc,cuda_copy,sm,self" "cuda_ipc,cuda_copy,tcp,self" "cuda_ipc,cuda_copy,sm,tcp,self"
            "default" "cuda_copy,tcp,self" "cuda_copy,sm,self")
else
  VARIANTS=("default" "sm,self" "tcp,self")
fi

log "## probes (one pull of 1024 tokens, bytes verified)"
CHOSEN=""
n=0
for tls in "${VARIANTS[@]}"; do
  n=$((n + 1))
  left=$((BUDGET - (SECONDS - START)))
  if [ $left -lt 150 ]; then log "probe $n ($tls): skipped, $left s left"; continue; fi
  if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
  t0=$SECONDS
  UCX_PROTO_INFO=y timeout 90 "$PY" benchmarks/gpu_kv.py --device "$DEVICE" --quick "${SHAPE[@]}" \
      --out "$OUT/probe-$n" > "$OUT/probe-$n.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then verdict=PASS; else verdict="FAIL rc=$rc"; fi
  log "probe $n UCX_TLS=$tls: $verdict in $((SECONDS - t0)) s"
  if [ $rc -ne 0 ]; then
    grep -E "Error|error|ERR|refused|not supported|unreachable|FAILED" "$OUT/probe-$n.log" | tail -4 | sed 's/^/    /' | tee -a "$LOG"
  else
    grep -E "^\| .*(cuda_ipc|cuda_copy|cma|posix|sysv|tcp).*\|" "$OUT/probe-$n.log" | sort -u | head -6 | sed 's/^/    /' | tee -a "$LOG"
    [ -z "$CHOSEN" ] && CHOSEN=$tls
    break  # the first that works is measured; the ones after it were not needed
  fi
done

FULL_DEVICE=$DEVICE
if [ -z "$CHOSEN" ] && [ "$DEVICE" = cuda ]; then
  log "no UCX_TLS variant moved VRAM between the two processes; measuring DRAM caches (--device cpu) instead"
  FULL_DEVICE=cpu CHOSEN=default
fi
if [ -z "$CHOSEN" ]; then log "no transport worked"; exit 4; fi
if [ "$CHOSEN" = default ]; then unset UCX_TLS; else export UCX_TLS=$CHOSEN; fi
left=$((BUDGET - (SECONDS - START) - 15))
log "## full run: --device $FULL_DEVICE UCX_TLS=${UCX_TLS:-default} (timeout ${left} s)"
timeout "$left" "$PY" benchmarks/gpu_kv.py --device "$FULL_DEVICE" "${SHAPE[@]}" --out "$OUT" \
    > "$OUT/full.log" 2>&1
rc=$?
tail -n +1 "$OUT/gpu_kv.txt" 2>/dev/null >> "$LOG" || tail -20 "$OUT/full.log" >> "$LOG"
log "full run rc=$rc after $((SECONDS - START)) s in all"
exit $rc
