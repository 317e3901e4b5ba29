"""A sweep for a person: `status SWEEP` as one table (point, values, state, hosts and GPUs, step, last and best
metric, time), the best point marked; `--json` for machines. Read from the records here (mnft.run.supervisor.refresh
brings them from the sweep's supervisor first)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table
from rich.text import Text

from mnft.core import limits
from mnft.core.errors import ExitCode, InputError
from mnft.core.output import console, fmt_loss, plain, print_json
from mnft.run import records
from mnft.run import sweep as sweeping
from mnft.run.report import supervisor_line

METRICS_FILES = ("metrics.jsonl", "live-metrics.jsonl")  # the collected timeline first, else what reached the supervisor


def metrics_of(folder: Path) -> list[dict]:
    """A point's metrics as step records (the collected timeline, else the live one), read within limits."""
    for name in METRICS_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            text = limits.read_bytes(path, limits.METRICS_FILE_BYTES, "a metrics file", "METRICS_FILE_BYTES").decode("utf-8", "replace")
        except (InputError, OSError):
            continue
        return records.json_objects(text.splitlines())
    return []


def rows_of(record: records.RunRecord, now: float | None = None) -> tuple[list[dict], dict | None]:
    """The sweep's table rows (mnft.run.sweep.point_row) from its points' records here, and its best row."""
    sweep = record.data.get("sweep") or {}
    metric, goal = sweep.get("metric") or "loss", sweep.get("goal") or "min"
    rows = []
    for point in sweep.get("points") or []:
        if not isinstance(point, dict):
            continue
        folder = records.path_of(str(point.get("run_id")))
        data = None
        if folder is not None:
            try:
                data = records.read_record(folder / "run.json")
            except InputError:
                data = None
        rows.append(sweeping.point_row(point, data, metrics_of(folder) if folder is not None else [], metric, goal, now))
    return rows, sweeping.best_row(rows, goal)


def _cell(value) -> str:
    return "" if value is None else fmt_loss(value) if isinstance(value, float) else str(value)


def _time(seconds) -> str:
    if seconds is None:
        return ""
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 86400:.1f} d"


def print_sweep(record: records.RunRecord, as_json: bool) -> int:
    """`status SWEEP`: exit 0 while it goes on with no point failed, or once every point succeeded."""
    rows, best = rows_of(record)
    data = record.data
    sweep = data.get("sweep") or {}
    if as_json:
        print_json({"sweep": record.run_id, "state": data.get("state"), "reason": data.get("reason"), "metric": sweep.get("metric"),
                    "goal": sweep.get("goal"), "best": best and best["run_id"], "points": rows, "supervisor": data.get("supervisor")})
    else:
        out = console()
        table = Table(title=f"sweep {record.run_id}: {data.get('state')} — {sweeping.summary(sweep.get('points') or [])}", title_justify="left")
        metric = sweep.get("metric") or "loss"
        for name in ("point", "values", "state", "hosts and GPUs", "step", f"last {metric}", f"best {metric}", "time"):
            table.add_column(name, justify="right" if name in ("point", "step", "time") or metric in name else "left")
        for row in rows:
            mark = best is not None and row["run_id"] == best["run_id"]
            state = row["state"] or ""
            style = "green" if state == "succeeded" else "red" if state in ("failed", "dependency-failed", "supervisor-lost", "refused", "sync-failed") else None
            table.add_row(f"{'★ ' if mark else ''}{row['index']}", sweeping.values_label(row["values"]), Text(state, style=style or ""), row["where"],
                          _cell(row["step"]), _cell(row["last"]), Text(_cell(row["best"]), style="bold" if mark else ""), _time(row["seconds"]))
        out.print(table)
        if best is not None:
            out.print(plain(f"best: point {best['index']} ({sweeping.values_label(best['values'])}), run {best['run_id']}: "
                            f"{metric} {_cell(best['best'])} ({sweep.get('goal') or 'min'})"))
        for row in rows:
            if row.get("reason") and row["state"] not in (sweeping.PENDING,):
                out.print(plain(f"point {row['index']} ({row['run_id']}): {row['reason']}"))
        if data.get("reason") and data.get("state") != "succeeded":
            out.print(plain(f"sweep: {data['reason']}"))
        if data.get("supervisor"):
            out.print(plain(supervisor_line(data)))
    failed = any(r["state"] in sweeping.FINAL_POINT and r["state"] != "succeeded" for r in rows)
    going = data.get("state") in ("handed-over", "supervised", "running", "waiting")
    return ExitCode.OK if (going or data.get("state") == "succeeded") and not failed else ExitCode.FAILED
