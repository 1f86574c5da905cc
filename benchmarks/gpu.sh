#!/usr/bin/env bash
# Everything numstab checks on a GPU, within 10 minutes on one GPU (torch and JAX;
# TensorFlow stays on the CPU unless it sees a GPU). Correctness first, the two of them at
# once (neither is timed); then the timed benchmarks, one at a time:
#   conformance ‖ bench: the conformance suite on the GPU ‖ numstab bench --quick --device
#     gpu (the AMP stability runs, torch and jax, both stacks)             (limits 150 s each)
#   memory: benchmarks/memory.py --device gpu, issue 20's shape, 32k x 4096 x 128k, bf16 (120 s)
#   guard_jax, guard_torch: benchmarks/guard.py --device gpu --quick: step time and host
#     syncs per step (torch: CUDA's own count; jax: both forms of the guard state) (70 s, 110 s)
#   loss_scaling: benchmarks/loss_scaling_torch.py --device cuda: GradScaler parity (40 s)
#   overhead: benchmarks/overhead.py --device gpu --quick: against native calls      (60 s)
# and, only when GPU_STEPS names it (not in "all": the run would pass 10 minutes):
#   chunks: memory.py --device gpu --backends torch at --chunk-size 1024 and 4096, beside
#     the default 2048 of the memory step: is the 1 GiB chunk budget the right one (120 s each)
#   guard_keras: benchmarks/guard.py --quick --backends keras with KERAS_BACKEND=jax, then
#     torch (no --device: Keras puts both on the GPU itself); skipped where keras does not
#     import. gpu.sh installs nothing: for a GPU machine without network, download the wheels
#     of keras 3.15.1 and its dependencies beforehand on one with network (pip download
#     keras==3.15.1 -d .whl; .whl/ is gitignored, so copy it over yourself) and install them
#     there (pip install --no-deps --target DIR .whl/*.whl; PYTHONPATH=DIR)  (90 s each)
# Usage: [GPU_STEPS=memory,guard_torch,...] bash benchmarks/gpu.sh [OUT_DIR]
#   (GPU_STEPS: the steps to run, default all; OUT_DIR: default bench-results/gpu-<date>,
#   gitignored)
# Each step's output goes to OUT_DIR/<step>.log, and each timed step's rows to
# OUT_DIR/<step>.json beside it (bench: OUT_DIR/bench/results.json and report.md); the exit
# code is the first failing step's. pytest-xdist, where installed, spreads the conformance
# suite over 8 workers. Without a CUDA GPU for torch, gpu.sh stops at once with exit 2
# (NUMSTAB_GPU_SH_ANYWAY=1 runs the steps anyway, each of which then exits non-zero with a
# one-line reason: a check of the script itself on a CPU machine).
set -u
cd "$(dirname "$0")/.."
OUT="${1:-bench-results/gpu-$(date +%Y%m%d-%H%M%S)}"
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
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" \
  && [ "${NUMSTAB_GPU_SH_ANYWAY:-0}" != 1 ]; then
  echo "gpu.sh: torch sees no CUDA GPU here; nothing run (NUMSTAB_GPU_SH_ANYWAY=1 to try)"
  exit 2
fi
mkdir -p "$OUT"  # after the GPU check: a machine without one is left no empty folder
want() { [[ ",${GPU_STEPS:-all}," == *",all,"* || ",${GPU_STEPS:-}," == *",$1,"* ]]; }

workers=()
if python -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
# the pytest workers and the bench share the GPU: JAX must not take 75% of it in each
if want conformance; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false step conformance 150 \
    python -m pytest conformance_tests --device gpu -q -p no:cacheprovider "${workers[@]}" &
fi
if want bench; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false step bench 150 python -c \
    "import sys; from numstab.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench --quick --device gpu --frameworks torch,jax --stack both --jobs 2 --out "$OUT/bench"
fi
if want conformance; then
  wait
  grep -E "passed|failed|error" "$OUT/conformance.log" | tail -n 3
  if ! grep -q " passed" "$OUT/conformance.log" \
    || grep -qE "[0-9]+ (failed|errors?)" "$OUT/conformance.log"; then
    [ "$status" -eq 0 ] && status=1
  fi
fi
want memory && step memory 120 python benchmarks/memory.py --device gpu --backends torch,jax \
  --json "$OUT/memory.json"
want guard_jax && step guard_jax 70 python benchmarks/guard.py --device gpu --quick \
  --backends jax --json "$OUT/guard_jax.json"
want guard_torch && step guard_torch 110 python benchmarks/guard.py --device gpu --quick \
  --backends torch --json "$OUT/guard_torch.json"
want loss_scaling && step loss_scaling 40 python benchmarks/loss_scaling_torch.py --device cuda \
  --json "$OUT/loss_scaling.json"
want overhead && step overhead 60 python benchmarks/overhead.py --device gpu --quick \
  --backends torch,jax --json "$OUT/overhead.json"
if [[ ",${GPU_STEPS:-}," == *",chunks,"* ]]; then
  for rows in 1024 4096; do
    step "chunks_$rows" 120 python benchmarks/memory.py --device gpu --backends torch \
      --chunk-size "$rows" --json "$OUT/chunks_$rows.json"
  done
fi
if [[ ",${GPU_STEPS:-}," == *",guard_keras,"* ]]; then
  if python -c "import keras" 2>/dev/null; then
    for kb in jax torch; do
      KERAS_BACKEND=$kb step "guard_keras_$kb" 90 python benchmarks/guard.py --quick \
        --backends keras --json "$OUT/guard_keras_$kb.json"
    done
  else
    echo "guard_keras: skipped (keras does not import)"
  fi
fi
echo "gpu.sh: exit $status; results in $OUT"
exit "$status"
