"""numstab bench: the tiny preset end to end on torch, jax and tensorflow (fp32 agreement,
report folder), bad input, Ctrl-C + --resume, a missing framework, --compare, and the pieces
the comparison rests on (AdamW's formula against torch's and optax's, the metrics)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil

import numpy as np
import pytest

from numstab.bench import metrics, runner
from numstab.bench.adamw import AdamWState, adamw_update
from numstab.bench.spec import PRESETS, RunSpec
from numstab.cli import main

FRAMEWORKS = ("torch", "jax", "tensorflow")
PNG = b"\x89PNG\r\n\x1a\n"


def _bench(*args: str) -> int:
    return main(["bench", *args])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny benchmark on the three frameworks (workers in parallel: CI seconds)."""
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
    losses = data["runs"]["torch|fp32|none|none|0"]["record"]["loss"]
    assert losses[-1] < losses[0] - 0.1


def test_nan_batch_is_skipped_and_backs_the_loss_scale_off_in_every_framework(tiny_run):
    _, _, data = tiny_run
    fault_step = data["settings"]["preset"]["fault_step"]
    for fw in FRAMEWORKS:
        run = data["runs"][RunSpec(fw, "fp16", "ls+clip", "nan_batch", 0).key]
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
    """Ctrl-C after the first run: that run is saved, exit 130; --resume runs only the rest.
    jax is reported as not installed and the other framework still runs."""
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
    assert _bench(*args, "--steps", "6", "--out", str(out)) == runner.INTERRUPTED_EXIT
    assert "--resume --out" in capsys.readouterr().err
    first = json.loads((out / "results.json").read_text())
    assert list(first["runs"]) == ["torch|fp32|none|none|0"]
    assert first["frameworks"]["jax"]["status"] == "not installed"
    assert len(first["plan"]) == 6 and not first["complete"]

    monkeypatch.setattr(metrics, "run_metrics", real)
    assert _bench("--resume", "--out", str(out)) == 0
    done = json.loads((out / "results.json").read_text())
    kept, before = done["runs"]["torch|fp32|none|none|0"], first["runs"]["torch|fp32|none|none|0"]
    assert kept["record"] == before["record"]  # not run again
    assert {k for k in done["runs"] if k.startswith("torch")} == {
        k for k in done["plan"] if k.startswith("torch")
    }
    assert not any(k.startswith("jax") for k in done["runs"])
    assert done["resumed_with"] and done["agreement"]["status"] == "not checked"
    assert "not installed" in (out / "report.md").read_text()


def test_compare_reports_changes_and_missing_runs(tiny_run, tmp_path, capsys):
    _, out, data = tiny_run
    key = "jax|fp16|ls|none|0"
    data["runs"][key]["metrics"].update(final_loss=9.0, diverged=True, divergence_step=3)
    data["runs"].pop("tensorflow|fp16|ls|none|0")
    (tmp_path / "b.json").write_text(json.dumps(data))
    assert _bench("--compare", str(out / "results.json"), str(tmp_path / "b.json")) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if key in line)
    assert "-> 9.000" in row and "no -> @3" in row
    assert "stability changed in 1" in text
    assert "Only in A: `tensorflow|fp16|ls|none|0`" in text
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
    assert m["diverged"] and m["divergence_step"] == 6
    assert m["final_loss"] == pytest.approx(chance + 2)  # finite, yet a diverged run
    assert m["nonfinite_loss_steps"] == 1 and m["nonfinite_grad_steps"] == 1
    assert m["time_per_step_ms"] == pytest.approx(100.0) and m["first_step_s"] == 1.0
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
    assert metrics.agreement(runs(tol / 2), ["torch", "jax"], [0], tiny)["status"] == "passed"
    failed = metrics.agreement(runs(tol * 2), ["torch", "jax"], [0], tiny)
    assert failed["status"] == "FAILED"
    assert failed["seeds"]["0"]["frameworks"]["jax"]["first_step_over"] == 1


def test_copy_of_results_is_loadable_for_resume(tiny_run, tmp_path):
    """results.json is self-contained: a copied folder resumes with nothing left to run."""
    _, out, _ = tiny_run
    shutil.copytree(out, tmp_path / "copy")
    assert _bench("--resume", "--out", str(tmp_path / "copy")) == 0
