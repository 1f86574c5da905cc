"""The orchestrator: one worker process per framework, a progress bar, results.json saved
after every run, Ctrl-C and --resume, then the summary, report.md and the plots."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from numstab.bench import metrics, results, sensitivity
from numstab.bench.errors import ResultsFileError
from numstab.bench.spec import Preset, RunSpec, plan_runs, preset_from_dict
from numstab.bench.worker import PREFIX
from numstab.frameworks import FRAMEWORKS

NOTHING_RAN_EXIT = 1
AGREEMENT_FAILED_EXIT = 3
INTERRUPTED_EXIT = 130


@dataclasses.dataclass
class Options:
    preset: Preset
    frameworks: tuple[str, ...]
    grid: list[tuple[str, str, str]]
    seeds: tuple[int, ...]
    device: str
    out: Path
    resume: bool = False
    jobs: int = 1
    threads: int = 1
    command: list[str] = dataclasses.field(default_factory=list)
    stacks: tuple[str, ...] = ("numstab",)
    lrs: tuple[float, ...] = ()


def installed(framework: str) -> bool:
    """Whether the framework can be imported (checked without importing it)."""
    return importlib.util.find_spec(framework) is not None


def preset_from(settings: dict[str, Any]) -> Preset:
    return preset_from_dict(settings["preset"])


def _say(console: Any, text: str) -> None:
    console.print(text, highlight=False)


def run(options: Options, console: Any) -> int:
    out = results.prepare_folder(options.out)
    existing = out / results.FILENAME
    if options.resume:
        data = results.load(existing)
        preset = preset_from(data["settings"])
        frameworks = tuple(data["settings"]["frameworks"])
        done = len(data["runs"])
        _say(console, f"resuming {existing}: {done} of {len(data['plan'])} runs already done")
    else:
        if existing.exists():
            raise ResultsFileError(
                f"{existing} already exists: pass --resume to continue it, or choose another "
                "--out (nothing was overwritten)"
            )
        preset = options.preset
        frameworks = options.frameworks
        settings = {
            "preset": preset.to_dict(),
            "frameworks": list(frameworks),
            "grid": [list(g) for g in options.grid],
            "seeds": list(options.seeds),
            "stacks": list(options.stacks),
            "lrs": list(options.lrs),
            "device": options.device,
            "jobs": options.jobs,
            "threads": options.threads,
        }
        plan = [
            r.key
            for r in plan_runs(
                frameworks, options.grid, options.seeds, options.stacks, options.lrs or (None,)
            )
        ]
        data = results.new_results(options.command, settings, plan)
    data.setdefault("resumed_with", [])
    data.setdefault("skipped", {})
    if options.resume:
        data["resumed_with"].append(options.command)
    for fw in frameworks:
        if not installed(fw):
            data["frameworks"][fw] = {
                "status": "not installed",
                "message": f"{fw} is not installed "
                f"(pip install 'numstab[{FRAMEWORKS[fw].extra}]'); the other frameworks still run",
            }
            _say(console, f"[yellow]skipping {fw}: not installed[/yellow]")
    results.save(data, out)
    try:
        _run_workers(data, preset, frameworks, out, options.jobs, console)
    except KeyboardInterrupt:
        results.save(data, out)
        finished = sum(k in data["runs"] for k in data["plan"])
        _say(
            console,
            f"\n[bold red]Interrupted.[/bold red] {finished} of {len(data['plan'])} runs are "
            f"saved in {existing}. Continue with: numstab bench --resume --out {out}",
        )
        return INTERRUPTED_EXIT
    return finish(data, preset, out, console)


def finish(data: dict[str, Any], preset: Preset, out: Path, console: Any) -> int:
    """Summary, report.md and plots from whatever runs are in ``data``."""

    settings = data["settings"]
    frameworks = [
        fw for fw in settings["frameworks"] if data["frameworks"].get(fw, {}).get("status") == "ok"
    ]
    grid = [tuple(g) for g in settings["grid"]]
    metrics.add_gaps(data["runs"])
    data["agreement"] = metrics.agreement(data["runs"], frameworks, settings, preset)
    data["spread"] = metrics.spread(data["runs"], frameworks, grid, settings)
    data["lr_sensitivity"] = sensitivity.lr_sensitivity(data["runs"], settings)
    done = set(data["runs"]) | set(data.get("skipped", {}))
    data["complete"] = all(k in done for k in data["plan"])
    results.save(data, out)
    written = _write_report(data, out)
    status = data["agreement"]["status"]
    _say(console, f"fp32 agreement across frameworks: {status}")
    _say(console, "wrote " + ", ".join(str(p) for p in [out / results.FILENAME, *written]))
    missing = [k for k in data["plan"] if k not in done]
    if data.get("skipped"):
        reasons = sorted(set(data["skipped"].values()))
        _say(console, f"[yellow]{len(data['skipped'])} runs skipped:[/yellow] {'; '.join(reasons)}")
    if missing:
        _say(console, f"[yellow]{len(missing)} planned runs have no result[/yellow] (see report)")
    if not data["runs"]:
        _say(console, "[red]no run finished[/red] (see the frameworks table in report.md)")
        return NOTHING_RAN_EXIT
    return AGREEMENT_FAILED_EXIT if status == "FAILED" else 0


def _reader(fw: str, proc: subprocess.Popen, events: queue.Queue) -> None:
    for line in proc.stdout:
        if line.startswith(PREFIX):
            events.put((fw, json.loads(line[len(PREFIX) :])))
    proc.wait()
    events.put((fw, {"event": "exit", "code": proc.returncode}))


def _progress(console: Any) -> Any:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(TextColumn("{task.description}"), *columns, console=console)


def _run_workers(
    data: dict[str, Any],
    preset: Preset,
    frameworks: tuple[str, ...],
    out: Path,
    jobs: int,
    console: Any,
) -> None:
    pending = {
        fw: [
            k for k in data["plan"] if RunSpec.from_key(k).framework == fw and k not in data["runs"]
        ]
        for fw in frameworks
        if data["frameworks"].get(fw, {}).get("status") != "not installed"
    }
    pending = {fw: keys for fw, keys in pending.items() if keys}
    total = sum(len(k) for k in pending.values())
    if not total:
        return
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    events: queue.Queue = queue.Queue()
    waiting = list(pending)
    running: dict[str, subprocess.Popen] = {}
    progress = _progress(console)
    step_tasks: dict[str, Any] = {}

    def launch(fw: str) -> None:
        job = {
            "framework": fw,
            "device": data["settings"]["device"],
            "preset": preset.to_dict(),
            "runs": pending[fw],
            "threads": data["settings"]["threads"],
        }
        log = open(logs / f"{fw}.log", "a")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            [sys.executable, "-m", "numstab.bench.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        running[fw] = proc
        threading.Thread(target=_reader, args=(fw, proc, events), daemon=True).start()
        step_tasks[fw] = progress.add_task(f"{fw}: starting", total=preset.steps)

    try:
        with progress:
            runs_task = progress.add_task("runs", total=total)
            while waiting or running:
                while waiting and len(running) < jobs:
                    launch(waiting.pop(0))
                try:
                    fw, event = events.get(timeout=0.5)  # a timeout keeps Ctrl-C responsive
                except queue.Empty:
                    continue
                state = _State(data, preset, out, logs, progress, runs_task, step_tasks)
                _on_event(state, fw, event, running, pending[fw])
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


@dataclasses.dataclass
class _State:
    """What the event handler of ``_run_workers`` updates."""

    data: dict[str, Any]
    preset: Preset
    out: Path
    logs: Path
    progress: Any
    runs_task: Any
    step_tasks: dict[str, Any]


def _on_event(
    st: _State, fw: str, event: dict[str, Any], running: dict, pending: list[str]
) -> None:
    """One worker event: results.json and the progress bars follow it."""
    data, out, progress, runs_task, step_tasks = (
        st.data,
        st.out,
        st.progress,
        st.runs_task,
        st.step_tasks,
    )
    kind = event["event"]
    if kind == "ready":
        data["frameworks"][fw] = {
            "status": "ok",
            "versions": event["versions"],
            "device": event["device"],
        }
        results.save(data, out)
    elif kind == "fatal":
        data["frameworks"][fw] = {"status": "failed", "message": event["message"]}
        progress.console.print(f"[red]{fw} cannot run:[/red] {event['message']}")
        results.save(data, out)
    elif kind == "start":
        progress.update(step_tasks[fw], description=f"{event['key']} (compiling)", completed=0)
    elif kind == "step":
        progress.update(step_tasks[fw], description=event["key"], completed=event["step"] + 1)
    elif kind == "run":
        record = event["record"]
        data["runs"][event["key"]] = {
            "spec": dataclasses.asdict(RunSpec.from_key(event["key"])),
            "metrics": metrics.run_metrics(record, st.preset),
            "record": record,
        }
        data["errors"].pop(event["key"], None)
        data["skipped"].pop(event["key"], None)
        results.save(data, out)
        progress.advance(runs_task)
    elif kind == "run_skipped":
        data["skipped"][event["key"]] = event["message"]
        results.save(data, out)
        progress.advance(runs_task)
    elif kind == "run_error":
        data["errors"][event["key"]] = event["message"]
        progress.console.print(f"[red]{event['key']} failed:[/red] {event['message']}")
        results.save(data, out)
        progress.advance(runs_task)
    elif kind == "exit":
        proc = running.pop(fw)
        progress.update(step_tasks[fw], visible=False)
        unfinished = [
            k
            for k in pending
            if k not in data["runs"] and k not in data["errors"] and k not in data["skipped"]
        ]
        if event["code"] != 0 and data["frameworks"].get(fw, {}).get("status") == "ok":
            message = (
                f"{fw} worker exited with code {event['code']} (log: {st.logs / (fw + '.log')})"
            )
            for key in unfinished:
                data["errors"][key] = message
            progress.console.print(f"[red]{message}[/red]")
            results.save(data, out)
        elif data["frameworks"].get(fw, {}).get("status") == "failed":
            progress.advance(runs_task, len(unfinished))
        del proc


def _write_report(data: dict, out) -> list:
    """The plots, then report.md opening with the findings; the paths written."""
    from numstab.bench import findings, plots, report

    pngs = plots.write_all(data, out)
    return report.write(data, out, findings.section(data, [p.name for p in pngs]), pngs)
