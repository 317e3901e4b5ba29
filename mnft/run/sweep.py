"""A sweep: one run per point of a grid, under one sweep id (pure: the points, each point's job, where the next
points start, the table a person reads). Its supervisor on the lab is mnft.run.sweeper.

Every point is a run of its own (id `<sweep>-<n>`, record, directory, logs, metrics, resume), its job the sweep's
with the point's values in the placeholders of its arguments and environment (`--lr {lr}`). A key no placeholder
uses is bad input: the points would all be the same run.
"""

from __future__ import annotations

import string
import time
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

from mnft.core.errors import InputError
from mnft.run.job import Job, fields_of
from mnft.run.sweepspec import SweepSpec

KIND = "sweep"  # run.json's `kind` of a sweep's own record (runs/<sweep>/run.json)
FINAL_POINT = ("succeeded", "failed", "stopped", "resumable", "idle-stopped", "refused", "sync-failed", "interrupted",
               "supervisor-lost", "dependency-failed")
PENDING = "pending"  # a point not started yet: in the sweep's own queue, holding no place in any host's line


def point_id(sweep_id: str, index: int, count: int) -> str:
    return f"{sweep_id}-{index:0{max(2, len(str(count)))}d}"


def fill_some(template: str, values: Mapping[str, str]) -> str:
    """The template with the placeholders named in `values` filled, every other placeholder and `{{`/`}}` kept as
    written (filled per host later). A command-line word that is no template (`{"a": 1}`) is kept whole."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:
        return template
    out = []
    for literal, name, spec, conversion in parts:
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is None:
            continue
        if name in values and not spec and not conversion:
            out.append(values[name].replace("{", "{{").replace("}", "}}"))
        else:
            out.append("{" + name + ("!" + conversion if conversion else "") + (":" + spec if spec else "") + "}")
    return "".join(out)


def _fill_cli(word: str, values: Mapping[str, str]) -> str:
    """A command-line word (verbatim, never a template otherwise): only `{key}` of the sweep's keys replaced."""
    for key, value in values.items():
        word = word.replace("{" + key + "}", value)
    return word


def uses(job: Job, key: str) -> bool:
    """Whether the job's arguments (the job file's or the command line's) or its environment name {key}."""
    if any("{" + key + "}" in word for word in job.extra_args):
        return True
    for template in list(job.args) + [v for _, v in job.env]:
        try:
            if key in fields_of(template):
                return True
        except ValueError:
            continue
    return False


def check_used(job: Job, spec: SweepSpec, where: str) -> None:
    unused = [k for k in spec.keys if not uses(job, k)]
    if unused:
        key = unused[0]
        raise InputError(f"{where}: key {key!r}: no {{{key}}} in the job's arguments or env, so every point would run the same: "
                         f"pass it, e.g. -- {job.script or 'train.py'} --{key} {{{key}}}")


def point_job(job: Job, values: Mapping[str, str]) -> Job:
    """The point's job: the sweep's, its values in the placeholders (the job file's templates keep their others)."""
    return replace(job, args=tuple(fill_some(a, values) for a in job.args), extra_args=tuple(_fill_cli(a, values) for a in job.extra_args),
                   env=tuple((k, fill_some(v, values)) for k, v in job.env), sweep=None)


def new_points(sweep_id: str, spec: SweepSpec) -> list[dict]:
    """The sweep record's points: index, values, run id, state pending."""
    count = len(spec.points)
    return [{"index": n, "values": dict(p), "run_id": point_id(sweep_id, n, count), "state": PENDING} for n, p in enumerate(spec.points, 1)]


def values_label(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


@dataclass(frozen=True)
class SweepRun:
    """A sweep as train's options carry it to its supervisor: the spec, --max-parallel, and for `--resume-run
    SWEEP` the points run again (their previous records, which each point resumes from when its job can)."""

    spec: SweepSpec
    max_parallel: int | None = None
    rerun: tuple[dict, ...] | None = None  # the points run again: {index, values, resume_from}
    count: int | None = None  # the original sweep's number of points (ids keep their width)
    resumed: tuple[Any, ...] = ()  # the previous points' RunRecords (sent to the supervisor's runs/)
    resumed_from: str | None = None

    def record(self, sweep_id: str, after: dict | None = None) -> dict:
        """The sweep as its record keeps it (runs/<sweep>/run.json's `sweep`)."""
        if self.rerun is not None:
            count = self.count or len(self.rerun)
            points = [{"index": p["index"], "values": dict(p["values"]), "run_id": point_id(sweep_id, p["index"], count), "state": PENDING,
                       "resume_from": p.get("resume_from"), "rerun_of": p.get("run_id"), "pinned": p.get("host") if p.get("resume_from") else None}
                      for p in self.rerun]
        else:
            points = new_points(sweep_id, self.spec)
        return {"keys": list(self.spec.keys), "metric": self.spec.metric, "goal": self.spec.goal, "max_parallel": self.max_parallel or self.spec.max_parallel,
                "after": after, "points": points}


def rerun_of(data: Mapping[str, Any], resumable: bool) -> tuple[SweepSpec, tuple[dict, ...]]:
    """`train --resume-run SWEEP`: the sweep's spec as recorded, and its points that did not succeed (each resumed
    from its own record when the job has a resume rule, else run from the start)."""
    sweep = data.get("sweep") or {}
    points = [p for p in sweep.get("points") or [] if isinstance(p, dict)]
    keys = tuple(sweep.get("keys") or ())
    spec = SweepSpec(keys, tuple(tuple((k, str((p.get("values") or {}).get(k))) for k in keys) for p in points), sweep.get("metric") or "loss",
                     sweep.get("goal") or "min", sweep.get("max_parallel"))
    again = tuple({"index": p.get("index"), "values": p.get("values") or {}, "run_id": p.get("run_id"), "host": p.get("host"),
                   "resume_from": p.get("run_id") if resumable and p.get("started") else None}
                  for p in points if p.get("state") != "succeeded")
    return spec, again


# ------------------------------------------------------------------------------------------------ where points start


def plan_starts(pending: Sequence[int], room: int, hosts: Sequence[str], free: Mapping[str, int], size: Mapping[str, int],
                need: int | None, ours_waiting: Mapping[str, int], may_wait: Mapping[str, int] | None = None,
                pinned: Mapping[int, str] | None = None) -> list[tuple[int, str]]:
    """Which pending points start now, and on which host (pure): at most `room` of them; each on the host with the
    most free devices that has `need` of them (None: a whole host, every device free), else, when none has, one
    point waits in the line of each host where none of this sweep's points waits yet (and whose policy lets one
    more wait: may_wait), the hosts with the fewest devices in use first. Points start in their order; a point
    `pinned` to a host (a rerun resuming where its checkpoints are) only there, and it holds up none behind it."""
    free = dict(free)
    waiting = dict(ours_waiting)
    pinned = pinned or {}
    out: list[tuple[int, str]] = []
    for index in pending:
        if len(out) >= room:
            break
        among = [h for h in hosts if h == pinned[index]] if index in pinned else list(hosts)
        fits = [h for h in among if size.get(h, 0) and free.get(h, 0) >= (size[h] if need is None else need)]
        if fits:
            host = max(fits, key=lambda h: (free[h], -hosts.index(h)))
            free[host] -= size[host] if need is None else need
        else:
            could = [h for h in among if size.get(h, 0) >= (need or 1) and not waiting.get(h) and (may_wait is None or may_wait.get(h, 1) > 0)]
            if not could:
                if index in pinned:
                    continue
                break
            host = max(could, key=lambda h: (free.get(h, 0), -hosts.index(h)))
            waiting[host] = 1
        out.append((index, host))
    return out


# ------------------------------------------------------------------------------------------------ the table


def metric_of(point: Mapping[str, Any], name: str) -> float | None:
    value = point.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value else None


def point_row(point: Mapping[str, Any], record: Mapping[str, Any] | None, metrics: Iterable[Mapping[str, Any]], metric: str, goal: str,
              now: float | None = None) -> dict:
    """One row of `status SWEEP` (and the board's sweep table): the point, its values, state, hosts and GPUs, its
    last step, its last and best value of the sweep's metric, how long it ran."""
    record = record or {}
    steps = [m for m in metrics if isinstance(m, Mapping)]
    values = [(m.get("step"), v) for m in steps if (v := metric_of(m, metric)) is not None]
    best = (min if goal == "min" else max)((v for _, v in values), default=None)
    started, ended = record.get("created"), record.get("ended") or point.get("ended")
    state = record.get("state") if point.get("state") not in FINAL_POINT and record.get("state") else point.get("state")
    devices = record.get("devices") if isinstance(record.get("devices"), dict) else {}
    gpus = {h: [str(i) for i in (d or []) if isinstance(i, int)] for h, d in devices.items()}
    where = "; ".join(f"{h}: GPU {', '.join(g)}" if g else h for h, g in gpus.items()) or point.get("host") or ""
    last_step = next((m.get("step") for m in reversed(steps) if isinstance(m.get("step"), int)), None)
    seconds = None
    if isinstance(started, (int, float)) and state not in (PENDING, None):
        seconds = round((ended if isinstance(ended, (int, float)) else (now or time.time())) - started, 1)
    return {"index": point.get("index"), "run_id": point.get("run_id"), "values": dict(point.get("values") or {}), "state": state,
            "where": where, "step": last_step, "last": values[-1][1] if values else None, "best": best, "seconds": seconds,
            "reason": (record.get("reason") or point.get("reason")) if state not in ("succeeded", "running", "waiting") else None}


def best_row(rows: Sequence[dict], goal: str) -> dict | None:
    scored = [r for r in rows if r.get("best") is not None]
    if not scored:
        return None
    return (min if goal == "min" else max)(scored, key=lambda r: r["best"])


def sweep_state(points: Sequence[Mapping[str, Any]], stopping: bool = False) -> str:
    """The sweep's state from its points: running while any is not final; then succeeded (every point), stopped
    (a stop asked), else failed (some point did not succeed)."""
    states = [p.get("state") for p in points]
    if any(s not in FINAL_POINT for s in states):
        return "running"
    if all(s == "succeeded" for s in states):
        return "succeeded"
    return "stopped" if stopping else "failed"


def summary(points: Sequence[Mapping[str, Any]]) -> str:
    """"6 points: 5 succeeded, 1 failed"."""
    counts: dict[str, int] = {}
    for p in points:
        counts[str(p.get("state"))] = counts.get(str(p.get("state")), 0) + 1
    return f"{len(points)} point(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))


