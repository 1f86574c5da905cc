"""What the benchmark trains and which runs make up a grid: presets, run specs, name checks.

A run is one (framework, precision, remedy, fault, seed, stack, peak learning rate). Its
``key`` (e.g. ``"torch|fp16|ls+clip|nan_batch|0|native|0.003"``) identifies it in
results.json, for ``--resume`` and ``--compare``. No framework is imported here.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from numstab import frameworks as registry
from numstab.errors import InvalidArgumentError

#: the frameworks with a benchmark model (``numstab/frameworks/<name>/bench.py``)
FRAMEWORKS = tuple(name for name in registry.FRAMEWORKS if registry.has_module(name, "bench"))
PRECISIONS = ("fp32", "bf16", "fp16")
STACKS = ("native", "numstab")
REMEDY_PARTS = ("ls", "clip", "qk_norm", "z_loss")  # combined with '+', in this order
REMEDIES = ("none", "clip", "ls", "ls+clip", "qk_norm", "z_loss", "ls+clip+qk_norm+z_loss")
Z_LOSS = 1e-4  # z-loss coefficient (Wortsman et al. 2023)
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
    stacks: tuple[str, ...] = ("numstab",)  # default --stack
    lrs: tuple[float, ...] = ()  # default --lrs (empty: base_lr only)

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    def at_fault(self) -> int:
        return self.steps // 3 if self.fault_step is None else self.fault_step

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["grid"] = [list(g) for g in self.grid]
        out["stacks"] = list(self.stacks)
        out["lrs"] = list(self.lrs)
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

#: the model and batch of the quick and sweep presets (the sweep varies the learning rate)
_QUICK_MODEL = {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "context": 32, "batch": 4}

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
            ("fp16", "ls+clip", "nan_batch"),  # and its no-remedy twin fp16/none/nan_batch
        ),
        agreement_steps=12,
        fast_compile=True,
        stacks=("native", "numstab"),
    ),
    "quick": Preset(
        "quick",
        **_QUICK_MODEL,
        steps=48,
        warmup_steps=8,
        grid=_QUICK_GRID,
        stacks=("native", "numstab"),
    ),
    # CPU learning-rate sweep (Wortsman et al. 2023): the quick model, 100 steps, bf16, with
    # and without qk_norm / z_loss, 4 peak learning rates, both stacks
    "sweep": Preset(
        "sweep",
        **_QUICK_MODEL,
        steps=100,
        warmup_steps=10,
        grid=(
            ("bf16", "none", "none"),
            ("bf16", "qk_norm", "none"),
            ("bf16", "z_loss", "none"),
        ),
        stacks=("native", "numstab"),
        lrs=(3e-3, 1e-2, 3e-2, 1e-1),
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
    stack: str = "numstab"
    lr: float | None = None  # peak learning rate; None: the preset's base_lr (old keys)

    @property
    def key(self) -> str:
        parts = (self.framework, self.precision, self.remedy, self.fault, str(self.seed))
        if self.lr is None and self.stack == "numstab":
            return "|".join(parts)  # a results file of schema numstab-bench/1
        return "|".join((*parts, self.stack, format_lr(self.lr)))

    @property
    def config(self) -> str:
        """The framework-independent part: 'fp16/ls+clip/nan_batch'."""
        return f"{self.precision}/{self.remedy}/{self.fault}"

    def has(self, part: str) -> bool:
        return part in self.remedy.split("+")

    @property
    def clip(self) -> bool:
        return self.has("clip")

    @property
    def loss_scaling(self) -> bool:
        return self.has("ls")

    def peak_lr(self, preset: Preset) -> float:
        return preset.base_lr if self.lr is None else self.lr

    def with_(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_key(cls, key: str) -> RunSpec:
        parts = key.split("|")
        framework, precision, remedy, fault, seed = parts[:5]
        if len(parts) == 7:
            lr = None if parts[6] == "None" else float(parts[6])
            return cls(framework, precision, remedy, fault, int(seed), parts[5], lr)
        return cls(framework, precision, remedy, fault, int(seed))


def format_lr(lr: float | None) -> str:
    return "None" if lr is None else format(lr, "g")


def preset_from_dict(fields: dict[str, Any]) -> Preset:
    fields = dict(fields)
    fields["grid"] = tuple(map(tuple, fields["grid"]))
    for name in ("stacks", "lrs"):
        if name in fields:
            fields[name] = tuple(fields[name])
    return Preset(**fields)


def canonical_remedy(name: str) -> str | None:
    """'clip+ls' -> 'ls+clip'; None when a part is unknown or repeated."""
    if name == "none":
        return name
    parts = name.split("+")
    if len(set(parts)) != len(parts) or any(p not in REMEDY_PARTS for p in parts):
        return None
    return "+".join(p for p in REMEDY_PARTS if p in parts)


def parse_remedies(text: str | None) -> tuple[str, ...] | None:
    """'none,ls+clip,clip+qk_norm' -> canonical names; every part checked."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if canonical_remedy(n) is None]
    if bad or not names:
        raise InvalidArgumentError(
            "Expected --remedies to be a comma-separated list of 'none' or combinations of "
            f"{', '.join(REMEDY_PARTS)} joined by '+' (e.g. ls+clip+qk_norm). "
            f"Received: --remedies={text!r}" + (f" (unknown: {', '.join(bad)})" if bad else "")
        )
    return tuple(dict.fromkeys(canonical_remedy(n) for n in names))


def parse_stack(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """'native' | 'numstab' | 'both' -> the stacks to run."""
    if text is None:
        return default
    if text == "both":
        return STACKS
    if text in STACKS:
        return (text,)
    raise InvalidArgumentError(
        f"Expected --stack to be one of native, numstab, both. Received: --stack={text!r}"
    )


def parse_lrs(text: str | None, default: tuple[float, ...]) -> tuple[float, ...]:
    """'1e-3,3e-3' -> peak learning rates: at least two, each a positive finite number."""
    if text is None:
        return default
    try:
        lrs = tuple(dict.fromkeys(float(p) for p in text.split(",") if p.strip()))
    except ValueError:
        lrs = ()
    if len(lrs) < 2 or any(not (0.0 < lr < float("inf")) for lr in lrs):
        raise InvalidArgumentError(
            "Expected --lrs to be a comma-separated list of at least two distinct positive "
            f"learning rates (e.g. 1e-3,3e-3,1e-2). Received: --lrs={text!r}"
        )
    return lrs


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


#: the largest seed count ``--seeds N`` takes
MAX_SEEDS = 10_000


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
        if parts[0] > MAX_SEEDS:  # range() of a count past ssize_t raised OverflowError
            raise InvalidArgumentError(
                f"Expected --seeds to be a count N <= {MAX_SEEDS} (each seed trains the whole "
                f"grid once more). Received: --seeds={text!r}"
            )
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
    agreement check and every gap to fp32 need it. Every remedy comes with its no-remedy
    twin (same precision and fault, remedy ``none``), so that its effect can be read."""
    if remedies is None and faults is None:
        grid = [g for g in preset.grid if precisions is None or g[0] in precisions]
    else:
        grid = list(
            itertools.product(precisions or PRECISIONS, remedies or ("none",), faults or ("none",))
        )
    with_twins = []
    for p, r, f in grid:
        if r != "none":
            with_twins.append((p, "none", f))
        with_twins.append((p, r, f))
    return [REFERENCE] + [g for g in dict.fromkeys(with_twins) if g != REFERENCE]


def plan_runs(
    frameworks: tuple[str, ...],
    grid: list[tuple[str, str, str]],
    seeds: tuple[int, ...],
    stacks: tuple[str, ...] = ("numstab",),
    lrs: tuple[float | None, ...] = (None,),
) -> list[RunSpec]:
    """Every run, framework-major (one worker process per framework), reference first."""
    return [
        RunSpec(fw, p, r, f, s, stack, lr)
        for fw in frameworks
        for s in seeds
        for lr in lrs
        for stack in stacks
        for (p, r, f) in grid
    ]
