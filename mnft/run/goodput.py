"""Where a run's wall time went, per attempt and in total, and its goodput. Pure: the run's record, the times
its step records arrived and its timeline in, seconds out.

Measured, not estimated: every figure is a difference of two times mnft saw. Its own events (the run created,
an attempt started, a failure detected, the run ended) and the wall time at which each of rank 0's step
records reached the supervisor (streamed live, so within a fraction of a second of the job printing it).

Per attempt:
  launch      the run's start (check and sync included) or the attempt's start -> its first step record
  steps       first step record -> last step record: training, with
    checkpoint  the intervals between two step records that hold a checkpoint's step, beyond the attempt's
                median interval (the save made that interval longer)
    lost        the attempt's steps past the point the next attempt resumed from, trained again
  detection   a failed attempt's last step record -> the failure noticed (no progress, not yet known)
  finish      a succeeded attempt's last step record -> its end (final save, exit)
  restart     failure noticed -> the next attempt's start (logs kept, backoff, re-check, checkpoint made whole)
Beside the checkpoint time, how many checkpoints each attempt saved: the entries of the job's checkpoints
directory its layout names, by when each was written (mnft.run.logs lists them when it collects the logs).
Goodput: the steps' time minus checkpoint and lost time, over the run's wall time.

When no attempt gave a single step record (mnft read no metric in the job's output or metrics file), nothing is
split: whether the job was still starting or training is not known, and `unknown` says so (an attempt that never
reached a step is launch time only when another attempt of the run did reach one). The same when the step records
were read from the collected output but no supervisor saw them arrive (a detached run): `unknown` then says that.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class AttemptTime:
    number: int
    state: str | None = None
    launch_s: float | None = None
    steps_s: float | None = None
    checkpoint_s: float | None = None
    lost_s: float | None = None
    steps_lost: int | None = None
    detection_s: float | None = None
    finish_s: float | None = None
    restart_s: float | None = None
    checkpoints: int | None = None  # the checkpoints it saved (None: the job's checkpoints directory was not listed)

    @property
    def kept_s(self) -> float | None:
        if self.steps_s is None:
            return None
        return max(0.0, self.steps_s - (self.checkpoint_s or 0.0) - (self.lost_s or 0.0))

    def to_json(self) -> dict:
        out = {k: _round(v) if isinstance(v, float) else v for k, v in vars(self).items()}
        out["kept_s"] = _round(self.kept_s)
        return out


UNKNOWN = "no step record was read from the job's output: where the time went is not known (set the job's metrics, docs/jobs.md)"
UNTIMED = ("step records were read from the job's output, but not when each arrived: only an attached `mnft train` "
           "sees them arrive (a detached run has none): where the time went is not known")


@dataclass
class Goodput:
    wall_s: float
    attempts: list[AttemptTime] = field(default_factory=list)
    unknown: str | None = None  # why the time is not split
    checkpoints: int | None = None  # the checkpoints the run saved, over its attempts (None: not listed)
    checkpoints_more: bool = False  # the directory held more entries than were listed: at least that many
    queue_s: float = 0.0  # waiting in line for its devices (--wait) before it held any: not the run's wall time

    @property
    def kept_s(self) -> float:
        return sum(a.kept_s or 0.0 for a in self.attempts)

    @property
    def ratio(self) -> float | None:
        return self.kept_s / self.wall_s if self.wall_s > 0 and any(a.steps_s is not None for a in self.attempts) else None

    def total(self, key: str) -> float | None:
        values = [getattr(a, key) for a in self.attempts if getattr(a, key) is not None]
        return sum(values) if values else None

    def to_json(self) -> dict:
        totals = {k: _round(self.total(k)) for k in ("launch_s", "steps_s", "checkpoint_s", "lost_s", "detection_s", "finish_s", "restart_s")}
        return {"wall_s": _round(self.wall_s), "kept_s": _round(self.kept_s), "goodput": None if self.ratio is None else round(self.ratio, 4),
                **({"queue_s": _round(self.queue_s)} if self.queue_s else {}),
                **({"unknown": self.unknown} if self.unknown else {}),
                **({"checkpoints": self.checkpoints, "checkpoints_more": self.checkpoints_more} if self.checkpoints is not None else {}),
                "steps_lost": sum(a.steps_lost or 0 for a in self.attempts), **totals, "attempts": [a.to_json() for a in self.attempts]}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def measure(created: float, ended: float, attempts: list[dict], step_times: dict[int, list[tuple[float, int | None]]],
            steps: dict[int, dict] | None = None, checkpoint_steps: set[int] | frozenset[int] = frozenset(),
            saved_at: list[float] | None = None, saved_more: bool = False, waited: float = 0.0) -> Goodput:
    """attempts: run.json's attempt entries (started, ended, detected, state); step_times: per attempt, the wall time
    each step record arrived and its step (None: unknown); steps: per attempt, what the timeline says of its steps
    (kept_to, steps_lost); checkpoint_steps: the steps the job saved a checkpoint at; saved_at: when each
    checkpoint in the job's checkpoints directory was saved (None: not listed), counted for the attempt that ran
    then (one saved before the run, by an earlier run of the job, is not this run's); saved_more: more were there;
    waited: seconds it waited in line (--wait) before it had its devices: its own figure, neither wall nor launch."""
    waited = max(0.0, min(waited or 0.0, ended - created))
    created += waited
    out = Goodput(max(0.0, ended - created), queue_s=waited)
    counts = _saved_per_attempt(created, ended, attempts, saved_at) if saved_at is not None else None
    if counts is not None:
        out.checkpoints, out.checkpoints_more = sum(counts), saved_more
    any_steps = any(step_times.get(entry.get("number", i + 1)) for i, entry in enumerate(attempts))
    if not any_steps:  # no arrival times: the job printed no step record mnft read, or none was seen arriving
        read = any(isinstance(told, dict) and told.get("logged_points") for told in (steps or {}).values())
        out.unknown = UNTIMED if read else UNKNOWN
    for i, entry in enumerate(attempts):
        number = entry.get("number", i + 1)
        times = sorted(step_times.get(number) or [], key=lambda p: p[0])
        seen = AttemptTime(number, entry.get("state"))
        start = created if i == 0 else entry.get("started")
        end = entry.get("ended") or ended
        if times:
            first, last = times[0][0], times[-1][0]
            seen.launch_s = first - start if start is not None else None
            seen.steps_s = last - first
            seen.checkpoint_s = _checkpoint_time(times, checkpoint_steps)
            told = (steps or {}).get(number) or {}
            seen.steps_lost = told.get("steps_lost")
            kept_to = told.get("kept_to")
            if seen.steps_lost:
                at = [t for t, s in times if s is not None and kept_to is not None and s <= kept_to]
                seen.lost_s = last - (at[-1] if at else first)
            if entry.get("state") == "succeeded":
                seen.finish_s = max(0.0, end - last)
            elif entry.get("detected") is not None:
                seen.detection_s = max(0.0, entry["detected"] - last)
        elif any_steps and start is not None and entry.get("state") != "succeeded":
            seen.launch_s = max(0.0, (entry.get("detected") or end) - start)  # never reached a step
        following = attempts[i + 1] if i + 1 < len(attempts) else None
        noticed = entry.get("detected") or entry.get("ended")
        if following is not None and noticed is not None and following.get("started") is not None:
            seen.restart_s = max(0.0, following["started"] - noticed)
        if counts is not None:
            seen.checkpoints = counts[i]
        out.attempts.append(seen)
    return out


SAVED_SLACK = 2.0  # seconds a save's time may lie outside the run (a listing's time is the host's clock, moved by the reply's latency)


def _saved_per_attempt(created: float, ended: float, attempts: list[dict], saved_at: list[float]) -> list[int]:
    """How many of the saves each attempt made: each save's time falls to the last attempt started before it,
    from the run's creation to its end."""
    starts = [created if i == 0 else (entry.get("started") if isinstance(entry.get("started"), (int, float)) else created)
              for i, entry in enumerate(attempts)]
    counts = [0] * len(attempts)
    for t in saved_at:
        if not counts or t < created - SAVED_SLACK or t > ended + SAVED_SLACK:
            continue
        counts[max([0] + [i for i, start in enumerate(starts) if start <= t])] += 1
    return counts


def _checkpoint_time(times: list[tuple[float, int | None]], saved: set[int] | frozenset[int]) -> float | None:
    """The time saves added: each interval between step records that holds a saved step (prev < s <= next, or
    the save right after the step record s), beyond the median interval."""
    if not saved or len(times) < 3:
        return None
    gaps = [(b[0] - a[0], a[1], b[1]) for a, b in zip(times, times[1:])]
    usual = statistics.median(g for g, _, _ in gaps)
    extra = 0.0
    for gap, before, after in gaps:
        if before is not None and after is not None and any(before <= s < after for s in saved):
            extra += max(0.0, gap - usual)
    return extra
