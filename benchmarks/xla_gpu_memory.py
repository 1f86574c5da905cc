"""XLA:GPU's memory plan for JAX's fused linear cross-entropy at issue 20's GPU shape, no GPU.

What is measured
----------------
``benchmarks/memory.py``'s JAX runs (``jax_program``: unfused, fused, and the floors: one
chunk with a bfloat16 ``dweight``, and one summing ``dweight`` in float32), lowered with
abstract inputs (no data) for a compile-only H200 (``benchmarks/_xla_gpu.py``). Each row is
XLA's buffer assignment for one execution beyond the inputs: ``temp + outputs not aliased to
the arguments`` of ``compiled.memory_analysis()``. That is what ``memory.py --device gpu``
reports as a JAX step's peak on a GPU (JAX's peak counter cannot be reset, and once a
program has compiled it holds the compilation's peak). numstab's fused path is traced as on
a GPU (its 1 GiB chunk budget, products added into ``dweight`` in the GEMM's epilogue:
``_xla_gpu.traced_as_gpu``). Default shape: tokens 32768, d_model 4096, vocab 131072,
bfloat16, the fused path's default chunk.

Goal (issue 20, goal 5): fused <= 1.10 x the floor. Printed: MiB per run, fused over
unfused, fused over each floor and the verdict; ``--json`` rows carry ``ratio``, ``goal``
and ``meets_goal``. A plan, not a measurement of a run: ``memory.py --device gpu`` runs it.

Usage (the CUDA plugin installed apart, see ``benchmarks/_xla_gpu.py``):
    JAX_PLATFORMS=cpu PYTHONPATH=/tmp/jax-cuda python benchmarks/xla_gpu_memory.py
        [--tokens N --d-model D --vocab V] [--chunk-size C] [--dtype bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _xla_gpu, memory
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MIB = 2**20


def plans(args: argparse.Namespace) -> dict[str, int]:
    """Run name -> bytes XLA assigns one execution beyond its arguments."""
    import jax
    import jax.numpy as jnp
    from _xla_gpu import compile_only_device, traced_as_gpu
    from memory import F32_SUM_FLOOR, jax_program

    from numstab.backends import load_backend
    from numstab.fused_cross_entropy import default_chunk_size

    sharding = jax.sharding.SingleDeviceSharding(compile_only_device("gpu"))

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    h = spec((args.tokens, args.d_model), args.dtype)
    w = spec((args.vocab, args.d_model), args.dtype)
    y = spec((args.tokens,), jnp.int32)
    budget = load_backend("jax").fused_chunk_bytes_gpu
    chunk = args.chunk or default_chunk_size(args.tokens, args.vocab, budget)
    out = {}
    with traced_as_gpu():
        for variant in ("unfused", "fused", "floor", F32_SUM_FLOOR):
            # the floors take the fused path's chunk; the fused path its own default
            rows = chunk if variant != "fused" else args.chunk
            plan = jax_program(variant, rows).lower(h, w, y).compile().memory_analysis()
            out[variant] = (
                plan.temp_size_in_bytes + plan.output_size_in_bytes - plan.alias_size_in_bytes
            )
    out["chunk"] = chunk
    return out


def main() -> None:
    from memory import F32_SUM_FLOOR, MEMORY_GOAL

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--chunk-size", dest="chunk", type=int, default=None)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    mib = plans(args)
    chunk = mib.pop("chunk")
    print(
        f"XLA:GPU plan (compile-only H200), tokens {args.tokens} x d_model {args.d_model} x "
        f"vocab {args.vocab}, {args.dtype}, floors at {chunk}-row chunks"
    )
    for name, size in mib.items():
        print(f"  {name:<10} {size / MIB:9.0f} MiB")
    fused = mib["fused"]
    print(f"  fused / unfused {fused / mib['unfused']:.3f}")
    rows = []
    for floor in ("floor", F32_SUM_FLOOR):
        ratio = fused / mib[floor]
        verdict = "meets goal" if ratio <= MEMORY_GOAL else "MISSES goal"
        print(f"  fused / {floor:<9} {ratio:.3f} (goal {MEMORY_GOAL}) [{verdict}]")
        rows.append(
            {
                "backend": "jax",
                "device": "gpu (XLA plan, compile-only H200)",
                "floor": floor,
                "fused_mib": fused / MIB,
                "floor_mib": mib[floor] / MIB,
                "unfused_mib": mib["unfused"] / MIB,
                "ratio": ratio,
                "goal": MEMORY_GOAL,
                "meets_goal": ratio <= MEMORY_GOAL,
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
