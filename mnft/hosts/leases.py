"""One operation per host at a time: the controller's side of the host leases (the host's is mnft.hosts.leasehost).

train, sync, provision and setup take a lease on every host they will change before they change anything, and
keep it to their end: on each host a `hold` process, started on the fleet's open connection, holds the host's
lease file for as long as its channel lives, and this controller writes it a heartbeat. One busy host refuses the
whole operation with one line naming the host and its holder (`HostBusy`, exit 1: the host is not wrong, it is
taken; the same command succeeds once the holder is done), before anything changed on any host; the leases taken
so far are let go. A lease whose holder is gone (nobody holds its lock: its controller's channel closed or went
silent, its run ended) is taken over, and that is said once. A host that cannot be reached is left to the
operation, which reports it. Takes nested in one controller process (train's own sync) are no-ops.

Leases are per login user on a host (the file is in that user's ~/.mnft): two users of one host are not kept
apart by them (`invoke check` shows GPUs held by others).
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from mnft.core.errors import MnftError
from mnft.hosts import leasehost, pyrun
from mnft.hosts.connection import HostKeyRejected, Process, Unreachable
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host

HEARTBEAT_EVERY = 10.0
DEADMAN = 25.0  # seconds without a heartbeat (one every 10 s) before a host lets the lease go (a controller gone without a FIN)
REPLY_TIMEOUT = 60.0


class HostBusy(MnftError):
    """Another operation holds a host's lease: nothing was changed on any host."""


def _since(started: float | None) -> str:
    if not started:
        return "?"
    when = time.localtime(started)
    return time.strftime("%H:%M" if time.strftime("%Y-%m-%d", when) == time.strftime("%Y-%m-%d") else "%Y-%m-%d %H:%M", when)


def describe(holder: dict | None) -> str:
    """"train run R by user@ctl pid 123 since 10:02" (what a lease file names)."""
    if not holder:
        return "another mnft (its lease names no holder)"
    what = holder.get("command") or "an operation"
    if holder.get("run_id"):
        what += f" run {holder['run_id']}"
    return f"{what} by {holder.get('user') or '?'}@{holder.get('controller') or '?'} pid {holder.get('pid') or '?'} since {_since(holder.get('started'))}"


def busy_line(host: str, holder: dict | None, run_processes: int = 0) -> str:
    """"h1 is busy: train run R by user@ctl pid 123 since 10:02 (mnft stop R, or wait)"."""
    run_id = (holder or {}).get("run_id")
    hint = f"mnft stop {run_id}, or wait" if run_id else "wait for it to end"
    if run_processes and not (holder or {}).get("command"):
        hint = f"{run_processes} process(es) of its run are alive; " + hint
    return f"{host} is busy: {describe(holder)} ({hint})"


def host_key(host: Host) -> tuple:
    """One lease per login on one machine: what two inventory names for the same login share."""
    return ("local", getpass.getuser()) if host.is_local else (host.address, host.port, host.user)


def say_took_over(host: str, previous: dict) -> None:
    """The default word on a lease taken over: once, on stderr."""
    from mnft.core.output import console, plain

    console(stderr=True).print(plain(f"{host}: took over the lease of {describe(previous)}: its holder is gone", "yellow"))


def say_problem(host: str, why: str) -> None:
    from mnft.core.output import console, plain

    console(stderr=True).print(plain(f"{host}: warning: no lease taken ({why}): another mnft could change this host meanwhile", "yellow"))


_held_lock = threading.Lock()
_held: dict[tuple, "Leases"] = {}  # every lease this controller process holds, by host_key


@dataclass
class Leases:
    """The leases one operation holds (take, then release; or `hold`)."""

    command: str
    run_id: str | None = None
    op: str = field(default_factory=lambda: secrets.token_hex(8))
    processes: dict[str, Process] = field(default_factory=dict)
    keys: dict[str, tuple] = field(default_factory=dict)
    took_over: dict[str, dict] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _beat: threading.Thread | None = None

    def holder(self) -> dict:
        return {"op": self.op, "command": self.command, "run_id": self.run_id, "user": getpass.getuser(), "controller": socket.gethostname(),
                "pid": os.getpid(), "started": time.time(), "deadman": DEADMAN}

    def take(self, fleet: Fleet, hosts: Iterable[Host], on_took_over: Callable[[str, dict], None] = say_took_over,
             on_problem: Callable[[str, str], None] = say_problem, python: Callable[[Host], str | None] = lambda host: None) -> None:
        """Take every host's lease (hosts this process already holds are skipped); raise HostBusy naming the first
        busy host (and how many more) after letting go of the ones taken. A host whose lease script failed (its
        ~/.mnft not writable, say) is named through on_problem and left to the operation. python: the interpreter
        to run the host's side with (default the host's; provision gives its base Python)."""
        holder = self.holder()
        todo = []
        with _held_lock:
            for host in hosts:
                key = host_key(host)
                if key not in _held and key not in self.keys.values():
                    todo.append(host)
                    _held[key] = self
                    self.keys[host.name] = key
        try:
            results = fleet.map(lambda h: self._take_one(fleet, h, holder, python(h)), todo)
        except BaseException:  # an interrupt, bad input: nothing of this take is kept
            self.release()
            raise
        busy = [(r.host, json.loads(r.stdout)) for r in results if r.ok and json.loads(r.stdout).get("busy")]
        for r in results:
            if r.status is not Status.OK or json.loads(r.stdout).get("busy") or json.loads(r.stdout).get("error"):
                self._forget(r.host)  # not held there: unreachable or failed hosts are the operation's to report
        if busy:
            self.release()
            name, reply = busy[0]
            more = f" (and {len(busy) - 1} more host(s): {', '.join(n for n, _ in busy[1:])})" if len(busy) > 1 else ""
            raise HostBusy(busy_line(name, reply.get("holder"), reply.get("run_processes") or 0) + more + "; nothing was changed on any host")
        for r in results:
            if r.status is Status.FAILED or r.ok and json.loads(r.stdout).get("error"):
                on_problem(r.host, r.error or json.loads(r.stdout)["error"])
            previous = json.loads(r.stdout).get("took_over") if r.ok else None
            if previous:
                self.took_over[r.host] = previous
                on_took_over(r.host, previous)
        if self.processes and self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="mnft-lease-heartbeat")
            self._beat.start()

    def _take_one(self, fleet: Fleet, host: Host, holder: dict, python: str | None = None) -> HostResult:
        try:
            process = fleet.start(host, pyrun.command(host, "hold", python=python))
            process.write(pyrun.payload(leasehost.source()) + json.dumps(holder).encode() + b"\n")
        except (Unreachable, HostKeyRejected) as exc:
            return HostResult(host.name, Status.UNREACHABLE, error=str(exc))
        deadline = time.monotonic() + REPLY_TIMEOUT
        said: list[str] = []
        while time.monotonic() < deadline:
            item = process.readline(timeout=max(0.0, deadline - time.monotonic()))
            if item is None:
                break
            stream, line = item
            if line is None:
                if stream == "stdout":
                    break
                continue
            if stream == "stderr" and line.strip():
                said.append(line.strip())
            if stream == "stdout" and line.lstrip().startswith("{"):
                reply = json.loads(line)
                if reply.get("taken"):
                    self.processes[host.name] = process
                else:
                    process.close_stdin()
                return HostResult(host.name, Status.OK, stdout=json.dumps(reply))
        process.close_stdin()
        return HostResult(host.name, Status.FAILED, error="the lease script gave no answer" + (f": {said[-1]}" if said else ""))

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY):
            for process in list(self.processes.values()):
                try:
                    process.write(b"hb\n")
                except Exception:  # noqa: BLE001 - a lost channel: the host let the lease go itself
                    pass

    def _forget(self, name: str) -> None:
        with _held_lock:
            key = self.keys.pop(name, None)
            if key is not None and _held.get(key) is self:
                del _held[key]

    def release(self) -> None:
        """Let go of every lease: each host's hold process sees its stdin close and lets go."""
        self._stop.set()
        for name, process in list(self.processes.items()):
            try:
                process.close_stdin()
            except Exception:  # noqa: BLE001 - the channel may be gone already: so is the lease
                pass
        for name, process in list(self.processes.items()):
            try:
                process.wait(5.0)
            except Exception:  # noqa: BLE001
                pass
        self.processes.clear()
        for name in list(self.keys):
            self._forget(name)


@contextmanager
def hold(fleet: Fleet, hosts: Iterable[Host], command: str, run_id: str | None = None, *, skip: bool = False,
         on_took_over: Callable[[str, dict], None] = say_took_over, python: Callable[[Host], str | None] = lambda host: None) -> Iterator[Leases]:
    """Hold the hosts' leases for the block (see the module docstring); HostBusy before it if one is taken.
    skip: take none (a dry run changes nothing)."""
    leases = Leases(command, run_id)
    if not skip:
        leases.take(fleet, hosts, on_took_over, python=python)
    try:
        yield leases
    finally:
        leases.release()


def show(fleet: Fleet, hosts: Iterable[Host]) -> dict[str, dict]:
    """host -> {"held": bool, "holder": {...} or None, "path"} (or {"error"} for a host that did not answer)."""
    results = fleet.run(lambda h: pyrun.command(h, "show"), stdin=pyrun.payload(leasehost.source()), hosts=list(hosts), timeout=30)
    out = {}
    for result in results:
        data = pyrun.reply(result, "the lease script")
        out[result.host] = data if data is not None else {"error": result.error or result.status.value}
    return out
