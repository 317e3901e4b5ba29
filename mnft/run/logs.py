"""`invoke logs`: every host's run directory and the job's metrics files brought back into runs/<id>/<host>/,
rank 0's metrics normalised into runs/<id>/metrics.jsonl, then summary.json and loss.png; a merged tail, or
following the output live."""

from __future__ import annotations

import base64
import io
import json
import math
import tarfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.text import Text

from mnft.core import archive, limits
from mnft.core.errors import ExitCode, InputError
from mnft.core.output import fmt_loss
from mnft.hosts import pyrun
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host
from mnft.run import goodput, records, scrape, timeline
from mnft.onhost import queries
from mnft.onhost.runfiles import STOPPED_BY
from mnft.run.checkpoints import saved, step_of
from mnft.run.control import job_of, rank_offset, write_back
from mnft.run.gang import TeardownNoise, _parse, agent_command, agent_payload, split_rank, split_ranks

STEP_TIMES = "step-times.jsonl"  # runs/<id>/step-times.jsonl: when each of rank 0's step records arrived, per attempt
LIVE_METRICS = "live-metrics.jsonl"  # runs/<id>/live-metrics.jsonl: the same, written by an attached supervisor as they come
METRIC_WIDTH = 2 * scrape.MAX_METRIC_LINE  # characters of a line read for metrics: one cut there is never parsed
METRICS = "metrics.jsonl"  # runs/<id>/metrics.jsonl: rank 0's records, normalised (mnft.run.scrape)
CHECKPOINT_NAMES = "checkpoints.json"  # runs/<id>/<host>/: the entries of the job's checkpoints directory, when
TIMING_PREFIX = "timings-rank"  # each rank's step timings (mnft/recipes/timing.py), collected from every host


class Metrics(NamedTuple):
    """run_metrics: rank 0's steps over the kept timeline, its summary, where from, each attempt's steps."""

    steps: list[dict]
    summary: dict | None
    source: str | None
    attempts: list[dict] = []


def collect(record: records.RunRecord, fleet: Fleet, console: Console, quiet: bool = False) -> Metrics:
    """Copy every host's run directory (and the job's metrics files) into runs/<id>/<host>/, then write the
    normalised metrics and loss.png; each host's outcome is printed unless quiet. Returns the metrics, for
    summarize."""
    hosts = record.data["hosts"]

    def command(host: Host):
        info = hosts[host.name]
        extras = info.get("collect") or ([info["metrics"]] if info.get("metrics") else [])
        listed = [f"{queries.CHECKPOINTS_OPTION}{info['checkpoints']}"] if info.get("checkpoints") and layout != "none" else []
        return agent_command(fleet, host.name, "pack", info["run_dir"], *extras, *listed)

    layout = job_of(record.data).resume.layout

    results = fleet.run(command, stdin=agent_payload(), hosts=[h for h in fleet.inventory.hosts if h.name in hosts])
    outcome = {}
    for result in results:
        data = pyrun.reply(result, "the agent's pack")  # a host's reply: bounded as it was read, JSON or a failure
        why = None if data is None else unpack(data.get("tar"), record.path / result.host)
        if data is None or why:
            outcome[result.host] = f"{result.status.value}: {result.error}" if data is None else f"failed: {why}"
            continue
        keep_checkpoint_names(record.path / result.host, data.get("checkpoints"), time.time())
        left_out = [str(p) for p in data.get("left_out") or []]
        outcome[result.host] = "ok" + (f" (left out, too large: {', '.join(left_out)})" if left_out else "")
    metrics = run_metrics(record)
    steps, source = metrics.steps, metrics.source
    if can_plot():  # a detached run's supervisor has no matplotlib: the controller's `mnft logs` draws them
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


def unpack(packed: Any, dest: Path) -> str | None:
    """A host's collected logs (its agent's base64 tar.gz) unpacked into dest; or why not, in one line, with
    nothing unpacked: not a tar.gz, or more than limits.COLLECTED_BYTES (the sizes its headers give) or
    COLLECTED_FILES members, counted before anything is written (a few kilobytes of gzip can hold gigabytes), or a
    member that would land outside dest or is no file, folder or link (mnft.core.archive: on every Python)."""
    import binascii

    try:
        raw = base64.b64decode(packed, validate=True) if isinstance(packed, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        return "the agent's pack is not base64"
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
            members, total = [], 0
            for member in tar:
                members.append(member)
                total += max(0, member.size)
                if len(members) > limits.COLLECTED_FILES:
                    return (f"its logs hold more than {limits.COLLECTED_FILES} files (COLLECTED_FILES, a limit of mnft's input, "
                            "see docs/security.md): nothing unpacked")
                if total > limits.COLLECTED_BYTES:
                    return (f"its logs unpack to more than {limits.size(limits.COLLECTED_BYTES)} (COLLECTED_BYTES, a limit of "
                            "mnft's input, see docs/security.md): nothing unpacked")
            why = archive.extract(tar, members, dest)
            if why:
                return f"the agent's pack holds what may not be unpacked: {why}: nothing unpacked"
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        return f"the agent's pack cannot be unpacked: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


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


def _views(record: records.RunRecord) -> list[tuple[Path, dict, dict | None]]:
    """(directory holding <host>/ of collected logs, the run data as of that attempt, the attempt's entry), oldest
    attempt first; the last attempt's logs are in runs/<id>/ itself."""
    views = []
    attempts = record.data.get("attempts") or []
    for entry in attempts[:-1]:
        where = attempt_dir(record, entry["number"])
        if where.is_dir():
            views.append((where, {**record.data, "hosts": {n: {"node_rank": i} for i, n in enumerate(entry["hosts"])}}, entry))
    return views + [(record.path, record.data, attempts[-1] if attempts else None)]


def run_metrics(record: records.RunRecord) -> Metrics:
    """Rank 0's step records (and its summary, if it wrote one) from what `logs` collected, over every attempt of
    the run as one timeline (mnft.run.timeline: each attempt's records up to where the next resumed, steps
    derived where the format prints none), written to runs/<id>/metrics.jsonl; where they came from; and each
    attempt's steps as the records tell them."""
    job = job_of(record.data)
    if job.metrics.format == "none":
        return Metrics([], None, None)
    seen = [(entry, _metrics_in(base, data, job)) for base, data, entry in _views(record)]
    calibration = timeline.calibration_from_states([state for _, found in seen for state in found.states])
    attempts, summary, source = [], None, None
    for number, (entry, found) in enumerate(seen, 1):
        resumed = (entry or {}).get("resumed_step")
        records = [r for r in found.records if "loss" in r and r.get("event") is None]
        if any(r.get("step") is None for r in records):
            here = calibration or (timeline.calibration_from_summary(found.summary, resumed) if found.summary else None)
            records = timeline.refine(timeline.derive_steps(records, here, resumed or 0), found.exact)
        attempts.append(timeline.AttemptMetrics((entry or {}).get("number", number), records, resumed))
        summary = found.summary or summary
        source = found.source or source
    merged = timeline.merge(attempts)
    if merged.records or summary:
        (record.path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in merged.records + ([summary] if summary else [])))
        return Metrics(merged.records, summary, source, [a.to_json() | {"number": a.number} for a in merged.attempts])
    return Metrics([], None, None)


@dataclass
class Found:
    """One attempt's metrics as collected: its records (printed or from files), the job's own exact records
    (trainer_state.json), the trainer states read (for timeline.Calibration), its summary line, where from."""

    records: list[dict] = field(default_factory=list)
    exact: list[dict] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    summary: dict | None = None
    source: str | None = None


def _metrics_in(base: Path, data: dict, job) -> Found:
    """Rank 0's metric records in one attempt's collected logs (base/<host>/)."""
    fmt = job.metrics.format
    out = Found()
    for host in _hosts_rank0_first(data):
        extra = base / host / "extra"
        if not extra.is_dir():
            continue
        if fmt == "tensorboard":
            out.records, out.source = scrape.tensorboard(extra), f"{host}: TensorBoard events"
        elif fmt in ("hf", "auto"):
            read = [(state, p) for p in sorted(extra.rglob("trainer_state.json")) if (state := scrape.read_json(p)) is not None]
            out.states = [state for state, _ in read]
            if read:  # the one with the longest log_history: the newest checkpoint's
                state, path = max(read, key=lambda s: len(s[0].get("log_history") or []))
                out.exact, out.source = scrape.trainer_state_records(state), f"{host}: {path.relative_to(extra)}"
                out.records = out.exact
        if fmt not in ("tensorboard", "hf"):
            parse = scrape.LineParser(fmt, job.metrics.regex)
            files = sorted(p for p in extra.rglob("*") if p.is_file() and not p.name.startswith(TIMING_PREFIX) and p.name != "trainer_state.json")
            lines = parse.lines(line for p in files for line in limits.lines(p, METRIC_WIDTH))
            if len([r for r in lines if "loss" in r]) > len(out.records):
                out.records, out.source = lines, f"{host}: {', '.join(str(p.relative_to(extra)) for p in files)}"
        if out.records:
            break
    if fmt not in ("tensorboard", "mnft"):  # rank 0's output lines: where the format prints them
        printed, where = rank0_output_records(base, data, job)
        out.summary = next((r for r in reversed(printed) if r.get("event") == "summary"), None)
        count = len([r for r in printed if "loss" in r])
        # HF: the printed lines are this attempt's own (a trainer_state.json may be another attempt's, or hold
        # the history before a resume); its exact values refine them (timeline.refine)
        if count and (count >= len([r for r in out.records if "loss" in r]) or out.exact):
            out.records, out.source = printed, (f"{where}, exact values from {out.source.split(': ', 1)[1]}" if out.exact else where)
    else:
        out.summary = next((r for r in reversed(out.records) if r.get("event") == "summary"), None)
    return out


def rank0_output_records(base: Path, data: dict, job) -> tuple[list[dict], str | None]:
    """Metric records in global rank 0's lines of the collected output (on whichever host rank 0 ran)."""
    parse = scrape.for_job_output(job.metrics.format, job.metrics.regex)
    for host in _hosts_rank0_first(data):
        log = base / host / "run" / "output.log"
        if not log.is_file():
            continue
        offset = rank_offset(data, host)
        lines = []
        for line in limits.lines(log, METRIC_WIDTH):
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


def can_plot() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


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
            for line in limits.lines(path):  # a line cut there is not JSON: skipped, as any other
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
    """Per host state from the collected run directories (exit_code written by the keeper; stopped: the host marked
    the run as `mnft stop` ended it, mnft.onhost.runfiles.mark_stop)."""
    out = {}
    for name in record.data["hosts"]:
        run = record.path / name / "run"
        if not run.is_dir():
            continue
        code, ended = _value(run / "exit_code", "exit code", int), _value(run / "ended", "end time", float)
        by = limits.read_file(run / STOPPED_BY, limits.RUN_VALUE_BYTES, "stop mark", "RUN_VALUE_BYTES", missing=None)
        if by is not None:
            out[name] = {"state": "stopped", "exit_code": code, "ended": ended, "stopped_by": by.decode("utf-8", "replace").strip() or "mnft stop"}
        else:
            out[name] = {"state": "exited", "exit_code": code, "ended": ended} if code is not None else {"state": "unknown"}
    return out


TEARDOWN_LINES = 200  # the end of a host's collected log read for torchrun's teardown records


def teardown_note(record: records.RunRecord, host: str, exit_code: int | None) -> str | None:
    """What the end of a host's collected log holds of torchrun's teardown (mnft.run.gang.TeardownNoise: the exit
    barrier that met the master's closed store after every rank there had finished), in one line; None if nothing."""
    log = record.path / host / "run" / "output.log"
    if not log.is_file():
        return None
    noise, offset = TeardownNoise(), rank_offset(record.data, host) if record.data.get("inventory") else 0
    for text in limits.last_lines(log, TEARDOWN_LINES):
        noise.hides(*split_rank(text, offset))
    return noise.note(str(log), exit_code)


def _value(path: Path, what: str, kind: type) -> Any:
    """The one value a run's file holds (exit_code, ended: written by the host's keeper, collected here), or None
    when there is none; a file past limits.RUN_VALUE_BYTES, or one that holds no such value, is one line."""
    data = limits.read_file(path, limits.RUN_VALUE_BYTES, f"{what} file", "RUN_VALUE_BYTES", missing=None)
    text = data.decode("utf-8", "replace").strip() if data is not None else ""
    if not text:
        return None
    try:
        limits.integer_text(text, str(path))  # no number of thousands of digits is converted
        value = kind(text)
        if not math.isfinite(value):
            raise ValueError(text)
    except ValueError:
        raise InputError(f"{path}: not an {what}: {limits.shown(text)} (collected from the host: move the run's directory away)") from None
    return value


def summarize(record: records.RunRecord, metrics: Metrics | None = None) -> dict:
    """runs/<id>/summary.json: the run's outcome per host and its training numbers (from the collected logs;
    metrics: what collect returned, else read again)."""
    states = collected_states(record)
    hosts = {name: {"node_rank": info.get("node_rank"), "state": states.get(name, {}).get("state", info.get("state")),
                    "exit_code": states.get(name, {}).get("exit_code", info.get("exit_code"))}
             for name, info in record.data["hosts"].items()}
    for name, host in hosts.items():  # the lines torchrun's teardown left at the end of a host's log, said for what they are
        if note := teardown_note(record, name, host.get("exit_code")):
            host["note"] = note
    job = job_of(record.data)
    summary: dict[str, Any] = {"run_id": record.run_id, "job_id": record.data.get("job_id"), "job": job.label, "recipe": job.recipe,
                               "state": record.data.get("state"), "reason": record.data.get("reason"), "hosts": hosts,
                               "timings": record.data.get("timings"), "code_hash": record.data.get("code_hash"),
                               "job_dir": (record.data.get("code") or {}).get("job_dir")}
    metrics = metrics if metrics is not None else run_metrics(record)
    steps, final, source = metrics.steps, metrics.summary, metrics.source
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
    if metrics.attempts:  # each attempt's steps as its records tell them (not a progress counter): into run.json too
        summary["attempts"] = metrics.attempts
        told = {a["number"]: a for a in metrics.attempts}
        for entry in record.data.get("attempts") or []:
            if (seen := told.get(entry.get("number"))) and seen.get("first_step") is not None:
                entry.update(steps=[seen["first_step"], seen["last_step"]], steps_lost=seen["steps_lost"], steps_from="metrics")
    if record.data.get("attempts"):
        ended = record.data.get("ended") or max((a.get("ended") or 0 for a in record.data["attempts"]), default=0) or time.time()
        summary["time"] = record.data["time"] = goodput.measure(
            record.data["created"], ended, record.data["attempts"], read_step_times(record),
            {a["number"]: a for a in metrics.attempts}, *checkpoints_saved(record),
            waited=record.data["waited_s"] if isinstance(record.data.get("waited_s"), (int, float)) else 0.0).to_json()
        record.save()
    if final:  # the job's own summary (mnft's recipes, HF Trainer's train_runtime line) wins where it says more
        summary.update({k: final.get(k) for k in ("initial_loss", "final_loss", "tokens_per_s", "steps", "wall_s") if final.get(k) is not None})
        summary["job_summary"] = {k: v for k, v in final.items() if k != "event"}
    (record.path / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def keep_step_times(record: records.RunRecord, attempt: int, times: list[tuple[float, int | None]]) -> None:
    """Append an attempt's step record arrival times (mnft.run.progress.Display) to runs/<id>/step-times.jsonl."""
    with (record.path / STEP_TIMES).open("a") as out:
        out.write("".join(json.dumps({"attempt": attempt, "t": round(t, 3), "step": step}) + "\n" for t, step in times))


def read_step_times(record: records.RunRecord) -> dict[int, list[tuple[float, int | None]]]:
    """When each of rank 0's step records reached the attached supervisor, per attempt: step-times.jsonl (kept
    when an attempt ends), else, for an attempt still going, live-metrics.jsonl (written as each arrives)."""
    out = _times(record.path / STEP_TIMES, "step times file")
    for attempt, times in _times(record.path / LIVE_METRICS, "live metrics file").items():
        out.setdefault(attempt, times)
    return out


def _times(path: Path, what: str) -> dict[int, list[tuple[float, int | None]]]:
    out: dict[int, list[tuple[float, int | None]]] = {}
    data = limits.read_file(path, limits.STATE_BYTES, what, "STATE_BYTES", missing=b"")
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            data = json.loads(line)
            out.setdefault(int(data["attempt"]), []).append((float(data["t"]), data.get("step") if isinstance(data.get("step"), int) else None))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def keep_checkpoint_names(where: Path, listing: Any, read_at: float) -> None:
    """Keep what a host's pack named of the job's checkpoints directory (queries.checkpoint_names) in
    <host>/checkpoints.json, each entry's time on this machine's clock (the host's clock when it listed them is
    subtracted: a host's clock that is off does not move its saves), at most queries.CHECKPOINT_NAMES of them."""
    if not isinstance(listing, dict) or not isinstance(listing.get("entries"), dict) or not _finite(listing.get("now")):
        return
    entries = {}
    for name, mtime in listing["entries"].items():
        if len(entries) >= queries.CHECKPOINT_NAMES:
            break
        if isinstance(name, str) and len(name) <= 255 and "/" not in name and _finite(mtime):
            entries[name] = round(read_at - (listing["now"] - mtime), 3)
    where.mkdir(parents=True, exist_ok=True)
    (where / CHECKPOINT_NAMES).write_text(json.dumps({"root": str(listing.get("root"))[:4096], "read_at": round(read_at, 3), "entries": entries,
                                                      "more": bool(listing.get("more")) or len(entries) < len(listing["entries"])}) + "\n")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def checkpoints_saved(record: records.RunRecord) -> tuple[set[int], list[float] | None, bool]:
    """The steps the job saved checkpoints at, when each checkpoint was saved (None: its checkpoints directory
    was not listed) and whether more were there than listed. The names the job's layout counts as checkpoints
    (mnft.run.checkpoints.saved) in the checkpoints directories `logs` listed on its hosts, each at its earliest
    time on any host (a resume that copies a checkpoint to a host lacking it does not save it again), else, for
    runs collected before the directory was listed, the checkpoint directories collected with the metrics."""
    job = job_of(record.data)
    when: dict[str, float] = {}
    listed, more = False, False
    collected = set()
    for base, data, _ in _views(record):
        for host in data["hosts"]:
            listing = base / host / CHECKPOINT_NAMES
            found = _listing(listing)
            if found is not None:
                listed, more = True, more or bool(found.get("more"))
                for name, t in found["entries"].items():
                    if isinstance(name, str) and _finite(t):
                        when[name] = min(when.get(name, t), t)
            extra = base / host / "extra"
            if extra.is_dir():
                collected |= {p.name for p in extra.rglob("*") if p.is_dir()}
    names = saved(job.resume, set(when) if listed else collected)
    steps = {step for name in names if not name.startswith("epoch_") and (step := step_of(name)) is not None}
    return steps, [when[n] for n in names] if listed else None, more


def _listing(path: Path) -> dict | None:
    data = limits.read_file(path, limits.STATE_BYTES, "checkpoint names file", "STATE_BYTES", missing=None)
    try:
        found = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return found if isinstance(found, dict) and isinstance(found.get("entries"), dict) else None


def print_summary(summary: dict, record: records.RunRecord, console: Console) -> None:
    codes = ", ".join(f"{n} {h['state']}" + (f" ({h['exit_code']})" if h.get("exit_code") is not None else "") for n, h in summary["hosts"].items())
    console.print(f"run {summary['run_id']}: {summary.get('state')}; {codes}", highlight=False)
    if summary.get("final_loss") is not None:
        rate = f", {summary['tokens_per_s']:.0f} tokens/s" if isinstance(summary.get("tokens_per_s"), (int, float)) else ""
        over = summary.get("steps") or summary.get("last_step")
        label = "so far (running)" if summary.get("state") in ("running", "starting") else "summary"
        console.print(f"{label}: loss {fmt_loss(summary.get('initial_loss'))} -> {fmt_loss(summary['final_loss'])}{rate}"
                      + (f" over {over} steps" if over is not None else ""), highlight=False)
    elif summary.get("last_step") is not None:
        console.print(f"last step {summary['last_step']}: loss {fmt_loss(summary['last_loss'])}", highlight=False)
    else:
        console.print(no_metrics_hint(record.data), highlight=False)
    if summary.get("time"):
        from mnft.run.report import time_table

        console.print(time_table(summary["time"]))
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
    states = collected_states(record)
    for name in record.data["hosts"]:
        log = record.path / name / "run" / "output.log"
        if not log.is_file():
            console.print(Text(f"{name}| (no output collected)", style="dim"))
            continue
        offset = rank_offset(record.data, name)
        noise = TeardownNoise()  # torchrun's teardown and c10d's warning: one line, as the run's terminal had it
        for text in limits.last_lines(log, lines):  # its end only (a log may be gigabytes); a line cut at LINE_CHARS…
            rank, text = split_rank(text, offset)
            if noise.hides(rank, text):
                continue
            label = f"{name} r{rank}" if rank is not None else name
            console.print(Text.assemble((f"{label}| ", "dim"), text), highlight=False, soft_wrap=True)
        if said := noise.note(str(log), states.get(name, {}).get("exit_code")):
            console.print(Text.assemble((f"{name}| ", "dim"), (said, "yellow")), highlight=False, soft_wrap=True)
    write_back(record, states)
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
        process.keep = False  # lines are printed as they come, for as long as the run lasts: none kept besides
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
