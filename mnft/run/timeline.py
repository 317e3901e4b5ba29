"""A run's metrics as one timeline across its attempts. Pure: records in, records out.

Two jobs, both about telling a restarted run's steps truthfully:

- **Steps where the format prints none.** HF Trainer's console lines (`{'loss': '4.69', …, 'epoch': '1.375'}`)
  carry the epoch, not the step. The step is derived from the epoch with the job's own numbers, read from its
  trainer_state.json (log_history pairs step and epoch exactly; logging_steps gives the grid every logged step
  lies on) or, for a run that ended without a checkpoint, from HF's closing summary line (train_runtime ×
  train_steps_per_second steps in this session). A derived step is snapped to the logging grid and kept
  increasing, so the four digits HF prints of the epoch are enough. Without either source the step stays unknown
  (None) and the records keep their order within their attempt.
- **Attempts apart.** Each attempt's records are its own; an attempt that resumed from step r supersedes the
  steps after r of the attempts before it (they were trained again: the work a failure cost). The kept timeline
  is every attempt's records up to where the next one resumed, then the last attempt's; each attempt's first and
  last step and the steps it lost are read from it, not guessed from a progress counter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

# HF's training bar on stderr: `  7%|▋         | 4/60 [00:00<00:01, 32.62it/s]` (no description: other bars,
# e.g. "Writing model shards: 0/1", have one). Its count is the global step, also after a resume.
HF_BAR = re.compile(r"^\s*\d{1,3}%\|[^|]*\|\s*(\d{1,18})/(\d{1,18})\s*\[")


def bar_step(text: str) -> tuple[int, int] | None:
    """(step, total) of HF's training progress bar in a piece of a line, or None."""
    match = HF_BAR.match(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class Calibration:
    """How an HF epoch maps to a step: steps per epoch (float: the mean over the run so far) and the logging grid."""

    steps_per_epoch: float
    logging_steps: int = 1
    source: str = ""

    def step(self, epoch: float) -> int | None:
        raw = epoch * self.steps_per_epoch
        if not (math.isfinite(raw) and 0 <= raw < 2**62):  # a printed epoch no training reaches: no step
            return None
        grid = max(1, self.logging_steps)
        return max(1, int(round(raw / grid)) * grid) if raw >= grid / 2 else max(1, int(round(raw)))


def calibration_from_state(state: dict, source: str = "trainer_state.json") -> Calibration | None:
    """From one trainer_state.json: the newest log_history entry with both a step and an epoch > 0."""
    pairs = [(e["step"], e["epoch"]) for e in state.get("log_history") or []
             if isinstance(e, dict) and isinstance(e.get("step"), int) and _positive(e.get("epoch"))]
    if not pairs:
        return None
    step, epoch = max(pairs)
    logging = state.get("logging_steps")
    grid = int(logging) if isinstance(logging, (int, float)) and not isinstance(logging, bool) and 1 <= logging < 1e9 else 1
    return Calibration(step / float(epoch), grid, source)


def calibration_from_states(states: Iterable[dict]) -> Calibration | None:
    """From every trainer_state.json found (checkpoints of every attempt): the newest step and epoch of all."""
    states = [s for s in states if isinstance(s, dict)]
    history = [e for s in states if isinstance(s.get("log_history"), list) for e in s["log_history"]]
    logging = next((s["logging_steps"] for s in states if s.get("logging_steps") is not None), None)
    return calibration_from_state({"log_history": history, "logging_steps": logging}) if history else None


def calibration_from_summary(summary: dict, resumed_step: int | None) -> Calibration | None:
    """From HF's closing line `{'train_runtime': …, 'train_steps_per_second': …, 'epoch': …}`: the steps of this
    session (runtime × steps per second) after the resume point make the final epoch's step."""
    try:
        runtime, rate, epoch = (float(summary[k]) for k in ("train_runtime", "train_steps_per_second", "epoch"))
    except (KeyError, TypeError, ValueError):
        return None
    if not all(math.isfinite(v) and v > 0 for v in (runtime, rate, epoch)):
        return None
    total = (resumed_step or 0) + round(runtime * rate)
    return Calibration(total / epoch, 1, "HF's closing summary") if total > 0 else None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def derive_steps(records: list[dict], calibration: Calibration | None, after: int = 0) -> list[dict]:
    """Records with their step filled in from their epoch where the format gave none (marked `step_from: epoch`),
    each on the logging grid, strictly increasing, and after `after` (the step the attempt resumed from)."""
    if calibration is None:
        return records
    out, last = [], after
    for r in records:
        if r.get("step") is None and _positive(_float(r.get("epoch"))):
            step = calibration.step(_float(r["epoch"]))
            if step is None:
                out.append(r)
                continue
            if step <= last:  # the four printed digits fell a grid point short: the next point is the one
                step = last + max(1, calibration.logging_steps)
            r = dict(r, step=step, step_from="epoch")
        if isinstance(r.get("step"), int):
            last = max(last, r["step"])
        out.append(r)
    return out


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def refine(records: list[dict], exact: Iterable[dict]) -> list[dict]:
    """Derived records whose step the job's own file (trainer_state.json's log_history) also holds with the same
    loss to the printed digits take that file's exact values."""
    by_step = {r["step"]: r for r in exact if isinstance(r.get("step"), int)}
    out = []
    for r in records:
        known = by_step.get(r.get("step"))
        if known is not None and _same(r.get("loss"), known.get("loss")):
            r = {**r, **{k: v for k, v in known.items() if k != "step_from"}}
        out.append(r)
    return out


def _same(printed: Any, exact: Any) -> bool:
    a, b = _float(printed), _float(exact)
    if a is None or b is None:
        return printed == exact
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 5e-4 * max(abs(a), abs(b), 1e-12) + 1e-12


# ------------------------------------------------------------------------------------------------ attempts


@dataclass
class AttemptMetrics:
    """One attempt's step records (in the order it printed them) and the step it resumed from (None: mnft does
    not know — the job found its own checkpoint — so its first step record says where it began)."""

    number: int
    records: list[dict]
    resumed_step: int | None = None


def _own(attempt: AttemptMetrics) -> list[dict]:
    """An attempt's own step records. A metrics file a resumed job appends to also holds the earlier attempts'
    lines: for each step the last record counts (this attempt's), and none at or before the step it resumed
    from (it did not train those)."""
    if not attempt.records or not all(isinstance(r.get("step"), int) for r in attempt.records):
        return attempt.records
    by_step = {r["step"]: r for r in attempt.records}
    floor = attempt.resumed_step or 0
    return [by_step[s] for s in sorted(by_step) if s > floor]


def _first_step(records: list[dict]) -> int:
    """Where an attempt whose resume point mnft does not know (a job that finds its own checkpoint) began: its
    first step record's step (1 without one: it began again)."""
    return next((r["step"] for r in records if isinstance(r.get("step"), int)), 1)


@dataclass
class AttemptSteps:
    number: int
    first_step: int | None = None
    last_step: int | None = None
    kept_to: int | None = None  # its last step that the timeline keeps (the next attempt resumed there)
    steps_lost: int | None = None  # trained again by a later attempt
    points: int = 0

    def to_json(self) -> dict:
        return {"first_step": self.first_step, "last_step": self.last_step, "kept_to": self.kept_to,
                "steps_lost": self.steps_lost, "logged_points": self.points}


@dataclass
class Timeline:
    records: list[dict] = field(default_factory=list)  # kept, oldest first, each with its "attempt"
    attempts: list[AttemptSteps] = field(default_factory=list)
    numbered: bool = True  # every kept record has a step


def merge(attempts: list[AttemptMetrics]) -> Timeline:
    """The kept timeline: each attempt's records up to the step the next attempt resumed from (all of them when it
    has no step numbers and the next one began again), then the last attempt's; and each attempt's steps."""
    out = Timeline()
    attempts = [AttemptMetrics(a.number, _own(a), a.resumed_step) for a in attempts]
    for i, attempt in enumerate(attempts):
        steps = [r["step"] for r in attempt.records if isinstance(r.get("step"), int)]
        seen = AttemptSteps(attempt.number, steps[0] if steps else None, max(steps) if steps else None, points=len(attempt.records))
        following = attempts[i + 1] if i + 1 < len(attempts) else None
        kept = attempt.records
        if following is not None:
            cut = following.resumed_step if following.resumed_step is not None else _first_step(following.records) - 1
            kept = [r for r in attempt.records if isinstance(r.get("step"), int) and r["step"] <= cut]
            if steps:
                seen.kept_to = max((s for s in steps if s <= cut), default=None)
                seen.steps_lost = max(0, max(steps) - cut)
            elif attempt.records and following.resumed_step:
                kept = attempt.records  # no steps to cut by: kept as printed, in order, before the next attempt's
        else:
            seen.kept_to = seen.last_step
            seen.steps_lost = 0 if steps else None
        out.attempts.append(seen)
        out.records += [dict(r, attempt=attempt.number) for r in kept]
    out.numbered = all(isinstance(r.get("step"), int) for r in out.records)
    if not out.numbered:  # the plot and summary count logged points instead: 1, 2, … over the kept timeline
        out.records = [dict(r, step=None, index=i) for i, r in enumerate(out.records, 1)]
    return out
