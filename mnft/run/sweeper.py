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
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from mnft.core import limits
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
        self.fleet: Fleet | None = None  # the hosts' connections, made again after a look that did not reach one of them
        self.unreached: set[str] = set()
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
            looked = 0.0
            try:
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
                        self.start(pending, room)
                    self.save()
                    time.sleep(TICK)
            finally:
                if self.fleet is not None:
                    self.fleet.close()
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

    def start(self, pending: list[dict], room: int) -> None:
        hosts = [h for h in self.inventory.hosts if not h.spare]
        if self.fleet is None:
            self.fleet = Fleet(self.inventory)
        views = look(self.fleet, hosts)
        names = [h.name for h in hosts]
        ours = {p["run_id"] for p in self.points}
        free, size, waiting, may_wait = {}, {}, {}, {}
        unreached = set()
        for name in names:
            view = views.get(name) or {}
            if view.get("error") or view.get("devices_error"):
                unreached.add(name)
                continue
            size[name] = device_count(view) - sum(1 for d in view.get("devices") or [] if d.get("state") in ("drained", "unhealthy"))
            line = [t for t in view.get("line") or [] if isinstance(t, dict)]
            seen = {str((d.get("holder") or {}).get("run_id")) for d in view.get("devices") or [] if d.get("state") == "held"}
            seen |= {str(t.get("run_id")) for t in line}
            waiting[name] = sum(1 for t in line if t.get("run_id") in ours)
            arriving = sum(1 for pid, (_, host, _) in self.children.items() if host == name and pid not in seen)
            # free GPUs others wait in line for are theirs first (the line's rule): a point there would only join the line
            free[name] = 0 if any(t.get("run_id") not in ours for t in line) else free_count(view)
            limit = (view.get("policy") or {}).get("max_waiting")
            if isinstance(limit, int) and not isinstance(limit, bool):
                may_wait[name] = limit - sum(1 for t in line if t.get("login") == self.login)
            need = self.gpus or size[name]
            if arriving:  # started here, not yet holding nor in line: what it will take, or its place in line
                taken = min(arriving, free[name] // max(need, 1))
                free[name] -= taken * need
                waiting[name] += arriving - taken
        if unreached != self.unreached:
            self.say(f"not reached now: {', '.join(sorted(unreached))} (no point starts there until they answer)" if unreached
                     else "every host answers again")
            self.unreached = unreached
        if unreached:  # a connection a host dropped is made again at the next look
            self.fleet.close()
            self.fleet = None
        names = [n for n in names if n in size]
        self.refuse_unplaceable(pending, names, size, unreached)
        pending = [p for p in pending if p["state"] == sweeping.PENDING]
        pinned = {p["index"]: p["pinned"] for p in pending if p.get("pinned") in names}
        starts = sweeping.plan_starts([p["index"] for p in pending], room, names, free, size, self.gpus, waiting, may_wait=may_wait, pinned=pinned)
        by_index = {p["index"]: p for p in pending}
        for index, host in starts:
            self.spawn(by_index[index], host)

    def refuse_unplaceable(self, pending: list[dict], names: list[str], size: dict[str, int], unreached: set[str]) -> None:
        """Points no host of the inventory can ever hold (more GPUs than any host has in service) end refused, with
        the reason: never a silent wait. Said only when every host answered."""
        if unreached or not names or self.gpus is None:
            return
        largest = max(size[n] for n in names)
        if self.gpus <= largest:
            return
        why = f"--gpus {self.gpus}: no host of the inventory has that many in service (the most: {largest}, on {max(names, key=lambda n: size[n])})"
        for point in pending:
            point.update(state="refused", reason=why, ended=time.time())
        self.say(f"{len(pending)} point(s) refused: {why}")

    @property
    def login(self) -> str:
        import getpass

        return getpass.getuser()

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
        self.children[point_id] = (child, host, time.time())  # first: a stop from now on reaches it
        point.update(state="starting", host=host, started=time.time())
        from mnft.onhost.runprocs import start_time

        (logs / f"{point_id}.json").write_text(json.dumps({"pid": child.pid, "start": start_time(child.pid)}) + "\n")  # `mnft stop POINT` signals it
        try:
            child.stdin.write(pickle.dumps(spec))
            child.stdin.close()
        except OSError:
            pass
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
                log = self.here / "points" / f"{point['run_id']}.log"
                tail = " | ".join(limits.last_lines(log, 3))[-600:] if log.is_file() else ""
                stopped = self.stopping is not None
                point.update(state="stopped" if stopped else "failed",
                             reason=("stopped before its run was recorded" if stopped else f"its process ended (exit {code}) before the run recorded its end")
                             + (f": {tail}" if tail else "") + f" ({log} on {socket.gethostname()})")
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
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.reap()
        for point in self.points:  # a point whose train was killed past the grace ends stopped, here at least
            if point["state"] not in sweeping.FINAL_POINT:
                point.update(state="stopped", reason=f"killed {STOP_GRACE:.0f} s after it was asked to stop", ended=time.time())

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
