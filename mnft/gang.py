"""Gang supervision: start every host's run in parallel and treat them as one.

Each host runs mnft.agent `launch` over its own SSH session: the agent starts torchrun under a keeper in a new
process group and streams JSON events (output lines, rank 0's metrics, a heartbeat every second, the exit code).
The controller writes a heartbeat to every agent; an agent that stops hearing it (controller gone, link cut)
tears its own run down. When any host's run exits non-zero, its agent stops answering, or the user presses
Ctrl-C, the controller tells every other agent to stop (SIGTERM to the run's process group, SIGKILL after a
grace period, then anything still carrying the run id) and sweeps each reachable host once more to prove
nothing of the run is left. It never waits for a collective timeout.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from mnft import agent, pyrun
from mnft.command import Command
from mnft.connection import HostKeyRejected, Process, Unreachable
from mnft.errors import MnftError
from mnft.fleet import Fleet, Status
from mnft.launch import HostLaunch, LaunchOptions

LOST_AFTER = 10.0  # seconds without any event from an agent before its host counts as lost
HEARTBEAT_EVERY = 2.0
START_TIMEOUT = 60.0
TAIL = 20
# torchrun --tee prefixes each worker line: with mnft's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE "[rank<global rank>]:"
# (the rank torch actually gave the worker: with --rdzv c10d it is not the inventory order), else torchrun's
# default "[default<local rank>]:" (older runs)
RANK_PREFIX = re.compile(r"^\[(rank|default)(\d+)\]:(.*)$", re.S)


class GangError(MnftError):
    pass


@dataclass
class HostRun:
    launch: HostLaunch
    process: Process | None = None
    state: str = "starting"  # starting | running | exited | stopped | lost | failed-to-start
    exit_code: int | None = None
    error: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    ended_at: float | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL))
    stop_report: dict | None = None

    @property
    def done(self) -> bool:
        return self.state in ("exited", "stopped", "lost", "failed-to-start")


@dataclass
class GangResult:
    ok: bool
    failed_host: str | None
    reason: str
    hosts: dict[str, HostRun]
    first_step_at: float | None = None
    leftovers: dict[str, list[int]] = field(default_factory=dict)


def agent_command(fleet: Fleet, host_name: str, *args: str) -> Command:
    return pyrun.command(fleet.inventory.host(host_name), *args)


def agent_payload() -> bytes:
    return pyrun.payload(agent.source())


def split_rank(text: str, rank_offset: int) -> tuple[int | None, str]:
    """A worker's output line -> (its global rank, the text without torchrun's prefix)."""
    match = RANK_PREFIX.match(text)
    if not match:
        return None, text
    number = int(match.group(2))
    return (number if match.group(1) == "rank" else rank_offset + number), match.group(3)


def rank_line(launch: HostLaunch, text: str) -> tuple[int | None, str]:
    return split_rank(text, launch.rank_offset)


class Gang:
    def __init__(
        self,
        fleet: Fleet,
        launches: list[HostLaunch],
        run_id: str,
        options: LaunchOptions,
        secrets: dict[str, str],
        *,
        on_line: Callable[[str, int | None, str], None] = lambda host, rank, text: None,
        on_metric: Callable[[dict], None] = lambda data: None,
    ) -> None:
        self.fleet = fleet
        self.run_id = run_id
        self.options = options
        self.secrets = secrets
        self.runs = {l.host: HostRun(l) for l in launches}
        self.events: "queue.Queue[tuple[str, dict]]" = queue.Queue()
        self.on_line, self.on_metric = on_line, on_metric
        self._stop_heartbeat = threading.Event()
        self.first_step_at: float | None = None

    # ---------------------------------------------------------------------------------------------- start

    def _start_one(self, name: str) -> HostRun:
        run = self.runs[name]
        host = self.fleet.inventory.host(name)
        try:
            process = self.fleet.start(host, agent_command(self.fleet, name, "launch"))
            spec = run.launch.spec(self.run_id, self.secrets, self.options)
            process.write(agent_payload() + json.dumps(spec).encode() + b"\n")
        except (Unreachable, HostKeyRejected) as exc:
            run.state, run.error = "failed-to-start", str(exc)
            return run
        run.process = process
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            item = process.readline(timeout=max(0.0, deadline - time.monotonic()))
            if item is None:
                break
            stream, line = item
            if line is None:
                if stream == "stdout":
                    break
                continue
            if stream == "stderr":
                run.tail.append(line.rstrip("\n"))
                continue
            event = _parse(line)
            if event.get("event") == "started":
                run.state, run.started_at = "running", time.time()
                run.last_seen = time.monotonic()
                if self.options.detach:
                    process.close_stdin()
                else:
                    threading.Thread(target=self._reader, args=(name, process), daemon=True).start()
                return run
            if event.get("event") == "error":
                run.error = event.get("message", "")
                break
        run.state = "failed-to-start"
        run.error = run.error or "the agent did not start: " + (" | ".join(run.tail) or "no output")
        return run

    def start(self) -> None:
        """Start every host in parallel; if any fails, stop the ones that started and raise."""
        results = self.fleet.map(lambda host: _as_result(self._start_one(host.name)), [self.fleet.inventory.host(n) for n in self.runs])
        for r in results:  # an exception while starting (a broken SSH channel, a local error) is a failed start too
            if r.status is not Status.OK and self.runs[r.host].state != "failed-to-start":
                self.runs[r.host].state, self.runs[r.host].error = "failed-to-start", r.error or r.status.value
        failed = [self.runs[r.host] for r in results if self.runs[r.host].state == "failed-to-start"]
        if failed:
            self.teardown(f"{failed[0].launch.host} failed to start")
            names = ", ".join(f"{r.launch.host}: {r.error}" for r in failed)
            raise GangError(f"run {self.run_id} did not start on every host ({names}); the others were stopped")
        if not self.options.detach:
            threading.Thread(target=self._heartbeat, daemon=True).start()

    def _reader(self, name: str, process: Process) -> None:
        for stream, line in process.stream():
            if stream == "stdout":
                self.events.put((name, _parse(line)))
            else:
                self.events.put((name, {"event": "stderr", "text": line.rstrip("\n")}))
        self.events.put((name, {"event": "eof"}))

    def _heartbeat(self) -> None:
        while not self._stop_heartbeat.wait(HEARTBEAT_EVERY):
            for run in self.runs.values():
                if run.state == "running" and run.process is not None:
                    try:
                        run.process.write(b"hb\n")
                    except Exception:  # noqa: BLE001 - a dead channel shows up as a lost host
                        pass

    # ---------------------------------------------------------------------------------------------- supervise

    def _handle(self, name: str, event: dict) -> str | None:
        """Apply one event; return a failure reason when the gang must be torn down."""
        run = self.runs[name]
        run.last_seen = time.monotonic()
        kind = event.get("event")
        if kind == "line":
            rank, text = rank_line(run.launch, event.get("text", ""))
            run.tail.append(text)
            self.on_line(name, rank, text)
        elif kind == "stderr":
            run.tail.append(event["text"])
            self.on_line(name, None, event["text"])
        elif kind == "metric":
            data = event.get("data") or {}
            if "step" in data and self.first_step_at is None:
                self.first_step_at = time.time()
            self.on_metric(data)
        elif kind == "exit":
            run.state, run.exit_code, run.ended_at = "exited", int(event.get("code", 1)), time.time()
            if run.exit_code != 0:
                return f"{name}: torchrun exited with code {run.exit_code}"
        elif kind == "stopped":
            run.state, run.ended_at, run.stop_report = "stopped", time.time(), event
        elif kind == "eof":
            if not run.done:
                self._lost(run, "connection to the host's agent lost")
                return f"{name}: connection lost"
        return None

    def _lost(self, run: HostRun, why: str) -> None:
        """The host is gone: its own agent tears its run down (dead-man switch); later phases skip it."""
        run.state, run.error, run.ended_at = "lost", why, time.time()
        self.fleet.mark_unreachable(run.launch.host, why)

    def wait(self) -> GangResult:
        reason = None
        failed = None
        try:
            while not all(r.done for r in self.runs.values()):
                try:
                    name, event = self.events.get(timeout=0.5)
                except queue.Empty:
                    name, event = None, None
                if name is not None:
                    why = self._handle(name, event)
                    if why:
                        reason, failed = why, name
                        break
                now = time.monotonic()
                silent = [r for r in self.runs.values() if r.state == "running" and now - r.last_seen > LOST_AFTER]
                if silent:
                    run = silent[0]
                    self._lost(run, f"no heartbeat for {LOST_AFTER:g}s")
                    reason, failed = f"{run.launch.host}: no heartbeat from its agent for {LOST_AFTER:g}s (host down or link cut)", run.launch.host
                    break
        except KeyboardInterrupt:
            reason = "interrupted (Ctrl-C)"
            leftovers = self.teardown(reason)
            raise GangInterrupted(GangResult(False, None, reason, self.runs, self.first_step_at, leftovers)) from None
        except BaseException:
            self.teardown("the controller failed")  # a bug here must not leave the run going on any host
            raise
        if reason is None:
            self._stop_heartbeat.set()
            return GangResult(True, None, "every host finished", self.runs, self.first_step_at)
        leftovers = self.teardown(reason)
        return GangResult(False, failed, reason, self.runs, self.first_step_at, leftovers)

    # ---------------------------------------------------------------------------------------------- teardown

    def teardown(self, reason: str) -> dict[str, list[int]]:
        """Stop every host's run that is still going, then sweep every reachable host by run id."""
        for run in self.runs.values():
            if run.state in ("running", "starting") and run.process is not None:
                try:
                    run.process.write(b"stop\n")
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.monotonic() + self.options.grace + 10
        while time.monotonic() < deadline and any(r.state in ("running", "starting") and r.process is not None for r in self.runs.values()):
            try:
                name, event = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            self._handle(name, event)
        self._stop_heartbeat.set()
        for run in self.runs.values():
            if run.process is not None:
                run.process.close_stdin()
        return self.sweep([r.launch for r in self.runs.values() if r.state != "lost"])

    def sweep(self, launches: list[HostLaunch]) -> dict[str, list[int]]:
        """`agent stop` on each host: kills what is left of the run, returns the pids still alive per host."""
        by_name = {l.host: l for l in launches}
        hosts = [self.fleet.inventory.host(n) for n in by_name]
        results = self.fleet.run(
            lambda host: agent_command(self.fleet, host.name, "stop", by_name[host.name].run_dir, str(self.options.grace)),
            stdin=agent_payload(),
            hosts=hosts,
            timeout=self.options.grace + 20,
        )
        leftovers = {}
        for result in results:
            if result.ok:
                data = _parse(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "{}")
                if data.get("remaining"):
                    leftovers[result.host] = data["remaining"]
        return leftovers


class GangInterrupted(Exception):
    def __init__(self, result: GangResult):
        super().__init__(result.reason)
        self.result = result


def _parse(line: str) -> dict:
    try:
        data = json.loads(line)
    except ValueError:
        return {"event": "line", "text": line.rstrip("\n")}
    return data if isinstance(data, dict) else {"event": "line", "text": line.rstrip("\n")}


def _as_result(run: HostRun):
    from mnft.fleet import HostResult, Status

    return HostResult(run.launch.host, Status.OK if run.state == "running" else Status.FAILED, error=run.error)
