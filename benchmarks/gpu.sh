#!/usr/bin/env bash
# Everything numstab checks on a GPU, within 10 minutes on one GPU (torch and JAX;
# TensorFlow stays on the CPU unless it sees a GPU). Correctness first, the two of them at
# once (neither is timed); then the timed benchmarks, one at a time:
#   1. the conformance suite on the GPU  ‖  numstab bench --quick --device gpu (the AMP
#      stability runs, torch and jax, both stacks)                         (limits 220 s each)
#   2. benchmarks/memory.py --device gpu: issue 20's shape, 32k x 4096 x 128k in bf16 (130 s)
#   3. benchmarks/guard.py --device gpu --quick: step time and CUDA syncs per step   (120 s)
#   4. benchmarks/loss_scaling_torch.py --device cuda: GradScaler parity, no host sync (40 s)
#   5. benchmarks/overhead.py --device gpu --quick: numstab against native calls      (60 s)
# Usage: bash benchmarks/gpu.sh [OUT_DIR]   (default bench-results/gpu-<date>, gitignored)
# Each step's output goes to OUT_DIR/<step>.log (JSON beside it); the exit code is the first
# failing step's. pytest-xdist, where installed, spreads the conformance suite over 8 workers.
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
  tail -n 4 "$OUT/$name.log"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, jax; print('torch', torch.__version__, torch.cuda.is_available(),
'| jax', jax.__version__, jax.devices())"

workers=()
if python -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
# the pytest workers share the GPU: JAX must not take 75% of it in each
XLA_PYTHON_CLIENT_PREALLOCATE=false step conformance 220 \
  python -m pytest conformance_tests --device gpu -q -p no:cacheprovider "${workers[@]}" &
conformance=$!
XLA_PYTHON_CLIENT_PREALLOCATE=false step bench 220 python -c "import sys; from numstab.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --quick --device gpu --frameworks torch,jax --stack both --jobs 2 --out "$OUT/bench"
wait "$conformance" || true
grep -E "passed|failed|error" "$OUT/conformance.log" | tail -n 3
grep -q " passed" "$OUT/conformance.log" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/conformance.log" \
  || { [ "$status" -eq 0 ] && status=1; }

step memory 130 python benchmarks/memory.py --device gpu --backends torch,jax \
  --json "$OUT/memory.json"
step guard 120 python benchmarks/guard.py --device gpu --quick --backends torch,jax \
  --json "$OUT/guard.json"
step loss_scaling 40 python benchmarks/loss_scaling_torch.py --device cuda
step overhead 60 python benchmarks/overhead.py --device gpu --quick --backends torch,jax \
  --json "$OUT/overhead.json"
echo "gpu.sh: exit $status; results in $OUT"
exit "$status"
