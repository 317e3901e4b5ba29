"""A run as the board shows it: its row in the list and its page, from what mnft records of it and, for a run going
on, what its hosts answer (mnft.run.control.status, asked by mnft.board.state's poller). Nothing here asks a host.

Every figure comes from where the terminal reads it: the record (mnft.run.records: state, reason, hosts, attempts
with their diagnosis, `time` from mnft.run.goodput), the attached supervisor (mnft.run.train.Live: live.json's
`metric`, live-metrics.jsonl), the collected run (mnft.run.logs: metrics.jsonl, summary.json, each host's
output.log) and the hosts' status. What a record or a log says is anyone's writing (a job name, a host's output):
it is passed on as text, cut, without control characters; the page only ever sets it as text.
"""

from __future__ import annotations

import getpass
import json
import math
import os
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Callable

from mnft.core.errors import InputError, MnftError
from mnft.run import goodput, records
from mnft.run import sweep as sweeps
from mnft.run.control import job_of, rank_offset, runs_lease, supervisor
from mnft.run.gang import split_ranks
from mnft.run.logs import METRICS, restarts
from mnft.run.report import TIME_COLUMNS, saved_count
from mnft.run.scrape import ANSI
from mnft.run.train import Live

GOING = frozenset({"waiting", "checking", "syncing", "starting", "running"})  # a record's states while its run goes on
LOG_LINES = 40  # per host on a run's page
RESUMES_MAX = 20  # runs a resumed run's page reaches back through (resumed_from), at most
POINTS_MAX = 50_000  # points of a loss curve sent to the page (a longer run: every k-th, the last one kept)
JSON_MAX = 4 << 20  # bytes of a summary.json / live.json read at most
TEXT_MAX = 500  # characters of one line of text
ME = getpass.getuser()  # whose runs runs/ holds: this controller's user


def text(value: Any, limit: int = TEXT_MAX) -> str | None:
    """A value from a record or a log as the page may show it: a string or number, terminal colours dropped,
    other control characters as '?' (a tab kept), cut to `limit` characters."""
    if value is None or isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    raw = ANSI.sub("", str(value)[: limit * 2])[:limit]
    return "".join(c if c.isprintable() or c == "\t" else "?" for c in raw)


def number(value: Any) -> float | int | None:
    """A finite number as JSON carries it (nan/inf, written as text by mnft.run.scrape, are None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def read_json(path: Path, limit: int = JSON_MAX) -> dict | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)  # never past the limit, even for a file that grew after a stat
        if len(raw) > limit:
            return None
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path, keep: int = POINTS_MAX * 4) -> list[dict]:
    """The JSON objects of a .jsonl file mnft wrote (a damaged line skipped), the last `keep` of them."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - keep * 512))
            lines = f.read(keep * 512).splitlines()  # the end as it was measured: a file growing meanwhile costs no more
    except OSError:
        return []
    return records.json_objects(lines[-keep:])


def last_lines(path: Path, count: int, chunk: int = 1 << 16) -> list[str]:
    """The last lines of a file, reading only its end."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - chunk))
            data = f.read(chunk)
    except OSError:
        return []
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[1 if size > chunk and len(lines) > count else 0:][-count:]


def job_label(data: dict) -> str:
    try:
        return text(job_of(data).label, 200) or "?"
    except Exception:  # noqa: BLE001 - a damaged record's job is shown as unknown, never a failed page
        return "?"


COMMAND_WIDTH = 56  # characters of a run's command line in the runs list (whole on hover and on its page)


def command_words(data: dict) -> list[str]:
    """What the run ran, as words: a script's or a module's entry point with the job's and the command line's
    arguments (as the record keeps them: placeholders not filled in), a recipe's name with its overrides."""
    try:
        job = job_of(data)
    except Exception:  # noqa: BLE001 - a damaged record's job is shown as unknown, never a failed page
        return []
    if job.recipe:
        return ["recipe", job.recipe, *job.extra_args]
    return [*job.entry, *job.args, *job.extra_args]


def command_line(words: list[str], width: int | None = None) -> str:
    """The words as a shell would read them (quoted where needed); given a width, cut after the last whole
    argument that fits, marked " …" (the entry point is always there whole: it says what ran)."""
    quoted = [shlex.quote(w) for w in words]
    if width is None:
        return " ".join(quoted)
    keep = 2 if quoted[:1] in (["-m"], ["recipe"]) else 1
    out = " ".join(quoted[:keep])
    for i, word in enumerate(quoted[keep:], keep):
        if len(out) + 1 + len(word) > width - (2 if i < len(quoted) - 1 else 0):
            return out + " …"
        out += " " + word
    return out


def host_names(data: dict) -> list[str]:
    hosts = data.get("hosts") if isinstance(data.get("hosts"), dict) else {}
    if not hosts and isinstance(data.get("inventory"), dict):
        return [text(h.get("name"), 100) or "?" for h in data["inventory"].get("hosts") or [] if isinstance(h, dict)]
    return [text(name, 100) or "?" for name in hosts]


def attached(path: Path, data: dict, now: float | None) -> dict | None:
    """What the run's attached supervisor says now (mnft.run.control.supervisor), or None: also for a live.json it
    refuses (too large, damaged), which the page then shows as a run without a supervisor."""
    try:
        return supervisor(records.RunRecord(path, data), now)
    except (MnftError, TypeError, ValueError):
        return None


def going(data: dict) -> bool:
    return data.get("state") in GOING


def metric_of(found: dict | None) -> dict:
    """step, loss, tokens/s of a step record (mnft.run.scrape's), numbers only."""
    found = found or {}
    step = found.get("step") if isinstance(found.get("step"), int) and not isinstance(found.get("step"), bool) else None
    loss = found.get("loss")
    return {"step": step, "step_about": bool(found.get("step_about")), "loss": number(loss) if not isinstance(loss, str) else text(loss, 8),
            "tokens_per_s": number(found.get("tokens_per_s"))}


# ------------------------------------------------------------------------------------------------ a run's row


def summary(run_id: str, path: Path, answers: dict | None = None, now: float | None = None, metrics_of: "MetricsOf | None" = None) -> dict:
    """The run's row: state, job, hosts, step, loss, tokens/s, restarts, goodput; `answers`: its hosts' answers to
    the status query (host -> mnft.run.control.status's), when the poller asked them. A sweep's own record is the
    sweep's row (sweep_summary); a point's row names its sweep (`sweep`: id, index, label)."""
    try:
        data = records.read_record(path / "run.json")
    except InputError as exc:
        return {"id": text(run_id, 128), "mine": True, "state": "unreadable", "reason": text(str(exc)), "job": "?", "hosts": []}
    if sweep_of(data) is not None:
        return sweep_summary(run_id, data, now=now, metrics_of=metrics_of)
    live = attached(path, data, now)
    shown = read_json(path / "summary.json") if not going(data) else None
    metric: dict = {}
    if answers:  # the hosts' answer: rank 0's host first
        ranked = sorted(answers, key=lambda h: ((data.get("hosts") or {}).get(h) or {}).get("node_rank", 0))
        metric = next((m for h in ranked if (m := (answers[h] or {}).get("last_metric"))), None) or {}
    if not metric and live:
        metric = live.get("metric") or {}
    if not metric and shown:
        metric = {"step": shown.get("last_step"), "loss": shown.get("final_loss", shown.get("last_loss")), "tokens_per_s": shown.get("tokens_per_s")}
    attempts = [a for a in data.get("attempts") or [] if isinstance(a, dict)]
    spent = data.get("time") if isinstance(data.get("time"), dict) else (shown or {}).get("time") if isinstance((shown or {}).get("time"), dict) else {}
    return {
        "id": text(run_id, 128), "mine": True, "user": ME, "state": text(data.get("state"), 40) or "?",
        "supervised": bool(live), "detached": bool(data.get("detach")), "slurm": bool(data.get("slurm")),
        "reason": text(data.get("reason")), "job": job_label(data), **commands(data), "hosts": host_names(data),
        "devices": {text(h, 100): [d for d in v if isinstance(d, int)] for h, v in (data.get("devices") or {}).items() if isinstance(v, list)}
        if isinstance(data.get("devices"), dict) else {},
        "created": number(data.get("created")), "ended": number(data.get("ended")),
        "attempt": len(attempts) or None, "restarts": max(0, len(attempts) - 1),
        "goodput": number(spent.get("goodput")), **metric_of(metric), "supervisor": supervisor_of(data), "sweep": point_mark(data),
    }


def supervisor_of(data: dict) -> dict | None:
    """A detached run's supervisor on the lab as its record last said it (host, pid, since, alive: true, false, or
    null when it was not reached); None for a run supervised from a terminal."""
    where = data.get("supervisor")
    if not isinstance(where, dict) or not where.get("pid"):
        return None
    alive = where.get("alive")
    return {"host": text(where.get("host"), 100), "pid": number(where.get("pid")), "since": number(where.get("since")),
            "alive": alive if isinstance(alive, bool) else None, "seen": number(where.get("seen"))}


def commands(data: dict) -> dict:
    """The run's command line whole (`command`: its page, a row's hover) and cut for its row (`command_short`),
    after the job's name when it has one."""
    words = command_words(data)
    if not words:
        return {"command": None, "command_short": None}
    name = (data.get("job") or {}).get("name") if isinstance(data.get("job"), dict) else None
    named = f"{text(name, 200)}: " if name else ""
    return {"command": text(named + command_line(words), 4000), "command_short": text(named + command_line(words, COMMAND_WIDTH), 400)}


def others(rows: list[dict], mine: set[str], now: float | None = None) -> list[dict]:
    """The runs of other controllers the lab shows (their leases on the hosts, mnft.hosts.lab.rows as JSON): one
    row each, with its user, hosts and devices and since when; a run of this controller's runs/ is left out."""
    found: dict[str, dict] = {}
    for row in rows:
        run = row.get("run")
        if row.get("state") not in ("held", "waiting") or not run or any(runs_lease(m, run) for m in mine):
            continue
        entry = found.setdefault(run, {"id": run, "mine": False, "user": row.get("user"), "state": "running" if row["state"] == "held" else "waiting",
                                       "job": row.get("command"), "hosts": [], "devices": {}, "created": row.get("since"), "restarts": None,
                                       "goodput": None, "step": None, "loss": None, "tokens_per_s": None})
        if row["state"] == "held":
            entry["state"] = "running"
            if row["host"] not in entry["hosts"]:
                entry["hosts"].append(row["host"])
            if row.get("device") not in (None, "-"):
                entry["devices"].setdefault(row["host"], []).append(row["device"])
        elif row["host"] not in entry["hosts"]:
            entry["hosts"].append(row["host"])
        if isinstance(row.get("since"), (int, float)) and (entry["created"] is None or row["since"] < entry["created"]):
            entry["created"] = row["since"]
        seen = row.get("progress") if isinstance(row.get("progress"), dict) else {}
        if seen and (entry.get("progress_at") is None or (seen.get("at") or 0) > entry["progress_at"]):  # the newest a host holds
            entry.update(step=seen.get("step"), loss=seen.get("loss"), progress_at=seen.get("at") or 0)
    for entry in found.values():
        entry.pop("progress_at", None)
    return list(found.values())


# ------------------------------------------------------------------------------------------------ a run's page


def detail(run_id: str, path: Path, answers: dict | None = None, asked: float | None = None, now: float | None = None,
           metrics_of: "MetricsOf | None" = None) -> dict:
    """The run's page: its row, the loss curve (attempts, restarts, lost steps), where the time went, each host's
    state and last lines, the first failure named with its fix. A sweep's own record: the sweep's page
    (sweep_detail)."""
    now = time.time() if now is None else now
    try:
        data = records.read_record(path / "run.json")
    except InputError:
        return summary(run_id, path, answers, now)
    if sweep_of(data) is not None:
        return sweep_detail(run_id, data, now=now, metrics_of=metrics_of)
    out = summary(run_id, path, answers, now)
    attempts = [a for a in data.get("attempts") or [] if isinstance(a, dict)]
    live = attached(path, data, now)
    out["attempts"] = [{"number": a.get("number"), "state": text(a.get("state"), 40), "hosts": [text(h, 100) for h in a.get("hosts") or []],
                        "started": number(a.get("started")), "ended": number(a.get("ended")), "resumed_step": a.get("resumed_step"),
                        "steps": a.get("steps"), "steps_lost": a.get("steps_lost"), "cause": text((a.get("cause") or {}).get("detail")),
                        "decision": text(a.get("decision"))} for a in attempts]
    earlier = earlier_runs(data)
    out["curve"] = curve(path, data, live is not None or going(data), earlier)
    out["resumed_from"] = [rid for rid, _, _ in earlier]
    out["time"] = time_spent(path, data, now)
    out["failure"] = failure(data)
    out["warnings"] = [{"cause": text(w.get("cause")), "fix": text(w.get("fix"))} for w in data.get("warnings") or [] if isinstance(w, dict)]
    out["live"] = {"state": text(live.get("state"), 40), "attempt": live.get("attempt"), "note": text(live.get("note")),
                   "stragglers": [text(s.get("why")) for s in live.get("stragglers") or [] if isinstance(s, dict)]} if live else None
    out["host_states"] = host_states(path, data, answers)
    out["asked"] = number(asked)
    return out


def earlier_runs(data: dict, dirs: dict[str, Path] | None = None) -> list[tuple[str, Path, dict]]:
    """The runs this one resumed (`mnft train --resume-run`: each record's resumed_from), oldest first, as far as
    the user's records reach (at most RESUMES_MAX back): [(run id, its directory, its record)]."""
    chain: list[tuple[str, Path, dict]] = []
    previous = data.get("resumed_from")
    while isinstance(previous, str) and len(chain) < RESUMES_MAX and all(previous != rid for rid, _, _ in chain):
        path = dirs.get(previous) if dirs is not None else records.path_of(previous)
        if path is None:
            break
        try:
            record = records.read_record(path / "run.json")
        except (InputError, OSError):
            break
        chain.append((previous, path, record))
        previous = record.get("resumed_from")
    return chain[::-1]


def _attempt(point: dict) -> int:
    return point.get("attempt") if isinstance(point.get("attempt"), int) else 1


def _points(path: Path, running: bool, key: str | None = "loss") -> tuple[str | None, list[dict]]:
    """The run's step records holding `key` (None: every step record): metrics.jsonl once its logs are collected,
    else (or while it goes on) live-metrics.jsonl; and which of the two."""
    if not running and (path / METRICS).is_file():
        found = [r for r in read_jsonl(path / METRICS) if (key is None or key in r) and r.get("event") is None]
        if found:
            return "metrics", found
    if (path / Live.METRICS).is_file():
        return "live", [r for r in read_jsonl(path / Live.METRICS) if key is None or key in r]
    return None, []


def thin(count: int, limit: int) -> list[int]:
    """The indexes kept of `count` points sent to the page at most `limit`: every k-th, the last one kept."""
    if count <= limit:
        return list(range(count))
    every = -(-count // limit)
    return list(range(0, count, every)) + ([count - 1] if (count - 1) % every else [])


def curve(path: Path, data: dict, running: bool, earlier: list[tuple[str, Path, dict]] = ()) -> dict:
    """The loss curve: once the run's logs are collected, metrics.jsonl (mnft.run.logs: the kept timeline over
    every attempt); while it goes on, or without them, the step records the supervisor kept as they came
    (live-metrics.jsonl). Restarts where each later attempt resumed (mnft.run.logs.restarts); lost steps: each
    attempt's steps past where the next one resumed (the record's attempts). A run that resumed earlier ones
    (`earlier`: earlier_runs) shows their curves first, each of their attempts a series of its own (`labels`), and a
    mark where this run resumed."""
    found, series, labels, marks = [], [], {}, []
    for rid, their_path, record in earlier:
        _, theirs = _points(their_path, False)
        attempts = sorted({_attempt(r) for r in theirs})
        numbered = {a: len(labels) + i + 1 for i, a in enumerate(attempts)}
        for a in attempts:
            labels[numbered[a]] = rid if len(attempts) == 1 else f"{rid} attempt {a}"
        found += theirs
        series += [numbered[_attempt(r)] for r in theirs]
        marks += [{"step": step, "label": text(f"{rid}: {label}", 100)} for step, label in restarts(record) if isinstance(step, int)]
    offset = len(labels)
    source, mine = _points(path, running)
    if earlier and mine:
        first = mine[0].get("step")
        if isinstance(first, int):
            marks.append({"step": first, "label": text(f"resumed from {earlier[-1][0]}", 100)})
        for a in sorted({_attempt(r) for r in mine}):
            labels[offset + a] = "this run" if a == 1 else f"this run, attempt {a}"
    found += mine
    series += [offset + _attempt(r) for r in mine]
    by_step = bool(found) and all(isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool) for r in found)
    if len(found) > POINTS_MAX:
        keep = thin(len(found), POINTS_MAX)
        found, series = [found[i] for i in keep], [series[i] for i in keep]
    xs = [r["step"] if by_step else r.get("index") if isinstance(r.get("index"), int) else i for i, r in enumerate(found, 1)]
    losses = [number(r.get("loss")) for r in found]
    marks += [{"step": step, "label": text(label, 100)} for step, label in restarts(data) if isinstance(step, int)]
    lost = []
    for a in data.get("attempts") or []:
        steps, count = (a or {}).get("steps"), (a or {}).get("steps_lost")
        if isinstance(count, int) and count > 0 and isinstance(steps, list) and len(steps) == 2 and isinstance(steps[1], int):
            lost.append({"attempt": a.get("number"), "from": steps[1] - count, "to": steps[1], "steps": count})
    return {"source": source, "by_step": by_step, "x": xs, "loss": losses, "attempt": series, "labels": {str(k): v for k, v in labels.items()},
            "tokens_per_s": [number(r.get("tokens_per_s")) for r in found] if any("tokens_per_s" in r for r in found) else None,
            "points": len(found), "restarts": marks, "lost": lost}


def time_spent(path: Path, data: dict, now: float) -> dict | None:
    """Where the time went (mnft.run.goodput, as `logs` and `status` print it): the record's once it is summed up,
    while it goes on measured the same way from the step records kept so far."""
    spent = data.get("time") if isinstance(data.get("time"), dict) else None
    if spent is None and (path / Live.METRICS).is_file() and isinstance(data.get("created"), (int, float)) and data.get("attempts"):
        times: dict[int, list[tuple[float, int | None]]] = {}
        for r in read_jsonl(path / Live.METRICS):
            if isinstance(r.get("t"), (int, float)) and isinstance(r.get("attempt"), int):
                times.setdefault(r["attempt"], []).append((float(r["t"]), r["step"] if isinstance(r.get("step"), int) else None))
        try:
            waited = data.get("waited_s") if isinstance(data.get("waited_s"), (int, float)) else 0.0
            spent = goodput.measure(data["created"], data.get("ended") or now, data["attempts"], times, waited=waited).to_json()
        except (TypeError, ValueError, KeyError):
            spent = None
    if not spent:
        return None
    keys = [key for _, key in TIME_COLUMNS if key != "kept_s"]
    return {"wall_s": number(spent.get("wall_s")), "goodput": number(spent.get("goodput")), "steps_lost": spent.get("steps_lost"),
            "columns": [[name, key] for name, key in TIME_COLUMNS], "unknown": text(spent.get("unknown")),
            "attempts": [{"number": a.get("number"), "state": text(a.get("state"), 40), **{k: number(a.get(k)) for k in keys + ["kept_s"]},
                          "steps_lost": a.get("steps_lost"), "saved": saved_count(a, spent).strip() or None}
                         for a in spent.get("attempts") or [] if isinstance(a, dict)]}


def failure(data: dict) -> dict | None:
    """The first failure, named with its fix as the terminal said it (mnft.run.diagnose: the record's attempts'
    `diagnosis`, else the run's), and the run's reason."""
    named = next(((a.get("number"), a["diagnosis"]) for a in data.get("attempts") or [] if isinstance(a, dict) and isinstance(a.get("diagnosis"), dict)),
                 None) or ((None, data["diagnosis"]) if isinstance(data.get("diagnosis"), dict) else None)
    if named is None and data.get("state") not in ("failed", "refused", "sync-failed", "interrupted", "resumable"):
        return None
    attempt, found = named or (None, {})
    return {"attempt": attempt, "kind": text(found.get("kind"), 40), "cause": text(found.get("cause"), 2000), "fix": text(found.get("fix"), 2000),
            "reason": text(data.get("reason"), 2000), "host": text(data.get("failed_host"), 100)}


def host_states(path: Path, data: dict, answers: dict | None) -> list[dict]:
    """Each host of the run: its state (from its answer now, else as recorded), exit code, step and loss, since,
    and its last output lines (the answer's, else the collected output.log's, else the record's last lines)."""
    hosts = data.get("hosts") if isinstance(data.get("hosts"), dict) else {}
    out = []
    for name, info in hosts.items():
        info = info if isinstance(info, dict) else {}
        seen = (answers or {}).get(name)
        row: dict[str, Any] = {"name": text(name, 100), "node_rank": info.get("node_rank") if isinstance(info.get("node_rank"), int) else None}
        if seen:
            row.update(state=text(seen.get("state"), 40), exit_code=seen.get("exit_code"), processes=seen.get("processes"),
                       since=number(seen.get("ended") or seen.get("started")), error=text(seen.get("error")), meaning=text(seen.get("meaning")),
                       straggler=text((seen.get("straggler") or {}).get("why")), devices=seen.get("devices"), **metric_of(seen.get("last_metric")))
            lines = [(r, t) for r, t in seen.get("lines") or []]
            row["lines_from"] = "host"
        else:
            row.update(state=text(info.get("state"), 40), exit_code=info.get("exit_code"), since=number(info.get("ended") or info.get("started")),
                       error=text(info.get("error")))
            lines, row["lines_from"] = collected_lines(path, data, name), "collected"
            if not lines:
                lines, row["lines_from"] = [(None, t) for t in info.get("last_lines") or [] if isinstance(t, str)][-LOG_LINES:], "record"
        row["lines"] = [[r if isinstance(r, int) else None, text(t, 2000) or ""] for r, t in lines[-LOG_LINES:]]
        out.append(row)
    return out


def collected_lines(path: Path, data: dict, host: str) -> list[tuple[int | None, str]]:
    """The host's last output lines as `logs` collected them (runs/<id>/<host>/run/output.log), with each rank."""
    log = path / host / "run" / "output.log" if records.RUN_ID.fullmatch(str(host)) else None
    if log is None or not log.is_file():
        return []
    try:
        offset = rank_offset(data, host)
    except (KeyError, TypeError, IndexError):
        offset = 0
    return [piece for line in last_lines(log, LOG_LINES) for piece in split_ranks(line, offset)][-LOG_LINES:]


# ------------------------------------------------------------------------------------------------ a sweep

SWEEP_POINTS_MAX = 1000  # points of one sweep the board reads (a record with more: its first ones)
SWEEP_SERIES_MIN = 200  # points of each point's curve sent at least, however many points the sweep has (else POINTS_MAX in all)

def sweep_of(data: dict) -> dict | None:
    """A sweep's own record's `sweep` (runs/<sweep>/run.json of kind sweep: keys, metric, goal, points), or None."""
    block = data.get("sweep")
    return block if data.get("kind") == sweeps.KIND and isinstance(block, dict) else None


def _values(values: Any) -> dict[str, str]:
    return {text(k, 100) or "?": text(v, 200) or "?" for k, v in values.items()} if isinstance(values, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def point_mark(data: dict) -> dict | None:
    """The sweep a point's record names (`sweep`: id, index, values) as {id, index, label}; None for a run of its own."""
    block = data.get("sweep")
    if data.get("kind") == sweeps.KIND or not isinstance(block, dict) or not isinstance(block.get("id"), str):
        return None
    return {"id": text(block["id"], 128), "index": _int(block.get("index")), "label": text(sweeps.values_label(_values(block.get("values"))), 400)}


def metric_pairs(path: Path, running: bool, metric: str) -> list[tuple[int | None, float | None]]:
    """A point's step records as (step, its value of the sweep's metric or None), read as its own page's curve is
    (_points: metrics.jsonl once its logs are collected, else live-metrics.jsonl)."""
    _, found = _points(path, running, None)
    return [(_int(r.get("step")), number(sweeps.metric_of(r, metric))) for r in found]


def metric_digest(pairs: list[tuple[int | None, float | None]], goal: str) -> dict:
    """What a point's row and curve need of its step records: the few of them that mnft.run.sweep.point_row reads
    to the same row (`essential`, in their order: the first at the best value, the last with a value, the last with
    a step), its curve (`x` the steps, `y` the value at each: a step trained again after a restart, its last value)
    and the step it reached its best at."""
    valued = [(i, v) for i, (_, v) in enumerate(pairs) if v is not None]
    keep: set[int] = set()
    best = None
    if valued:
        best = (min if goal == "min" else max)(valued, key=lambda iv: iv[1])[0]  # the first at the best value
        keep |= {best, valued[-1][0]}
    last_step = next((i for i in range(len(pairs) - 1, -1, -1) if pairs[i][0] is not None), None)
    if last_step is not None:
        keep.add(last_step)
    by_step = {step: v for step, v in pairs if step is not None and v is not None}
    xs = sorted(by_step)
    return {"essential": [pairs[i] for i in sorted(keep)], "x": xs, "y": [by_step[x] for x in xs],
            "best_step": pairs[best][0] if best is not None else None}


def read_digest(path: Path, running: bool, metric: str, goal: str) -> dict:
    return metric_digest(metric_pairs(path, running, metric), goal)


MetricsOf = Callable[[Path, bool, str, str], dict]  # read_digest, or a MetricsCache of it


class MetricsCache:
    """read_digest, read again only when the point's files change (stamp): a sweep's row and page read every point's
    step records, and only the points going on change. One per board, shared by the poller and the pages."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, bool, str, str], tuple[tuple, dict]] = {}
        self._lock = threading.Lock()

    def __call__(self, path: Path, running: bool, metric: str, goal: str) -> dict:
        key, mark = (str(path), running, metric, goal), stamp(path)
        with self._lock:
            hit = self._kept.get(key)
        if hit is not None and hit[0] == mark:
            return hit[1]
        digest = read_digest(path, running, metric, goal)
        with self._lock:
            self._kept[key] = (mark, digest)
        return digest

    def keep(self, paths: set[str]) -> None:
        """Forget the points whose directories are not among `paths` (a run deleted)."""
        with self._lock:
            for key in [k for k in self._kept if k[0] not in paths]:
                del self._kept[key]


def sweep_metric(block: dict) -> tuple[str, str]:
    """The sweep's metric and goal (min: lower is better, max)."""
    metric = block.get("metric")
    metric = text(metric, 100) if isinstance(metric, str) and metric.strip() and metric != "step" else "loss"
    return metric, "max" if block.get("goal") == "max" else "min"


def sweep_points(block: dict) -> list[dict]:
    """The sweep record's points (its first SWEEP_POINTS_MAX), as mnft.run.sweep.point_row reads them, in point
    order; a run id that is not a name inside runs/ is none."""
    points = block.get("points") if isinstance(block.get("points"), list) else []
    out = []
    for p in points[:SWEEP_POINTS_MAX]:
        if not isinstance(p, dict):
            continue
        run_id = p.get("run_id") if isinstance(p.get("run_id"), str) and records.RUN_ID.fullmatch(p["run_id"]) else None
        out.append({"index": _int(p.get("index")), "values": _values(p.get("values")), "run_id": run_id, "state": text(p.get("state"), 40),
                    "host": text(p.get("host"), 100), "ended": number(p.get("ended")), "reason": text(p.get("reason"))})
    return sorted(out, key=lambda p: (p["index"] is None, p["index"] or 0))


def point_record(sweep_id: str, point: dict) -> tuple[Path | None, dict | None]:
    """The point's own run record (its directory, what it says: state, devices, times, reason), when there is one and
    it names this sweep; else (None, None), and the point is what the sweep's record says of it."""
    path = records.path_of(point["run_id"]) if point["run_id"] else None
    if path is None:
        return None, None
    try:
        data = records.read_record(path / "run.json")
    except InputError:
        return None, None
    mark = data.get("sweep")
    if data.get("run_id") != point["run_id"] or not isinstance(mark, dict) or mark.get("id") != sweep_id:
        return None, None  # a run of another sweep, or of none, under this point's name: not read as this point
    devices = data.get("devices") if isinstance(data.get("devices"), dict) else {}
    return path, {"created": number(data.get("created")), "ended": number(data.get("ended")), "state": text(data.get("state"), 40),
                  "reason": text(data.get("reason")),
                  "devices": {text(h, 100) or "?": [i for i in d if _int(i) is not None] if isinstance(d, list) else [] for h, d in devices.items()}}


def sweep_parts(sweep_id: str, block: dict, now: float, metrics_of: MetricsOf | None = None) -> dict:
    """What a sweep's row and page are made of: its table (mnft.run.sweep.point_row per point, as `status SWEEP`
    prints it; the best point by the sweep's metric and goal, best_row, marked), each point's curve of that metric
    over its steps, and the hosts its points ran on."""
    metrics_of = metrics_of or read_digest
    metric, goal = sweep_metric(block)
    points = sweep_points(block)
    rows, curves, hosts = [], [], []
    for point in points:
        path, data = point_record(sweep_id, point)
        digest = metrics_of(path, (data or {}).get("state") in GOING, metric, goal) if path is not None else metric_digest([], goal)
        row = sweeps.point_row(point, data, ({"step": s, metric: v} for s, v in digest["essential"]), metric, goal, now)
        rows.append({"index": row["index"], "run_id": row["run_id"], "values": row["values"], "label": text(sweeps.values_label(row["values"]), 400),
                     "state": text(row["state"], 40) or "?", "where": text(row["where"], 400) or "", "step": _int(row["step"]),
                     "last": number(row["last"]), "best": number(row["best"]), "seconds": number(row["seconds"]),
                     "reason": text(row["reason"]),
                     "recorded": data is not None, "best_point": False})
        for host in list((data or {}).get("devices") or {}) or ([point["host"]] if point["host"] else []):
            if host not in hosts:
                hosts.append(host)
        if digest["x"]:
            curves.append({"index": row["index"], "run_id": row["run_id"], "label": rows[-1]["label"], "x": digest["x"], "y": digest["y"],
                           "best_step": digest["best_step"]})
    limit = max(SWEEP_SERIES_MIN, POINTS_MAX // max(1, len(curves)))
    for curve in curves:
        curve["points"] = len(curve["x"])
        if curve["points"] > limit:  # new lists: a MetricsCache's stay whole
            keep = thin(curve["points"], limit)
            curve["x"], curve["y"] = [curve["x"][i] for i in keep], [curve["y"][i] for i in keep]
    best = sweeps.best_row(rows, goal)
    if best is not None:
        best["best_point"] = True
        reached = next((c["best_step"] for c in curves if c["run_id"] == best["run_id"] and c["index"] == best["index"]), None)
        best = {"index": best["index"], "run_id": best["run_id"], "label": best["label"], "value": best["best"], "step": reached}
    return {"metric": metric, "goal": goal, "rows": rows, "curves": curves, "best": best, "hosts": hosts}


def sweep_summary(sweep_id: str, data: dict, now: float | None = None, metrics_of: MetricsOf | None = None, parts: dict | None = None) -> dict:
    """A sweep's row in the runs list: the sweep as one entry (kind sweep), what its record says (state, job, its
    supervisor), its summary from its points' states now ("6 point(s): 4 succeeded, 2 running"), its best point
    and its points' run ids (`point_ids`; the board nests their rows under it: mnft.board.state)."""
    now = time.time() if now is None else now
    parts = parts or sweep_parts(sweep_id, sweep_of(data) or {}, now, metrics_of)
    counts: dict[str, int] = {}
    for row in parts["rows"]:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    return {
        "id": text(sweep_id, 128), "kind": sweeps.KIND, "mine": True, "user": ME, "state": text(data.get("state"), 40) or "?",
        "supervised": False, "detached": True, "slurm": False, "reason": text(data.get("reason")), "job": job_label(data), **commands(data),
        "hosts": parts["hosts"], "devices": {}, "created": number(data.get("created")), "ended": number(data.get("ended")),
        "attempt": None, "restarts": None, "goodput": None, "step": None, "step_about": False, "loss": None, "tokens_per_s": None,
        "supervisor": supervisor_of(data), "sweep": None, "metric": parts["metric"], "goal": parts["goal"],
        "summary": text(sweeps.summary(parts["rows"]), 1000), "counts": counts, "best": parts["best"],
        "point_ids": [row["run_id"] for row in parts["rows"] if row["run_id"]],
    }


def sweep_detail(sweep_id: str, data: dict, now: float | None = None, metrics_of: MetricsOf | None = None) -> dict:
    """A sweep's page: its row, its keys, the table of its points (`rows`, in point order, the best one marked
    `best_point`), and every point's curve of the sweep's metric over its steps (`curves.series`, one per point
    that logged the metric, named by its values)."""
    now = time.time() if now is None else now
    block = sweep_of(data) or {}
    parts = sweep_parts(sweep_id, block, now, metrics_of)
    out = sweep_summary(sweep_id, data, now, parts=parts)
    keys = block.get("keys") if isinstance(block.get("keys"), list) else []
    out.update(keys=[text(k, 100) for k in keys if text(k, 100)] or list(dict.fromkeys(k for r in parts["rows"] for k in r["values"])),
               max_parallel=_int(block.get("max_parallel")), after=text(block.get("after"), 200), rows=parts["rows"],
               curves={"metric": parts["metric"], "goal": parts["goal"], "series": parts["curves"],
                       "points": sum(c["points"] for c in parts["curves"])})
    return out


def run_dirs() -> dict[str, Path]:
    """run id -> its directory, for every run of the user's: recorded under runs/ here, or anywhere else the
    user's index of runs names (mnft.run.records.every_run)."""
    try:
        return records.every_run()
    except OSError:
        return {}


def stamp(path: Path) -> tuple:
    """What changes when a run's row or page may: its record, summary, live files and collected metrics."""
    out = []
    for name in ("run.json", "summary.json", "live.json", Live.METRICS, METRICS):
        try:
            st = os.stat(path / name)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)
