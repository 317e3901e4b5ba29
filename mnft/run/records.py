"""Local run records: runs/<id>/run.json (inventory snapshot, facts, code hash, per-host commands with secrets
redacted, timings, exit codes), written as the run goes; runs/<id>/<host>/ holds the collected logs.

A run's record lives under `runs/` of the directory train was started in (or $MNFT_RUNS_DIR); the user's index,
`$MNFT_HOME/runs/<id>` (a link to that record's directory, made when the run is recorded, never replaced while its
record is there), finds it by id from any directory. The current directory's runs come first; an index entry whose
record is gone is skipped."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.core.output import command

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a name inside runs/, never a path
RECORD_MAX = limits.RECORD_BYTES  # bytes of run.json read at most (one more tells it is larger; never the rest)


IGNORE_ALL = "# written by mnft: its run records stay out of `git status` (as .pytest_cache does)\n*\n"


def runs_root() -> Path:
    return Path(os.environ.get("MNFT_RUNS_DIR") or "runs")


def index_root() -> Path:
    """The user's index of their runs, wherever each was started: $MNFT_HOME/runs/<id> -> the record's directory."""
    from mnft.hosts.hostkeys import mnft_home  # here: reading a record needs no SSH library

    return mnft_home() / "runs"


def add_to_index(path: Path) -> None:
    """The record's directory, linked by its run id in the user's index (best effort: a read-only home leaves the
    run findable from its own directory). An entry of a record still there is never replaced; a stale one is."""
    root = index_root()
    link = root / path.name
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        target = str(path.resolve())
        try:
            os.symlink(target, link)
        except FileExistsError:
            if indexed_path(path.name) is None:  # stale (its record deleted or moved): this run takes the name
                tmp = root / f".{path.name}.{os.getpid()}.tmp"
                os.symlink(target, tmp)
                os.replace(tmp, link)
    except OSError:
        pass


def indexed_path(run_id: str) -> Path | None:
    """The record directory the user's index names for this run id, when a record of that run is there."""
    if not RUN_ID.fullmatch(run_id):
        return None
    try:
        path = Path(os.readlink(index_root() / run_id))
    except OSError:
        return None
    return path if path.is_absolute() and (path / "run.json").is_file() else None


def indexed() -> dict[str, Path]:
    """run id -> record directory, for every entry of the user's index whose record is still there."""
    try:
        names = sorted(n for n in os.listdir(index_root()) if RUN_ID.fullmatch(n))
    except OSError:
        return {}
    return {name: path for name in names if (path := indexed_path(name)) is not None}


def every_run() -> dict[str, Path]:
    """run id -> record directory for every run of the user's: this directory's runs/ and the index (this
    directory's record wins for an id both name), in run-id order (the ids begin with their start time)."""
    found = indexed()
    root = runs_root()
    found.update({name: root / name for name in all_runs() if RUN_ID.fullmatch(name)})
    return dict(sorted(found.items()))


def path_of(run_id: str) -> Path | None:
    """Where the run's record is: this directory's runs/ first, else the user's index; None when neither has it."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        return None
    here = runs_root() / run_id
    if (here / "run.json").is_file():
        return here
    return indexed_path(run_id)


def out_of_git(root: Path) -> None:
    """A .gitignore of `*` in the records' directory (in a repository, `runs/` would show as `?? runs/` in git
    status), written once; one already there (a user's) is left as it is."""
    marker = root / ".gitignore"
    if not marker.exists():
        try:
            marker.write_text(IGNORE_ALL)
        except OSError:
            pass  # a read-only directory: the records work without it


@dataclass
class RunRecord:
    path: Path  # runs/<id>
    data: dict[str, Any]

    @property
    def run_id(self) -> str:
        return self.data["run_id"]

    @classmethod
    def create(cls, run_id: str, **data: Any) -> "RunRecord":
        path = runs_root() / run_id
        path.mkdir(parents=True, exist_ok=False)
        out_of_git(path.parent)
        record = cls(path, {"run_id": run_id, "created": time.time(), "started_in": os.getcwd(), **data})
        record.save()
        add_to_index(path)
        return record

    def save(self) -> None:
        tmp = self.path / "run.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path / "run.json")

    def update(self, **data: Any) -> None:
        self.data.update(data)
        self.save()

    def set_host(self, host: str, **data: Any) -> None:
        self.data.setdefault("hosts", {}).setdefault(host, {}).update(data)
        self.save()


STOP_REQUESTED = "stop-requested"  # runs/<id>/stop-requested: `stop` was asked (the attached supervisor reads it)


def request_stop(record: RunRecord, by: str) -> None:
    """Say, beside run.json (which an attached `train` rewrites), that the run was stopped on purpose."""
    (record.path / STOP_REQUESTED).write_text(json.dumps({"at": time.time(), "by": by}) + "\n")


def stop_requested(record: RunRecord) -> dict | None:
    try:
        data = limits.read_json(record.path / STOP_REQUESTED, limits.STATE_BYTES, "stop request", "STATE_BYTES", missing=None)
    except limits.TooLarge:
        raise
    except InputError:  # unreadable or damaged: no request to believe
        return None
    return data if isinstance(data, dict) else None


def all_runs() -> list[str]:
    root = runs_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "run.json").is_file())


def load(run_id: str | None = None, prefer=None, anywhere: bool = False) -> RunRecord:
    """A run by id (this directory's runs/, else the user's index), or the latest one here (the latest for which
    `prefer(data)` holds, when there is one); `anywhere`: with no run here, the latest of the user's index."""
    runs = all_runs()
    if run_id is None:
        elsewhere = indexed() if not runs else {}
        if not runs and not (anywhere and elsewhere):
            there = f"; yours elsewhere: {len(elsewhere)}, the latest {list(elsewhere)[-1]} (`{command('runs')}` lists them; give the id)" if elsewhere else ""
            raise InputError(f"{runs_root()}: no runs recorded yet (start one with {command('train')}){there}")
        paths = {name: runs_root() / name for name in runs} if runs else elsewhere
        run_id = list(paths)[-1]
        if prefer is not None:
            for candidate in reversed(paths):
                try:
                    data = read_record(paths[candidate] / "run.json")
                except InputError:
                    continue
                if prefer(data):
                    run_id = candidate
                    break
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):  # a run id never leaves runs/ (../x, /etc)
        raise InputError(f"run id {run_id!r}: not a run id (like 20261125-073502-0ef6): see `{command('runs')}` for the runs")
    path = path_of(run_id)
    if path is None:
        hint = f" (latest here: {runs[-1]})" if runs else ""
        raise InputError(f"{runs_root() / run_id}: no such run{hint}; `{command('runs')}` lists your runs")
    data = read_record(path / "run.json")
    if data.get("run_id") != run_id:
        raise InputError(f"{path / 'run.json'}: not this run's record: move the run away or delete it")
    return RunRecord(path, data)


def read_record(path: Path) -> dict[str, Any]:
    """A run.json as a mapping, read within limits (at most RECORD_BYTES; JSON nesting, integers as Python
    bounds them), or a one-line InputError: damaged, foreign or too large, never a traceback."""
    too_large = f"{path}: a run record larger than {limits.size(RECORD_MAX)} (a limit of mnft's input): move the run away or delete it"
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > RECORD_MAX:  # refused without reading it
                raise InputError(too_large)
            raw = limits.read_at_most(f, RECORD_MAX)
    except OSError as exc:
        raise InputError(f"{path}: unreadable run record ({exc.strerror or type(exc).__name__}): move the run away or delete it") from None
    if len(raw) > RECORD_MAX:
        raise InputError(too_large)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # malformed, not UTF-8, an integer of thousands of digits, nested too deep
        raise InputError(f"{path}: unreadable run record ({type(exc).__name__}): move the run away or delete it") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a run record (a JSON object): move the run away or delete it")
    return data


def json_objects(lines: Any) -> list[dict]:
    """The JSON objects of a .jsonl file's lines (bytes or text) that mnft wrote; a damaged line is skipped."""
    out = []
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out
