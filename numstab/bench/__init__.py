"""``numstab bench``: the AMP stability benchmark. The same decoder-only transformer LM, the
same initial weights and the same data order, trained in PyTorch, JAX and TensorFlow in
fp32, bf16 and fp16, with and without numstab's remedies, with faults injected on demand.

Modules: spec (presets, grid, names), corpus (synthetic data), weights (NumPy init), model
(the forward pass, written once), adamw, train (the step and the loop, written once),
fw_torch / fw_jax / fw_tensorflow (each framework's ops and autodiff), worker (one process
per framework), runner (orchestration, progress, resume), metrics, results, report, plots,
compare, command (the CLI arguments). Importing this package imports no framework.
"""
