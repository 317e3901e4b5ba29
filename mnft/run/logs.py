"""`invoke logs`: every host's run directory and the job's metrics files brought back into runs/<id>/<host>/,
rank 0's metrics normalised into runs/<id>/metrics.jsonl, then summary.json and loss.png; a merged tail, or
following the output live."""

from __future__ import annotations

import base64
import io
import json
import tarfile
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from mnft.core.errors import ExitCode
from mnft.core.output import fmt_loss
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host
from mnft.run import records, scrape
from mnft.run.control import job_of, rank_offset, write_back
from mnft.run.gang import _parse, agent_command, agent_payload, split_rank, split_ranks

METRICS = "metrics.jsonl"  # runs/<id>/metrics.jsonl: rank 0's records, normalised (mnft.run.scrape)
TIMING_PREFIX = "timings-rank"  # each rank's step timings (mnft/recipes/timing.py), collected from every host


Metrics = tuple[list[dict], dict | None, str | None]  # run_metrics: rank 0's steps, its summary, where from


def collect(record: records.RunRecord, fleet: Fleet, console: Console, quiet: bool = False) -> Metrics:
    """Copy every host's run directory (and the job's metrics files) into runs/<id>/<host>/, then write the
    normalised metrics and loss.png; each host's outcome is printed unless quiet. Returns the metrics, for
    summarize."""
    hosts = record.data["hosts"]

    def command(host: Host):
        info = hosts[host.name]
        extras = info.get("collect") or ([info["metrics"]] if info.get("metrics") else [])
        return agent_command(fleet, host.name, "pack", info["run_dir"], *extras)

    results = fleet.run(command, stdin=agent_payload(), hosts=[h for h in fleet.inventory.hosts if h.name in hosts])
    outcome = {}
    for result in results:
        if not result.ok:
            outcome[result.host] = f"{result.status.value}: {result.error}"
            continue
        data = json.loads(result.stdout.strip().splitlines()[-1])
        dest = record.path / result.host
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data["tar"])), mode="r:gz") as tar:
            tar.extractall(dest, filter="data")
        outcome[result.host] = "ok" + (f" (left out, too large: {', '.join(data['left_out'])})" if data.get("left_out") else "")
    metrics = run_metrics(record)
    steps, _, source = metrics
    if steps:
        plot(steps, record.path / "loss.png", f"{record.run_id}: loss" + (f" ({source})" if source else ""), restarts(record.data))
    timings = rank_timings(record)
    if timings:
        plot_timings(timings, record.path / "timing.png", f"{record.run_id}: step time per rank")
    if not quiet:
        for name, state in outcome.items():
            console.print(f"{name}: {state}", highlight=False)
        if not steps:
            console.print(no_metrics_hint(record.data), highlight=False)
    return metrics


def no_metrics_hint(data: dict) -> str:
    job = job_of(data)
    if job.metrics.format == "none":
        return "no metrics: the job says it has none (metrics: none)"
    return (f"no metrics found for {job.label} (format {job.metrics.format}"
            + (f", path {job.metrics.path}" if job.metrics.path else ", in rank 0's output") + "): "
            "set the job file's metrics (format hf / torchtune / sana / jsonl / tensorboard / regex, and path), see docs/jobs.md")


# ------------------------------------------------------------------------------------------------ metrics


def _extra(record: records.RunRecord, host: str) -> Path:
    return record.path / host / "extra"


def _hosts_rank0_first(data: dict) -> list[str]:
    return sorted(data["hosts"], key=lambda n: data["hosts"][n].get("node_rank", 0))


def attempt_dir(record: records.RunRecord, attempt: int) -> Path:
    """Where an earlier attempt's collected logs are kept (the last attempt's are in runs/<id>/<host>/)."""
    return record.path / f"attempt-{attempt}"


def keep_attempt(record: records.RunRecord, fleet: Fleet, attempt: int, console: Console) -> None:
    """Collect a failed attempt's logs (before the next attempt starts) and keep them in runs/<id>/attempt-<k>/."""
    import shutil

    collect(record, fleet, console, quiet=True)
    dest = attempt_dir(record, attempt)
    dest.mkdir(exist_ok=True)
    for name in record.data["hosts"]:
        if (record.path / name).is_dir():
            shutil.move(str(record.path / name), str(dest / name))


def _views(record: records.RunRecord) -> list[tuple[Path, dict]]:
    """(directory holding <host>/ of collected logs, the run data as of that attempt), oldest attempt first."""
    views = []
    for entry in record.data.get("attempts") or []:
        where = attempt_dir(record, entry["number"])
        if where.is_dir():
            views.append((where, {**record.data, "hosts": {n: {"node_rank": i} for i, n in enumerate(entry["hosts"])}}))
    return views + [(record.path, record.data)]


def run_metrics(record: records.RunRecord) -> Metrics:
    """Rank 0's step records (and its summary, if it wrote one) from what `logs` collected, over every attempt of
    the run (a step done again after a restart: the later attempt's record), written to runs/<id>/metrics.jsonl;
    and where they came from (host and source)."""
    job = job_of(record.data)
    if job.metrics.format == "none":
        return [], None, None
    by_step: dict[int, dict] = {}
    unnumbered: list[dict] = []
    summary = source = None
    for base, data in _views(record):
        found, where = _metrics_in(base, data, job)
        for r in found:
            if r.get("event") == "summary":
                summary = r
            elif "loss" in r and r.get("event") is None:
                if isinstance(r.get("step"), int):
                    by_step[r["step"]] = r
                else:
                    unnumbered.append(r)
        source = where or source
    steps = [by_step[k] for k in sorted(by_step)] + unnumbered
    if steps or summary:
        numbered = scrape.steps_only(steps)
        (record.path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in numbered + ([summary] if summary else [])))
        return numbered, summary, source
    return [], None, None


def _metrics_in(base: Path, data: dict, job) -> tuple[list[dict], str | None]:
    """Rank 0's metric records in one attempt's collected logs (base/<host>/)."""
    fmt = job.metrics.format
    found: list[dict] = []
    source = None
    for host in _hosts_rank0_first(data):
        extra = base / host / "extra"
        if not extra.is_dir():
            continue
        if fmt == "tensorboard":
            found, source = scrape.tensorboard(extra), f"{host}: TensorBoard events"
        elif fmt == "hf":
            states = [(scrape.trainer_state(p), p) for p in sorted(extra.rglob("trainer_state.json"))]
            if states:  # the one with the longest log_history: the newest checkpoint's
                found, path = max(states, key=lambda s: len(s[0]))
                source = f"{host}: {path.relative_to(extra)}"
        else:
            parse = scrape.LineParser(fmt, job.metrics.regex)
            files = sorted(p for p in extra.rglob("*") if p.is_file() and not p.name.startswith(TIMING_PREFIX))
            found = parse.lines(line for p in files for line in p.read_text(errors="replace").splitlines())
            source = f"{host}: {', '.join(str(p.relative_to(extra)) for p in files)}"
        if found:
            break
    if fmt not in ("tensorboard", "mnft"):  # rank 0's output lines: where the format prints them
        printed, where = rank0_output_records(base, data, job)
        if len([r for r in printed if "loss" in r]) > len([r for r in found if "loss" in r]):
            found, source = printed, where
    return found, source


def rank0_output_records(base: Path, data: dict, job) -> tuple[list[dict], str | None]:
    """Metric records in global rank 0's lines of the collected output (on whichever host rank 0 ran)."""
    parse = scrape.for_job_output(job.metrics.format, job.metrics.regex)
    for host in _hosts_rank0_first(data):
        log = base / host / "run" / "output.log"
        if not log.is_file():
            continue
        offset = rank_offset(data, host)
        lines = []
        for line in log.read_text(errors="replace").splitlines():
            lines += [text for rank, text in split_ranks(line, offset) if rank == 0]
        found = parse.lines(lines)
        if found:
            return found, f"{host}: rank 0's output"
    return [], None


def restarts(data: dict) -> list[tuple[int, str]]:
    """(the step attempt k resumed from, its label) for each attempt after the first, for the loss plot."""
    out = []
    for entry in (data.get("attempts") or [])[1:]:
        before = data["attempts"][entry["number"] - 2] if entry["number"] >= 2 else {}
        cause = (before.get("cause") or {}).get("kind", "")
        out.append((entry.get("resumed_step") or 0, f"attempt {entry['number']}" + (f" ({cause})" if cause else "")))
    return out


def plot(steps: list[dict], out: Path, title: str, marks: list[tuple[int, str]] = ()) -> None:
    """Loss over steps (over logged points when the format gives no step), and throughput or the learning rate;
    marks: a dashed line where each automatic restart resumed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not steps:
        return
    by_step = all(s.get("step") is not None for s in steps)
    xs = [s["step"] if by_step else s.get("index", i + 1) for i, s in enumerate(steps)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, [float(s["loss"]) for s in steps], color="tab:blue", label="loss")  # "nan"/"inf" as written
    for step, label in marks if by_step else ():
        ax.axvline(step, color="tab:red", linestyle="--", alpha=0.6)
        ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize="small", color="tab:red")
    ax.set_xlabel("step" if by_step else "logged point (the format gives no step)")
    ax.set_ylabel("loss", color="tab:blue")
    second = next((k for k in ("tokens_per_s", "lr") if any(isinstance(s.get(k), (int, float)) for s in steps)), None)
    if second:
        ax2 = ax.twinx()
        ax2.plot(xs, [s.get(second) if isinstance(s.get(second), (int, float)) else float("nan") for s in steps],
                 color="tab:orange", alpha=0.7)
        ax2.set_ylabel({"tokens_per_s": "trained tokens/s", "lr": "learning rate"}[second], color="tab:orange")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def rank_timings(record: records.RunRecord) -> dict[tuple[str, int], list[dict]]:
    """(host, rank) -> that rank's step timings, from the timing files collected from every host."""
    out: dict[tuple[str, int], list[dict]] = {}
    for host in record.data["hosts"]:
        for path in sorted(_extra(record, host).rglob(f"{TIMING_PREFIX}*.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    data = json.loads(line)
                except ValueError:
                    continue
                if isinstance(data, dict) and "step" in data and "step_s" in data and "rank" in data:
                    out.setdefault((host, int(data["rank"])), []).append(data)
    return out


def plot_timings(timings: dict[tuple[str, int], list[dict]], out: Path, title: str) -> None:
    """Step time (solid) and compute time (dashed) per rank over steps: a straggler's compute line stands above
    the others', while every rank's step time is the same (the fast ones wait for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, ((host, rank), rows) in enumerate(sorted(timings.items(), key=lambda item: item[0][1])):
        color = f"C{i % 10}"
        xs = [r["step"] for r in rows]
        ax.plot(xs, [r["step_s"] * 1000 for r in rows], color=color, label=f"{host} r{rank} step")
        if any("compute_s" in r for r in rows):
            ax.plot(xs, [r.get("compute_s", float("nan")) * 1000 for r in rows], color=color, linestyle="--", alpha=0.7,
                    label=f"{host} r{rank} compute")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ summary


def collected_states(record: records.RunRecord) -> dict[str, dict]:
    """Per host state from the collected run directories (exit_code written by the keeper)."""
    out = {}
    for name in record.data["hosts"]:
        run = record.path / name / "run"
        if not run.is_dir():
            continue
        code = (run / "exit_code").read_text().strip() if (run / "exit_code").is_file() else None
        ended = (run / "ended").read_text().strip() if (run / "ended").is_file() else None
        out[name] = {"state": "exited", "exit_code": int(code), "ended": float(ended) if ended else None} if code else {"state": "unknown"}
    return out


def summarize(record: records.RunRecord, metrics: Metrics | None = None) -> dict:
    """runs/<id>/summary.json: the run's outcome per host and its training numbers (from the collected logs;
    metrics: what collect returned, else read again)."""
    states = collected_states(record)
    hosts = {name: {"node_rank": info.get("node_rank"), "state": states.get(name, {}).get("state", info.get("state")),
                    "exit_code": states.get(name, {}).get("exit_code", info.get("exit_code"))}
             for name, info in record.data["hosts"].items()}
    job = job_of(record.data)
    summary: dict[str, Any] = {"run_id": record.run_id, "job_id": record.data.get("job_id"), "job": job.label, "recipe": job.recipe,
                               "state": record.data.get("state"), "reason": record.data.get("reason"), "hosts": hosts,
                               "timings": record.data.get("timings")}
    steps, final, source = metrics if metrics is not None else run_metrics(record)
    if steps:
        summary["metrics_host"] = source.split(":", 1)[0] if source else None
        summary["metrics_source"] = source
        last = steps[-1]
        summary.update(first_step=steps[0].get("step"), last_step=last.get("step") if last.get("step") is not None else last.get("index"),
                       last_loss=last["loss"], skipped_steps=last.get("skipped_steps"), initial_loss=steps[0]["loss"], final_loss=last["loss"],
                       logged_points=len(steps))
        if any(isinstance(s.get("tokens_per_s"), (int, float)) for s in steps):
            rates = [s["tokens_per_s"] for s in steps if isinstance(s.get("tokens_per_s"), (int, float))]
            summary["tokens_per_s"] = rates[-1]
    if final:  # the job's own summary (mnft's recipes, HF Trainer's train_runtime line) wins where it says more
        summary.update({k: final.get(k) for k in ("initial_loss", "final_loss", "tokens_per_s", "steps", "wall_s") if final.get(k) is not None})
        summary["job_summary"] = {k: v for k, v in final.items() if k != "event"}
    (record.path / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def print_summary(summary: dict, record: records.RunRecord, console: Console) -> None:
    codes = ", ".join(f"{n} {h['state']}" + (f" ({h['exit_code']})" if h.get("exit_code") is not None else "") for n, h in summary["hosts"].items())
    console.print(f"run {summary['run_id']}: {summary.get('state')}; {codes}", highlight=False)
    if summary.get("final_loss") is not None:
        rate = f", {summary['tokens_per_s']:.0f} tokens/s" if isinstance(summary.get("tokens_per_s"), (int, float)) else ""
        over = summary.get("steps") or summary.get("last_step")
        console.print(f"summary: loss {fmt_loss(summary.get('initial_loss'))} -> {fmt_loss(summary['final_loss'])}{rate}"
                      + (f" over {over} steps" if over is not None else ""), highlight=False)
    elif summary.get("last_step") is not None:
        console.print(f"last step {summary['last_step']}: loss {fmt_loss(summary['last_loss'])}", highlight=False)
    else:
        console.print(no_metrics_hint(record.data), highlight=False)
    for name in ("loss.png", "timing.png"):
        if (record.path / name).is_file():
            console.print(f"plot: {record.path / name}", highlight=False)
    for seen in (record.data.get("stragglers") or {}).values():
        console.print(f"straggler during the run: {seen['host']}: {seen['why']}", highlight=False)
    console.print(f"summary: {record.path / 'summary.json'}", highlight=False)


# ------------------------------------------------------------------------------------------------ reading the output


def merged_tail(record: records.RunRecord, lines: int, console: Console, metrics: Metrics | None = None) -> None:
    """The last lines of every host's collected output, prefixed with host and rank, host after host (output.log
    carries no timestamps, so lines of different hosts cannot be put in time order), then the summary."""
    for name in record.data["hosts"]:
        log = record.path / name / "run" / "output.log"
        if not log.is_file():
            console.print(Text(f"{name}| (no output collected)", style="dim"))
            continue
        offset = rank_offset(record.data, name)
        for text in log.read_text(errors="replace").splitlines()[-lines:]:
            rank, text = split_rank(text, offset)
            label = f"{name} r{rank}" if rank is not None else name
            console.print(Text.assemble((f"{label}| ", "dim"), text), highlight=False, soft_wrap=True)
    write_back(record, collected_states(record))
    print_summary(summarize(record, metrics), record, console)


def follow(record: records.RunRecord, fleet: Fleet, console: Console) -> int:
    """Print every host's output as it arrives until the run ends everywhere (Ctrl-C only stops following):
    lines of all hosts interleaved in arrival order. Ends when each host's run recorded its exit code or no
    process of the run is left there (a keeper killed with SIGKILL records none)."""
    hosts = record.data["hosts"]
    codes: dict[str, int | None] = {}
    lock = threading.Lock()

    def one(host: Host):
        info = hosts[host.name]
        offset = rank_offset(record.data, host.name)
        process = fleet.start(host, agent_command(fleet, host.name, "tail", info["run_dir"], "20", "--follow"))
        process.write(agent_payload())
        for stream, line in process.stream():
            event = _parse(line)
            if event.get("event") == "exit":
                codes[host.name] = event.get("code")
                if event.get("reason"):
                    with lock:
                        console.print(Text(f"{host.name}: {event['reason']}", style="yellow"))
            elif stream == "stdout" and event.get("event") == "line":
                rank, text = split_rank(event.get("text", ""), offset)
                label = f"{host.name} r{rank}" if rank is not None else host.name
                with lock:
                    console.print(Text.assemble((f"{label}| ", "dim"), text), highlight=False, soft_wrap=True)
        return HostResult(host.name, Status.OK)

    fleet.map(one, [h for h in fleet.inventory.hosts if h.name in hosts and hosts[h.name].get("run_dir")])
    write_back(record, {n: ({"state": "exited", "exit_code": c} if c is not None else {"state": "killed", "exit_code": None}) for n, c in codes.items()}
               if len(codes) == len(hosts) else {})
    bad = {n: c for n, c in codes.items() if c != 0}
    return ExitCode.FAILED if bad or len(codes) < len(hosts) else ExitCode.OK
