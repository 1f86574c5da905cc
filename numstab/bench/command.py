"""``numstab bench``: the command-line arguments, checked, turned into a runner.Options."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
from pathlib import Path

from numstab.bench.spec import (
    FAULTS,
    FRAMEWORKS,
    PRECISIONS,
    PRESETS,
    REMEDY_PARTS,
    build_grid,
    parse_lrs,
    parse_names,
    parse_remedies,
    parse_seeds,
    parse_stack,
)
from numstab.errors import InvalidArgumentError, NumstabError

RESULTS_ROOT = Path("bench-results")  # covered by the repository's .gitignore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the small preset (minutes on a CPU)")
    size.add_argument(
        "--preset", choices=tuple(PRESETS), help="tiny (CI), quick, sweep, full (default)"
    )
    parser.add_argument("--frameworks", help=f"comma-separated, of {','.join(FRAMEWORKS)} (all)")
    parser.add_argument("--precisions", help=f"comma-separated, of {','.join(PRECISIONS)} (all)")
    parser.add_argument(
        "--remedies",
        help=f"'none' or parts of {','.join(REMEDY_PARTS)} joined by '+' (e.g. ls+clip+qk_norm):"
        " run every precision x remedy x fault",
    )
    parser.add_argument(
        "--stack",
        help="native (each framework's own AMP recipe), numstab, or both (preset's default)",
    )
    parser.add_argument(
        "--lrs", help="peak learning rates to sweep, e.g. 1e-3,3e-3,1e-2 (at least two)"
    )
    parser.add_argument(
        "--faults",
        help=f"comma-separated, of {','.join(FAULTS)} (one fault per run):"
        " run every precision x remedy x fault",
    )
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--steps", type=int, help="training steps per run (preset's default)")
    parser.add_argument("--fault-step", type=int, help="step of the injected faults (steps/3)")
    parser.add_argument("--seeds", help="a count N (seeds 0..N-1) or a list '0,3' (default 0)")
    parser.add_argument(
        "--out", type=Path, help="report folder (default: a new dated folder in bench-results/)"
    )
    parser.add_argument("--resume", action="store_true", help="continue the runs in --out")
    parser.add_argument(
        "--jobs", type=int, default=1, help="frameworks run at once (>1 skews timings)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op CPU threads per framework (1)"
    )
    parser.add_argument(
        "--compare", nargs=2, metavar=("A", "B"), type=Path, help="compare two results.json"
    )


def _require_extras() -> None:
    missing = [m for m in ("matplotlib", "rich") if importlib.util.find_spec(m) is None]
    if missing:
        raise NumstabError(
            f"numstab bench needs {' and '.join(missing)}: pip install 'numstab[bench]'"
        )


def _preset(args: argparse.Namespace):
    preset = PRESETS["quick" if args.quick else (args.preset or "full")]
    changes: dict = {}
    if args.steps is not None:
        if args.steps < 4:
            raise InvalidArgumentError(f"Expected --steps >= 4. Received: --steps={args.steps}")
        ratio = preset.warmup_steps / preset.steps
        changes.update(steps=args.steps, warmup_steps=max(1, round(ratio * args.steps)))
    steps = changes.get("steps", preset.steps)
    if args.fault_step is not None:
        if not 0 <= args.fault_step < steps:
            raise InvalidArgumentError(
                f"Expected 0 <= --fault-step < steps ({steps}). "
                f"Received: --fault-step={args.fault_step}"
            )
        changes["fault_step"] = args.fault_step
    return dataclasses.replace(preset, **changes)


def options(args: argparse.Namespace, command: list[str]):
    from numstab.bench.runner import Options

    if args.jobs < 1:
        raise InvalidArgumentError(f"Expected --jobs >= 1. Received: --jobs={args.jobs}")
    if args.threads < 1:
        raise InvalidArgumentError(f"Expected --threads >= 1. Received: --threads={args.threads}")
    if args.resume and args.out is None:
        raise InvalidArgumentError("Expected --out DIR with --resume (the folder to continue)")
    preset = _preset(args)
    frameworks = parse_names("--frameworks", args.frameworks, FRAMEWORKS) or FRAMEWORKS
    precisions = parse_names("--precisions", args.precisions, PRECISIONS)
    remedies = parse_remedies(args.remedies)
    stacks = parse_stack(args.stack, preset.stacks)
    lrs = parse_lrs(args.lrs, preset.lrs or (preset.base_lr,))
    faults = parse_names("--faults", args.faults, FAULTS)
    seeds = parse_seeds(args.seeds)
    grid = build_grid(preset, precisions, remedies, faults)
    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = RESULTS_ROOT / f"numstab-bench-{preset.name}-{stamp}"
    return Options(
        preset=preset,
        frameworks=frameworks,
        grid=grid,
        seeds=seeds,
        device=args.device,
        stacks=stacks,
        lrs=lrs,
        out=out,
        resume=args.resume,
        jobs=args.jobs,
        threads=args.threads,
        command=command,
    )


def main(args: argparse.Namespace, command: list[str]) -> int:
    """Run (or compare); NumstabError propagates to the CLI, which prints it (exit 2)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.compare:
        from numstab.bench.compare import compare

        print(compare(*args.compare))
        return 0
    opts = options(args, command)  # every argument checked before anything runs
    _require_extras()
    from rich.console import Console

    from numstab.bench import runner

    return runner.run(opts, Console(stderr=True, soft_wrap=True))
