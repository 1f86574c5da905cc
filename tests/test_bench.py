"""numstab bench: the tiny preset end to end on torch, jax and tensorflow (fp32 agreement,
report folder), bad input, Ctrl-C + --resume, a missing framework, --compare, and the pieces
the comparison rests on (AdamW's formula against torch's and optax's, the metrics)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import shutil
import sys

import numpy as np
import pytest

from numstab.bench import metrics, runner
from numstab.bench.adamw import AdamWState, adamw_update
from numstab.bench.spec import PRESETS, RunSpec
from numstab.cli import main

FRAMEWORKS = ("torch", "jax", "tensorflow")
PNG = b"\x89PNG\r\n\x1a\n"
LR = PRESETS["tiny"].base_lr


def _key(fw, precision, remedy, fault, stack="numstab", seed=0, lr=LR):
    return RunSpec(fw, precision, remedy, fault, seed, stack, lr).key


def _bench(*args: str) -> int:
    return main(["bench", *args])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny benchmark on the three frameworks, both stacks (the tiny preset's default;
    workers in parallel: CI seconds)."""
    missing = [fw for fw in FRAMEWORKS if importlib.util.find_spec(fw) is None]
    if missing:
        pytest.skip(f"the end-to-end benchmark needs all three frameworks; missing {missing}")
    out = tmp_path_factory.mktemp("bench") / "tiny"
    code = _bench("--preset", "tiny", "--out", str(out), "--jobs", "3")
    return code, out, json.loads((out / "results.json").read_text())


def test_tiny_end_to_end_writes_json_markdown_and_plots(tiny_run):
    code, out, data = tiny_run
    assert code == 0
    assert data["complete"] and not data["errors"]
    assert set(data["runs"]) == set(data["plan"])
    assert {fw: data["frameworks"][fw]["status"] for fw in FRAMEWORKS} == dict.fromkeys(
        FRAMEWORKS, "ok"
    )
    assert data["command"][:2] == ["numstab", "bench"]
    for name in ("loss_curves.png", "loss_scale.png", "stability_heatmap.png"):
        assert (out / name).read_bytes()[:8] == PNG
    report = (out / "report.md").read_text()
    assert "## fp32 agreement check" in report and "**passed**" in report
    assert report.index("## Findings") < report.index("## Setup")
    assert data["settings"]["stacks"] == ["native", "numstab"]
    assert {r["spec"]["stack"] for r in data["runs"].values()} == {"native", "numstab"}
    assert {r["spec"]["lr"] for r in data["runs"].values()} == {LR}
    for fw in FRAMEWORKS:
        assert f"| {fw} | ok |" in report


def test_fp32_runs_agree_step_by_step_across_the_three_frameworks(tiny_run):
    _, _, data = tiny_run
    agreement = data["agreement"]
    assert agreement["status"] == "passed"
    pairs = agreement["seeds"]["0"]["frameworks"]
    assert agreement["seeds"]["0"]["baseline"] == "torch"
    assert set(pairs) == {"jax", "tensorflow"}
    tiny = PRESETS["tiny"]
    for result in pairs.values():
        assert len(result["diffs"]) == tiny.steps
        assert result["max_abs_diff"] <= tiny.agreement_tol
    # the models learn (the comparison is not between three constant curves)
    losses = data["runs"][_key("torch", "fp32", "none", "none")]["record"]["loss"]
    assert losses[-1] < losses[0] - 0.1


def test_nan_batch_is_skipped_and_backs_the_loss_scale_off_in_every_framework(tiny_run):
    _, _, data = tiny_run
    fault_step = data["settings"]["preset"]["fault_step"]
    for fw, stack in itertools.product(FRAMEWORKS, ("native", "numstab")):
        run = data["runs"][_key(fw, "fp16", "ls+clip", "nan_batch", stack)]
        record, m = run["record"], run["metrics"]
        assert record["skipped"].index(True) == fault_step and m["skipped_steps"] == 1
        assert record["loss"][fault_step] is None and m["nonfinite_loss_steps"] == 1
        assert record["scale"][fault_step + 1] == record["scale"][fault_step] / 2
        assert not m["diverged"] and m["final_loss"] is not None
        assert m["gap_to_fp32"] is not None


def test_unknown_names_and_bad_numbers_are_clear_errors(tmp_path, capsys):
    cases = [
        (["--frameworks", "torch,pytorch"], "unknown: pytorch"),
        (["--precisions", "fp8"], "--precisions"),
        (["--remedies", "magic"], "--remedies"),
        (["--faults", "meteor"], "--faults"),
        (["--steps", "2"], "--steps >= 4"),
        (["--seeds", "x"], "--seeds"),
        (["--resume"], "--out"),
    ]
    for args, text in cases:
        out = [] if args == ["--resume"] else ["--out", str(tmp_path / "never")]
        assert _bench(*args, *out) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("numstab: error:") and text in err, (args, err)
    assert not (tmp_path / "never").exists()


def test_unwritable_output_and_existing_results_are_refused(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert _bench("--preset", "tiny", "--out", str(blocker / "sub")) == 2
    assert "--out" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text("{}")
    assert _bench("--preset", "tiny", "--out", str(tmp_path / "old")) == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "old" / "results.json").read_text() == "{}"  # nothing overwritten


def test_interrupt_saves_finished_runs_and_resume_completes_them(tmp_path, monkeypatch, capsys):
    """Ctrl-C after the first run of a two-lr sweep: that run is saved, exit 130; --resume
    runs only the rest and computes the sweep's sensitivities. jax is reported as not
    installed and the other framework still runs."""
    monkeypatch.setattr(runner, "installed", lambda fw: fw != "jax")
    real = metrics.run_metrics
    calls = []

    def interrupted_on_second_run(record, preset):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(record, preset)

    monkeypatch.setattr(metrics, "run_metrics", interrupted_on_second_run)
    out = tmp_path / "r"
    args = ["--preset", "tiny", "--frameworks", "torch,jax", "--precisions", "fp32,fp16"]
    args += ["--stack", "numstab", "--lrs", f"{LR},1e-2"]
    assert _bench(*args, "--steps", "6", "--out", str(out)) == runner.INTERRUPTED_EXIT
    assert "--resume --out" in capsys.readouterr().err
    first = json.loads((out / "results.json").read_text())
    assert list(first["runs"]) == [_key("torch", "fp32", "none", "none")]
    assert first["frameworks"]["jax"]["status"] == "not installed"
    assert len(first["plan"]) == 12 and not first["complete"]

    monkeypatch.setattr(metrics, "run_metrics", real)
    assert _bench("--resume", "--out", str(out)) == 0
    done = json.loads((out / "results.json").read_text())
    ref = _key("torch", "fp32", "none", "none")
    kept, before = done["runs"][ref], first["runs"][ref]
    assert kept["record"] == before["record"]  # not run again
    assert {k for k in done["runs"] if k.startswith("torch")} == {
        k for k in done["plan"] if k.startswith("torch")
    }
    assert not any(k.startswith("jax") for k in done["runs"])
    assert done["resumed_with"] and done["agreement"]["status"] == "not checked"
    assert "not installed" in (out / "report.md").read_text()
    sweep = {(e["precision"], e["remedy"], e["fault"]) for e in done["lr_sensitivity"]}
    assert sweep == {tuple(g) for g in done["settings"]["grid"]}
    assert all(e["framework"] == "torch" and e["lrs"] == [LR, 1e-2] for e in done["lr_sensitivity"])
    assert (out / "lr_sweep_torch.png").read_bytes()[:8] == PNG


def test_a_native_stack_whose_library_is_missing_is_skipped_with_the_reason(monkeypatch):
    pytest.importorskip("jax")
    from numstab.bench import worker

    monkeypatch.delitem(sys.modules, "numstab.frameworks.jax.bench_native", raising=False)
    monkeypatch.setitem(sys.modules, "jmp", None)  # import jmp raises ImportError
    reason = worker._native_module("jax")
    assert isinstance(reason, str) and "jmp" in reason


def test_compare_reports_changes_and_missing_runs(tiny_run, tmp_path, capsys):
    _, out, data = tiny_run
    data = json.loads(json.dumps(data))  # the fixture's dict stays as it was
    key = _key("jax", "fp16", "ls+clip", "nan_batch")
    data["runs"][key]["metrics"].update(final_loss=9.0, diverged=True, divergence_step=3)
    gone = _key("tensorflow", "fp16", "ls+clip", "nan_batch")
    data["runs"].pop(gone)
    (tmp_path / "b.json").write_text(json.dumps(data))
    assert _bench("--compare", str(out / "results.json"), str(tmp_path / "b.json")) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if key in line)
    assert "-> 9.000" in row and "no -> @3" in row
    assert "stability changed in 1" in text
    assert f"Only in A: `{gone}`" in text
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    assert _bench("--compare", str(out), str(tmp_path / "bad.json")) == 2
    assert "schema" in capsys.readouterr().err


def test_adamw_formula_matches_torch_and_optax():
    torch = pytest.importorskip("torch")
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(50).astype(np.float32)
    grads = [rng.standard_normal(50).astype(np.float32) for _ in range(5)]
    hp = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    lr = np.float32(0.01)

    ours = {"p": p0.copy()}
    state = AdamWState(
        np.int32(0), {"p": np.zeros(50, np.float32)}, {"p": np.zeros(50, np.float32)}
    )
    from numstab._dispatch import resolve_backend

    be = resolve_backend(p0)
    for g in grads:
        ours, state = adamw_update(be, ours, {"p": g}, state, lr, **hp)

    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([tp], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        tp.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(ours["p"], tp.detach().numpy(), rtol=0, atol=2e-6)

    tx = optax.adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    op = p0.copy()
    ostate = tx.init(op)
    for g in grads:
        updates, ostate = tx.update(g, ostate, op)
        op = optax.apply_updates(op, updates)
    np.testing.assert_allclose(ours["p"], np.asarray(op), rtol=0, atol=2e-6)


def test_divergence_final_loss_and_agreement_definitions():
    tiny = PRESETS["tiny"]
    chance = math.log(tiny.vocab)
    ok = [4.0, 3.9, 3.8, 3.7]
    record = {
        "loss": [*ok, None, 3.6, chance + 1, chance + 2],
        "grad_finite": [True] * 4 + [False] + [True] * 3,
        "skipped": [False] * 8,
        "scale": [1.0] * 8,
        "step_time": [1.0, 0.1, 0.2, 0.3, 0.1, 0.1, 0.1, 0.1],
        "steps_run": 8,
        "stopped_early_at": None,
        "peak_memory_bytes": 2**20,
        "peak_memory_source": "test",
    }
    m = metrics.run_metrics(record, tiny)
    assert not m["diverged"] and m["outcome"] == "worse than chance" and m["chance_step"] == 6
    assert m["final_loss"] == pytest.approx(chance + 2)  # finite: it did not learn, not broke
    assert m["nonfinite_loss_steps"] == 1 and m["nonfinite_grad_steps"] == 1
    assert m["time_per_step_ms"] == pytest.approx(100.0) and m["first_step_s"] == 1.0
    record["loss"] = [*ok, 3.6, 3.5, None, None]
    m = metrics.run_metrics(record, tiny)
    assert m["diverged"] and m["outcome"] == "non-finite" and m["divergence_step"] == 6
    record["loss"] = [*ok, None, 3.6, 3.5, 3.4]
    m = metrics.run_metrics(record, tiny)
    assert not m["diverged"] and m["final_loss"] == pytest.approx(3.4)

    def runs(offset):
        base = {"loss": [4.0 - 0.1 * i for i in range(tiny.steps)]}
        other = {"loss": [x + offset * (i == 1) for i, x in enumerate(base["loss"])]}
        return {
            RunSpec("torch", "fp32", "none", "none", 0).key: {"record": base},
            RunSpec("jax", "fp32", "none", "none", 0).key: {"record": other},
        }

    tol = tiny.agreement_tol
    assert (
        metrics.agreement(runs(tol / 2), ["torch", "jax"], {"seeds": [0]}, tiny)["status"]
        == "passed"
    )
    failed = metrics.agreement(runs(tol * 2), ["torch", "jax"], {"seeds": [0]}, tiny)
    assert failed["status"] == "FAILED"
    assert failed["seeds"]["0"]["frameworks"]["jax"]["first_step_over"] == 1


def test_copy_of_results_is_loadable_for_resume(tiny_run, tmp_path):
    """results.json is self-contained: a copied folder resumes with nothing left to run."""
    _, out, _ = tiny_run
    shutil.copytree(out, tmp_path / "copy")
    assert _bench("--resume", "--out", str(tmp_path / "copy")) == 0


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_native_stack_is_the_frameworks_own_and_agrees_with_numstab_in_fp32(tiny_run, framework):
    """fp32 native == fp32 numstab step by step; fp16 + ls+clip on the native stack records
    the framework's own scaler: GradScaler starts at 2**16, Keras's LossScaleOptimizer and
    jmp's DynamicLossScale (as set up) at 2**15; each halves at the NaN batch."""
    _, _, data = tiny_run
    pair = data["agreement"]["stacks"][f"{framework}|0"]
    assert pair["status"] == "passed"
    assert pair["frameworks"]["native"]["max_abs_diff"] <= PRESETS["tiny"].agreement_tol
    run = data["runs"][_key(framework, "fp16", "ls+clip", "nan_batch", "native")]
    scale, fault = run["record"]["scale"], data["settings"]["preset"]["fault_step"]
    first = {"torch": 2.0**16, "jax": 2.0**15, "tensorflow": 2.0**15}[framework]
    assert scale[0] == first and scale[fault] == first and scale[fault + 1] == first / 2
    numstab = data["runs"][_key(framework, "fp16", "ls+clip", "nan_batch")]
    assert numstab["record"]["scale"][0] == 2.0**16  # numstab's LossScaler: torch's default
    # the per-step instability measurements are recorded on both stacks
    for rec in (run["record"], numstab["record"]):
        assert all(v is not None and v > 0 for v in rec["out_logit_max"][:fault])
        assert all(v is not None and v > 0 for v in rec["attn_logit_max"][:fault])
        assert all(0 <= v < 0.5 for v in rec["grad_underflow_frac"])


def test_no_remedy_twins_outcomes_and_findings(tiny_run):
    _, out, data = tiny_run
    grid = [tuple(g) for g in data["settings"]["grid"]]
    assert ("fp16", "none", "nan_batch") in grid  # the twin of fp16/ls+clip/nan_batch
    broken = data["runs"][_key("jax", "fp16", "none", "nan_batch", "native")]["metrics"]
    assert broken["outcome"] == "non-finite" and broken["final_loss"] is None
    report = (out / "report.md").read_text()
    findings = report[report.index("## Findings") : report.index("## Setup")]
    assert "without a remedy 3 of 3 non-finite; with `ls+clip` all 3 learned" in findings
    assert "(#final-loss" in findings


def test_new_flags_bad_input_is_refused(tmp_path, capsys):
    cases = [
        (["--stack", "keras"], "--stack"),
        (["--remedies", "ls+magic"], "unknown: ls+magic"),
        (["--remedies", "ls+ls"], "--remedies"),
        (["--lrs", "1e-3"], "at least two"),
        (["--lrs", "1e-3,-1"], "--lrs"),
        (["--lrs", "0,1e-3"], "--lrs"),
        (["--lrs", "1e-3,x"], "--lrs"),
    ]
    for args, text in cases:
        assert _bench(*args, "--out", str(tmp_path / "never")) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("numstab: error:") and text in err, (args, err)
    assert not (tmp_path / "never").exists()


def test_remedies_combine_and_runs_default_into_a_gitignored_folder(tmp_path, monkeypatch):
    from numstab.bench import command, spec

    assert spec.parse_remedies("clip+ls,qk_norm+z_loss") == ("ls+clip", "qk_norm+z_loss")
    parser = __import__("argparse").ArgumentParser()
    command.add_arguments(parser)
    opts = command.options(parser.parse_args(["--preset", "tiny"]), ["numstab", "bench"])
    assert opts.out.parts[0] == "bench-results"
    assert opts.stacks == ("native", "numstab") and opts.lrs == (LR,)


def test_lr_sensitivity_definition():
    from numstab.bench.sensitivity import lr_sensitivity, sensitivity

    # mean(min(f, init)) - best; a non-finite run counts as the initial loss
    assert sensitivity([3.0, 2.0, None], 4.0) == pytest.approx((3 + 2 + 4) / 3 - 2)
    assert sensitivity([5.0, 2.0], 4.0) == pytest.approx((4 + 2) / 2 - 2)
    assert sensitivity([None, None], 4.0) is None
    settings = {
        "frameworks": ["torch"],
        "stacks": ["native"],
        "grid": [["fp16", "qk_norm", "none"]],
        "seeds": [0],
        "lrs": [1e-3, 1e-2],
    }
    runs = {
        RunSpec("torch", "fp16", "qk_norm", "none", 0, "native", lr).key: {
            "metrics": {"final_loss": f, "init_loss": 4.0}
        }
        for lr, f in ((1e-3, 3.0), (1e-2, None))
    }
    (entry,) = lr_sensitivity(runs, settings)
    assert entry["final_losses"] == [3.0, None] and entry["value"] == pytest.approx(0.5)
    assert {"framework", "stack", "precision", "remedy", "lrs", "init_loss"} <= set(entry)
