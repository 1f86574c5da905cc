"""Compiling for a GPU without one: an H200 described to XLA, as a compile-only JAX device.

JAX's CUDA plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` of the installed jax
version, not a numstab dependency, ~180 MB) compiles for a target description with no GPU and
no driver present. Install it apart, so that the usual environment does not look for a GPU
at import:

    v=$(python -c "import jax; print(jax.__version__)")
    pip install --no-deps --target /tmp/jax-cuda "jax-cuda12-plugin==$v" "jax-cuda12-pjrt==$v"
    JAX_PLATFORMS=cpu PYTHONPATH=/tmp/jax-cuda python benchmarks/xla_gpu_kernels.py

``benchmarks/xla_gpu_kernels.py`` (the guard's kernels) and ``benchmarks/xla_gpu_memory.py``
(fused cross-entropy's buffers) use it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

# the fields of XLA's H200 spec that this jax version's GpuTargetConfigProto parses
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  driver_version: "12.8.0" runtime_version: "12.8.0" compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0" name: "NVIDIA H200" device_vendor: "NVIDIA Corporation"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200 141GB HBM3e"
"""


def compile_only_device(platform: str):
    """A device to compile for: an H200 described by ``H200`` (no GPU needed), or the CPU."""
    import jax

    if platform == "cpu":
        return jax.devices("cpu")[0]
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            "h200", "cuda", target_config=H200, topology="1x1x1"
        )
    except Exception as e:  # no CUDA plugin: say how to get one
        sys.exit(f"cannot compile for a GPU here ({e}); see benchmarks/_xla_gpu.py")
    return topology.devices[0]


def abstract(tree: Any, device: Any) -> Any:
    """``tree``'s arrays as shapes and dtypes placed on ``device``: what ``lower`` needs to
    compile for a device that cannot hold data."""
    import jax
    import jax.numpy as jnp

    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding), tree
    )


@contextlib.contextmanager
def traced_as_gpu() -> Iterator[None]:
    """numstab's JAX backend takes its GPU paths while tracing (fused cross-entropy's chunk
    budget and in-epilogue accumulation): a traced value's platform is JAX's default
    backend, the CPU here, not the compile-only device the program is lowered for."""
    from numstab.frameworks.jax.backend import JaxBackend

    saved = JaxBackend.on_gpu
    JaxBackend.on_gpu = lambda self, x: True
    try:
        yield
    finally:
        JaxBackend.on_gpu = saved
