#!/usr/bin/env bash
# Everything numstab checks on a GPU, within 10 minutes on one GPU (torch and JAX; TensorFlow
# stays on the CPU unless it sees a GPU):
#   1. the conformance suite on the GPU            (time limit 270 s)
#   2. benchmarks/memory.py --device gpu --quick   (time limit 100 s)
#   3. numstab bench --quick --device gpu, torch and jax, both stacks  (time limit 200 s)
# Usage: bash benchmarks/gpu.sh [OUT_DIR]   (default bench-results/gpu-<date>, gitignored)
# Each step's output goes to OUT_DIR/<step>.log; the exit code is the first failing step's.
set -u
cd "$(dirname "$0")/.."
OUT="${1:-bench-results/gpu-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export TF_CPP_MIN_LOG_LEVEL=3 NUMSTAB_TEST_BACKENDS="${NUMSTAB_TEST_BACKENDS:-numpy,torch,jax}"
status=0
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s (log: $OUT/$name.log)"
  tail -n 3 "$OUT/$name.log"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
step conformance 270 python -m pytest conformance_tests --device gpu -q -x -p no:cacheprovider
step memory 100 python benchmarks/memory.py --device gpu --quick --backends torch,jax \
  --json "$OUT/memory.json"
step bench 200 python -c "import sys; from numstab.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --quick --device gpu --frameworks torch,jax --stack both --out "$OUT/bench"
echo "gpu.sh: exit $status; results in $OUT"
exit "$status"
