"""``numstab bench``: the AMP stability benchmark. The same decoder-only transformer LM, the
same initial weights and the same data order, trained in PyTorch, JAX and TensorFlow in
fp32, bf16 and fp16, on each framework's own AMP recipe and on numstab's uniform one, with
and without remedies, with faults injected on demand, over one or several learning rates.

Modules: spec (presets, grid, names), corpus (synthetic data), weights (NumPy init), model
(the forward pass, written once), adamw, train (numstab's step and the host loop shared by
every stack), worker (one process per framework), runner (orchestration, progress, resume),
metrics, sensitivity (the learning-rate sensitivity), results, report, findings (report.md's
opening sentences), plots, plots_sweep, compare, command (the CLI arguments). Each
framework's code is in its folder: ``numstab/frameworks/<name>/bench.py`` (its ops and
autodiff) and ``bench_native.py`` (its own AMP recipe). Importing this package imports no
framework.
"""
