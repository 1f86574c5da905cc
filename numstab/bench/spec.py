"""What the benchmark trains and which runs make up a grid: presets, run specs, name checks.

A run is one (framework, precision, remedy, fault, seed). Its ``key`` (e.g.
``"torch|fp16|ls+clip|nan_batch|0"``) identifies it in results.json, for ``--resume`` and
``--compare``. No framework is imported here.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from numstab.errors import InvalidArgumentError

FRAMEWORKS = ("torch", "jax", "tensorflow")
PRECISIONS = ("fp32", "bf16", "fp16")
REMEDIES = ("none", "clip", "ls", "ls+clip")
FAULTS = ("none", "nan_batch", "lr_spike", "logit_blowup")
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
REFERENCE = ("fp32", "none", "none")  # (precision, remedy, fault) every framework runs first


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model, data and schedule sizes, and the default grid of (precision, remedy, fault)."""

    name: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    context: int
    batch: int
    steps: int
    warmup_steps: int
    grid: tuple[tuple[str, str, str], ...]
    base_lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_norm: float = 1.0
    scale_growth_interval: int = 16  # LossScaler growth_interval (torch's default is 2000)
    fault_step: int | None = None  # default: a third into the run
    lr_spike: float = 100.0
    logit_scale: float = 1000.0
    agreement_steps: int = 10
    agreement_tol: float = 2e-3  # max |loss_fw - loss_torch| over the first agreement_steps
    divergence_patience: int = 8  # consecutive non-finite losses that end a run
    fast_compile: bool = False  # XLA LLVM optimisation off (CI preset: its timings mean little)

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    def at_fault(self) -> int:
        return self.steps // 3 if self.fault_step is None else self.fault_step

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["grid"] = [list(g) for g in self.grid]
        out["fault_step"] = self.at_fault()
        return out


_QUICK_GRID = (
    ("fp32", "none", "none"),
    ("bf16", "none", "none"),
    ("fp16", "none", "none"),
    ("fp16", "ls", "none"),
    ("fp16", "none", "nan_batch"),
    ("fp16", "ls+clip", "nan_batch"),
    ("fp32", "none", "lr_spike"),
    ("fp32", "clip", "lr_spike"),
    ("fp16", "ls", "logit_blowup"),
)

PRESETS: dict[str, Preset] = {
    # seconds per framework: the CI end-to-end test
    "tiny": Preset(
        "tiny",
        layers=1,
        d_model=32,
        heads=2,
        vocab=64,
        context=16,
        batch=4,
        steps=12,
        warmup_steps=3,
        grid=(
            ("fp32", "none", "none"),
            ("fp16", "ls", "none"),
            ("fp16", "ls+clip", "nan_batch"),
        ),
        agreement_steps=12,
        fast_compile=True,
    ),
    "quick": Preset(
        "quick",
        layers=2,
        d_model=64,
        heads=4,
        vocab=256,
        context=32,
        batch=4,
        steps=48,
        warmup_steps=8,
        grid=_QUICK_GRID,
    ),
    "full": Preset(
        "full",
        layers=4,
        d_model=128,
        heads=4,
        vocab=512,
        context=64,
        batch=16,
        steps=400,
        warmup_steps=40,
        base_lr=1e-3,
        min_lr=1e-4,
        scale_growth_interval=100,
        grid=tuple(
            itertools.chain(
                ((p, r, "none") for p in PRECISIONS for r in REMEDIES),
                ((p, r, f) for p in PRECISIONS for r in ("none", "ls+clip") for f in FAULTS[1:]),
            )
        ),
        agreement_steps=20,
    ),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    framework: str
    precision: str
    remedy: str
    fault: str
    seed: int

    @property
    def key(self) -> str:
        return "|".join((self.framework, self.precision, self.remedy, self.fault, str(self.seed)))

    @property
    def config(self) -> str:
        """The framework-independent part: 'fp16/ls+clip/nan_batch'."""
        return f"{self.precision}/{self.remedy}/{self.fault}"

    @property
    def clip(self) -> bool:
        return "clip" in self.remedy

    @property
    def loss_scaling(self) -> bool:
        return "ls" in self.remedy

    @classmethod
    def from_key(cls, key: str) -> RunSpec:
        framework, precision, remedy, fault, seed = key.split("|")
        return cls(framework, precision, remedy, fault, int(seed))


def parse_names(flag: str, text: str | None, choices: tuple[str, ...]) -> tuple[str, ...] | None:
    """'a,b' -> ('a', 'b'), every name checked against ``choices`` (None stays None)."""
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in choices]
    if bad or not names:
        raise InvalidArgumentError(
            f"Expected {flag} to be a comma-separated list of {', '.join(choices)}. "
            f"Received: {flag}={text!r}" + (f" (unknown: {', '.join(bad)})" if bad else "")
        )
    return tuple(dict.fromkeys(names))


def parse_seeds(text: str | None) -> tuple[int, ...]:
    """'0,1,2' or '3' (meaning 0..2) -> seeds."""
    if text is None:
        return (0,)
    try:
        parts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        parts = []
    if not parts or any(p < 0 for p in parts):
        raise InvalidArgumentError(
            f"Expected --seeds to be a count N (seeds 0..N-1) or a comma-separated list of "
            f"non-negative ints. Received: --seeds={text!r}"
        )
    if "," not in text:
        return tuple(range(parts[0])) if parts[0] > 0 else (0,)
    return tuple(dict.fromkeys(parts))


def build_grid(
    preset: Preset,
    precisions: tuple[str, ...] | None,
    remedies: tuple[str, ...] | None,
    faults: tuple[str, ...] | None,
) -> list[tuple[str, str, str]]:
    """The preset's grid, filtered by ``precisions``; the full product when ``remedies`` or
    ``faults`` are given. The fp32 reference comes first and is always included: the
    agreement check and every gap to fp32 need it."""
    if remedies is None and faults is None:
        grid = [g for g in preset.grid if precisions is None or g[0] in precisions]
    else:
        grid = list(
            itertools.product(precisions or PRECISIONS, remedies or ("none",), faults or ("none",))
        )
    return [REFERENCE] + [g for g in dict.fromkeys(grid) if g != REFERENCE]


def plan_runs(
    frameworks: tuple[str, ...], grid: list[tuple[str, str, str]], seeds: tuple[int, ...]
) -> list[RunSpec]:
    """Every run, framework-major (one worker process per framework), reference first."""
    return [RunSpec(fw, p, r, f, s) for fw in frameworks for s in seeds for (p, r, f) in grid]
