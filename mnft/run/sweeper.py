"""A sweep's supervisor on the lab: one process for the whole sweep, started as a detached run's supervisor is
(mnft.run.supervisor, mnft.run.supervised), for as long as the sweep has a point not ended.

It keeps the sweep's queue: at most `max_parallel` points active, each a child process running this package's
`train` for that point (mnft.run.supervised.point: its own run id, record, directory, logs and resume, on the host
picked for it). A point enters a host's line only when the sweep has room for it, and at most one point of the
sweep waits in each host's line: until then it holds no place there, so a labmate's run that joins the line later
goes first by the line's own rule (mnft.onhost.line). A point that fails ends that point only. `mnft stop SWEEP`
(its request file, then SIGINT) stops every active point as `mnft stop` stops a run, and the pending ones never
start. The sweep's end is told once, with a summary (--notify).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from mnft.hosts.fleet import Fleet
from mnft.hosts.lab import device_count, free_count, look
from mnft.run import records
from mnft.run import sweep as sweeping
from mnft.run.notify import tell

TICK = 1.0  # seconds between two looks at the points' records (a child ended, a point's state changed)
LOOK_IDLE = 10.0  # seconds between two looks at the hosts while nothing of the sweep changed (GPUs that free where
# one of its points waits in line are taken by that point, which changes its state and brings the next look at once)
STOP_GRACE = 300.0  # seconds the active points get to stop (their gangs torn down, their records written)
POINT_BOOT = ("import sys; sys.path[:0] = [sys.argv[1]]; from mnft.run.supervised import point; sys.exit(point(sys.argv[2], sys.argv[3]))")


class Sweeper:
    def __init__(self, spec: dict, here: Path, console: Console) -> None:
        self.spec, self.here, self.console = spec, here, console
        self.inventory = spec["inventory"]
        self.options = spec["options"]
        self.sweep = spec["sweep"]
        self.record = records.RunRecord.create(spec["run_id"], **spec["record"])
        self.points: list[dict] = self.record.data["sweep"]["points"]
        self.children: dict[str, tuple[subprocess.Popen, str, float]] = {}  # point id -> (process, host, spawned at)
        self.stopping: dict | None = None
        self.saved = ""
        self.site = str(Path(sweeping.__file__).resolve().parents[2])  # what this process runs from: the bundle's site

    # ---------------------------------------------------------------- the loop

    def run(self) -> int:
        from mnft.run.after import wait_there

        self.record.update(state="waiting" if self.sweep.get("after") else "running")
        try:
            if self.sweep.get("after"):
                why = wait_there(self.sweep["after"], self.say)
                if why is not None:
                    for p in self.points:
                        if p["state"] == sweeping.PENDING:
                            p.update(state="dependency-failed", ended=time.time())
                    return self.finish("dependency-failed", why)
                self.record.update(state="running")
            with Fleet(self.inventory) as fleet:
                looked = 0.0
                while True:
                    changed = self.reap()
                    if self.stop_asked():
                        raise KeyboardInterrupt
                    pending = [p for p in self.points if p["state"] == sweeping.PENDING]
                    if not pending and not self.children:
                        break
                    room = (self.sweep.get("max_parallel") or len(self.points)) - len(self.children)
                    if pending and room > 0 and (changed or time.monotonic() - looked >= LOOK_IDLE):
                        looked = time.monotonic()
                        self.start(fleet, pending, room)
                    self.save()
                    time.sleep(TICK)
        except KeyboardInterrupt:
            self.stop_all()
            return self.finish("stopped", f"stopped by `mnft stop` ({(self.stopping or {}).get('by') or 'a signal'})")
        return self.finish(sweeping.sweep_state(self.points), None)

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def save(self) -> None:
        """The sweep's record written when a point changed (the controller's refresh brings it)."""
        now = json.dumps(self.points)
        if now != self.saved:
            self.saved = now
            self.record.data["sweep"]["summary"] = sweeping.summary(self.points)
            self.record.save()

    # ---------------------------------------------------------------- starting points

    def start(self, fleet: Fleet, pending: list[dict], room: int) -> None:
        hosts = [h for h in self.inventory.hosts if not h.spare]
        views = look(fleet, hosts)
        names = [h.name for h in hosts]
        ours = {p["run_id"] for p in self.points}
        free, size, waiting = {}, {}, {}
        for name in names:
            view = views.get(name) or {}
            if view.get("error") or view.get("devices_error"):
                continue
            size[name] = device_count(view) - sum(1 for d in view.get("devices") or [] if d.get("state") in ("drained", "unhealthy"))
            seen = {str((d.get("holder") or {}).get("run_id")) for d in view.get("devices") or [] if d.get("state") == "held"}
            seen |= {str(t.get("run_id")) for t in view.get("line") or [] if isinstance(t, dict)}
            waiting[name] = sum(1 for t in view.get("line") or [] if isinstance(t, dict) and t.get("run_id") in ours)
            arriving = sum(1 for pid, (_, host, _) in self.children.items() if host == name and pid not in seen)
            free[name] = free_count(view)
            need = self.gpus or size[name]
            if arriving:  # started here, not yet holding nor in line: what it will take, or its place in line
                taken = min(arriving, free[name] // max(need, 1))
                free[name] -= taken * need
                waiting[name] += arriving - taken
        pinned = {p["index"]: p["pinned"] for p in pending if p.get("pinned")}
        starts = sweeping.plan_starts([p["index"] for p in pending], room, [n for n in names if n in size], free, size, self.gpus, waiting,
                                      pinned=pinned)
        by_index = {p["index"]: p for p in pending}
        for index, host in starts:
            self.spawn(by_index[index], host)

    @property
    def gpus(self) -> int | None:
        return self.options.gpus if self.options.gpus is not None else self.options.launch.job.gpus

    def spawn(self, point: dict, host: str) -> None:
        point_id = point["run_id"]
        job = sweeping.point_job(self.options.launch.job, point["values"])
        where = dict(self.options.supervisor or {}, sweep=self.record.run_id, point=point["index"], values=point["values"])
        options = replace(self.options, launch=replace(self.options.launch, job=job), run_id=point_id, nodes=None, wait=float("inf"), notify=None,
                          supervisor=where, resume_run=point.get("resume_from"), after=None, sweep=None)
        spec = {"run_id": point_id, "inventory": self.inventory.only([host]), "options": options, "sweep": {"id": self.record.run_id, "index": point["index"],
                                                                                                              "values": point["values"]}}
        logs = self.here / "points"
        logs.mkdir(exist_ok=True)
        with open(logs / f"{point_id}.log", "ab") as out:
            child = subprocess.Popen([sys.executable, "-I", "-S", "-c", POINT_BOOT, self.site, str(self.here), point_id], stdin=subprocess.PIPE,
                                     stdout=out, stderr=subprocess.STDOUT, cwd=self.here, start_new_session=True, close_fds=True)
        try:
            child.stdin.write(pickle.dumps(spec))
            child.stdin.close()
        except OSError:
            pass
        from mnft.onhost.runprocs import start_time

        (logs / f"{point_id}.json").write_text(json.dumps({"pid": child.pid, "start": start_time(child.pid)}) + "\n")  # `mnft stop POINT` signals it
        self.children[point_id] = (child, host, time.time())
        point.update(state="starting", host=host, started=time.time())
        self.say(f"point {point['index']} ({sweeping.values_label(point['values'])}): run {point_id} on {host}")

    # ---------------------------------------------------------------- points ending

    def point_record(self, point_id: str) -> dict:
        path = records.runs_root() / point_id / "run.json"
        try:
            return records.read_record(path) if path.is_file() else {}
        except Exception:  # noqa: BLE001 - a record being replaced: the next look reads it
            return {}

    def reap(self) -> bool:
        """The active points' states from their records, the ended ones reaped: whether any changed."""
        changed = False
        for point in self.points:
            child = self.children.get(point["run_id"])
            if child is None:
                continue
            code = child[0].poll()
            data = self.point_record(point["run_id"])
            if data.get("state") and data["state"] != point["state"]:
                point["state"] = data["state"]
                changed = True
            if code is None:
                continue
            changed = True
            del self.children[point["run_id"]]
            if point["state"] not in sweeping.FINAL_POINT:
                point.update(state="failed", reason=f"its process ended (exit {code}) before the run recorded its end: see points/{point['run_id']}.log")
            point["ended"] = time.time()
            self.say(f"point {point['index']} ({sweeping.values_label(point['values'])}): {point['state']}")
        return changed

    # ---------------------------------------------------------------- stopping

    def stop_asked(self) -> bool:
        asked = records.stop_requested(self.record)
        if asked is not None:
            self.stopping = asked
        return asked is not None

    def stop_all(self) -> None:
        """Every active point stopped as `mnft stop` stops a run (its request file, then SIGINT to its train); the
        pending ones recorded stopped without starting."""
        if self.stopping is None:
            self.stopping = records.stop_requested(self.record) or {"by": "a signal to the sweep's supervisor", "at": time.time()}
        for point in self.points:
            if point["state"] == sweeping.PENDING:
                point.update(state="stopped", reason="the sweep was stopped before this point started", ended=time.time())
        for point_id, (child, _, _) in list(self.children.items()):
            folder = records.runs_root() / point_id
            if folder.is_dir():
                (folder / records.STOP_REQUESTED).write_text(json.dumps(self.stopping) + "\n")
            try:
                os.kill(child.pid, signal.SIGINT)
            except OSError:
                pass
        deadline = time.monotonic() + STOP_GRACE
        while self.children and time.monotonic() < deadline:
            try:
                self.reap()
                time.sleep(0.2)
            except KeyboardInterrupt:  # a second signal: the wait goes on, the points are stopping
                continue
        for point_id, (child, _, _) in list(self.children.items()):  # past the grace: what is left is ended
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
        self.reap()

    # ---------------------------------------------------------------- the end

    def finish(self, state: str, reason: str | None) -> int:
        self.record.data["sweep"]["summary"] = sweeping.summary(self.points)
        told = sweeping.summary(self.points) if reason is None else f"{reason}; {sweeping.summary(self.points)}"
        from mnft.run.sweepreport import rows_of

        _, best = rows_of(self.record)
        if best is not None:
            told += f"; best: point {best['index']} ({sweeping.values_label(best['values'])}) {self.sweep.get('metric') or 'loss'} {best['best']:.6g}"
        self.record.update(state=state, reason=told if state != "succeeded" else None, ended=time.time())
        self.say(f"sweep {self.record.run_id}: {state}: {told}")
        tell(self.options.notify, "ended", self.record, self.say, dict(self.record.data, reason=told))
        from mnft.core.errors import ExitCode

        return ExitCode.OK if state == "succeeded" else (130 if state == "stopped" else ExitCode.FAILED)


def run(spec: dict, here: Path, console: Console) -> int:
    return Sweeper(spec, here, console).run()


def point_spec_of(raw: bytes) -> dict[str, Any]:
    return pickle.loads(raw)
