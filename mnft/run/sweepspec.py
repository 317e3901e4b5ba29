"""What a sweep asks, as given: `--sweep KEY=V1,V2` (repeated: a grid), a job file's `sweep:` (a grid, or a list of
points), `--max-parallel K`, `--after RUN[:any]`; judged here, before anything else (pure: text in, values out).

A sweep key names a placeholder the job fills per point (`-- train.py --lr {lr}`): a word of letters, digits and
`_`, not one of the run's own placeholders ({output_dir}, {run_id} …). Values are text, passed as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mnft.core.errors import InputError

KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_POINTS = 1000  # a sweep's points at most (a grid multiplies: 10 x 10 x 10 is already that)
MAX_VALUE = 1000  # characters of one value
SWEEP_KEYS = ("grid", "points", "metric", "goal", "max_parallel")
GOALS = ("min", "max")


@dataclass(frozen=True)
class SweepSpec:
    """The points (each {key: value}, in order) and how the best one is told: `metric` (as the job's metrics name
    it), lowest (`goal` min) or highest."""

    keys: tuple[str, ...]
    points: tuple[tuple[tuple[str, str], ...], ...]
    metric: str = "loss"
    goal: str = "min"
    max_parallel: int | None = None

    def values(self) -> list[dict[str, str]]:
        return [dict(p) for p in self.points]


def _key(key: Any, where: str, reserved: frozenset[str]) -> str:
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise InputError(f"{where}: sweep key {str(key)[:40]!r}: a word of letters, digits and _ (the placeholder {{KEY}} it fills)")
    if key in reserved:
        raise InputError(f"{where}: sweep key {key!r} is a placeholder mnft fills itself ({{{key}}}): name the sweep's key otherwise")
    return key


def _value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    if not isinstance(value, (str, int, float)) or isinstance(value, str) and (value == "" or len(value) > MAX_VALUE
                                                                              or any(ord(c) < 32 for c in value)):
        raise InputError(f"{where}: value {str(value)[:40]!r}: text or a number of at most {MAX_VALUE} characters, one line")
    return str(value)


def _grid(pairs: list[tuple[str, list[str]]], where: str) -> tuple[tuple[tuple[str, str], ...], ...]:
    points: list[tuple[tuple[str, str], ...]] = [()]
    for key, values in pairs:
        points = [p + ((key, v),) for p in points for v in values]
        if len(points) > MAX_POINTS:
            raise InputError(f"{where}: more than {MAX_POINTS} points: sweep in parts")
    return tuple(points)


def from_flags(flags: tuple[str, ...], reserved: frozenset[str]) -> SweepSpec | None:
    """`--sweep lr=1e-4,3e-4 --sweep seed=1,2`: the grid of every value of every key (the first key varies slowest)."""
    if not flags:
        return None
    pairs: list[tuple[str, list[str]]] = []
    for flag in flags:
        key, sep, text = str(flag).partition("=")
        where = f"--sweep {str(flag)[:60]}"
        if not sep:
            raise InputError(f"{where}: write KEY=V1,V2,… (e.g. --sweep lr=1e-4,3e-4)")
        key = _key(key.strip(), where, reserved)
        if any(k == key for k, _ in pairs):
            raise InputError(f"{where}: key {key!r} given twice: one --sweep per key, its values comma-separated")
        values = [v.strip() for v in text.split(",")]
        if not text.strip() or any(v == "" for v in values):
            raise InputError(f"{where}: an empty value: write KEY=V1,V2,… with no empty value")
        if len(set(values)) != len(values):
            raise InputError(f"{where}: a value given twice")
        pairs.append((key, [_value(v, where) for v in values]))
    return SweepSpec(tuple(k for k, _ in pairs), _grid(pairs, "--sweep"))


def from_job(data: Any, where: str, reserved: frozenset[str]) -> SweepSpec:
    """A job file's `sweep:` — `grid: {lr: [1e-4, 3e-4], seed: [1, 2]}` or `points: [{lr: 1e-4, seed: 1}, …]`,
    with `metric:` (default loss), `goal: min|max` and `max_parallel:`."""
    if not isinstance(data, dict) or not data:
        raise InputError(f"{where}: a mapping with grid: or points: (see docs/sweeps.md)")
    unknown = [k for k in data if k not in SWEEP_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {str(unknown[0])!r} (known: {', '.join(SWEEP_KEYS)})")
    if (data.get("grid") is None) == (data.get("points") is None):
        raise InputError(f"{where}: give exactly one of grid: (every combination) or points: (a list of {{key: value}})")
    if data.get("grid") is not None:
        grid = data["grid"]
        if not isinstance(grid, dict) or not grid:
            raise InputError(f"{where}.grid: a mapping of key: [values]")
        pairs = []
        for key, values in grid.items():
            at = f"{where}.grid.{key}"
            key = _key(key, at, reserved)
            values = values if isinstance(values, list) else [values]
            if not values:
                raise InputError(f"{at}: an empty list of values")
            texts = [_value(v, at) for v in values]
            if len(set(texts)) != len(texts):
                raise InputError(f"{at}: a value given twice")
            pairs.append((key, texts))
        keys, points = tuple(k for k, _ in pairs), _grid(pairs, where)
    else:
        given = data["points"]
        if not isinstance(given, list) or not given:
            raise InputError(f"{where}.points: a list of {{key: value}} mappings")
        if len(given) > MAX_POINTS:
            raise InputError(f"{where}.points: more than {MAX_POINTS} points: sweep in parts")
        keys = ()
        rows = []
        for n, point in enumerate(given, 1):
            at = f"{where}.points[{n}]"
            if not isinstance(point, dict) or not point:
                raise InputError(f"{at}: a mapping of key: value")
            row = tuple((_key(k, at, reserved), _value(v, f"{at}.{k}")) for k, v in point.items())
            if n == 1:
                keys = tuple(k for k, _ in row)
            elif sorted(k for k, _ in row) != sorted(keys):
                raise InputError(f"{at}: keys {', '.join(sorted(k for k, _ in row))}, but point 1 has {', '.join(sorted(keys))}: every point sets the same keys")
            rows.append(tuple(sorted(row, key=lambda kv: keys.index(kv[0]))))
        if len(set(rows)) != len(rows):
            raise InputError(f"{where}.points: a point given twice")
        points = tuple(rows)
    metric = data.get("metric", "loss")
    if not isinstance(metric, str) or not KEY.fullmatch(metric.replace("/", "_").replace(".", "_").replace("-", "_")):
        raise InputError(f"{where}.metric: {str(metric)[:40]!r}: the name of a metric the job prints (loss, eval_loss …)")
    goal = data.get("goal", "min")
    if goal not in GOALS:
        raise InputError(f"{where}.goal: {str(goal)[:20]!r}: min (lower is better) or max")
    return SweepSpec(keys, points, metric, goal, max_parallel(data.get("max_parallel"), f"{where}.max_parallel"))


def max_parallel(value: Any, where: str = "--max-parallel") -> int | None:
    if value is None:
        return None
    try:
        number = int(value) if not isinstance(value, bool) and str(value).strip().isdigit() else -1
    except (TypeError, ValueError):
        number = -1
    if number < 1:
        raise InputError(f"{where}: {str(value)[:20]!r}: a whole number ≥ 1 (the most points running at once)")
    return number


@dataclass(frozen=True)
class After:
    """`--after RUN` (RUN must succeed) or `--after RUN:any` (RUN must have ended, however)."""

    run_id: str
    any_end: bool = False

    def label(self) -> str:
        return f"{self.run_id}:any" if self.any_end else self.run_id


def after(value: Any) -> After | None:
    if value is None:
        return None
    from mnft.run.records import RUN_ID

    text = str(value)
    run, _, how = text.partition(":")
    if how not in ("", "any") or not RUN_ID.fullmatch(run):
        raise InputError(f"--after {text[:80]!r}: a run id (it must succeed first), or RUN:any (it must have ended, however)")
    return After(run, how == "any")
