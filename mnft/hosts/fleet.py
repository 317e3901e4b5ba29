"""Fan-out: one command (or one per host) on every host in parallel, one outcome per host.

A `Fleet` opens verified connections to all hosts in parallel (connect timeout) and keeps them for the
following phases; every command has a timeout. Each host ends each phase as ok / failed (exit code and last
lines) / unreachable / host-key-rejected; a host that was unreachable stays so for the later phases, and one
host's failure never hides another's result.
"""

from __future__ import annotations

import errno
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Mapping

import fabric
import paramiko

from mnft.core.errors import ExitCode, InputError, MnftError
from mnft.core.threads import DaemonPool
from mnft.hosts.command import Command
from mnft.hosts.connection import (
    CommandTimeout,
    Connection,
    HostKeyRejected,
    OutputTooLarge,
    Process,
    Timeouts,
    Unreachable,
    fabric_connection,
    open_connection,
    ssh_target,
)
from mnft.hosts.hostkeys import known_hosts_files, load_trusted
from mnft.hosts.settings import Host, Inventory

TAIL_LINES = 8
TAIL_WIDTH = 1000  # characters of one line a message quotes


class Status(str, Enum):
    OK = "ok"
    FAILED = "failed"
    UNREACHABLE = "unreachable"
    HOST_KEY_REJECTED = "host-key-rejected"


@dataclass
class HostResult:
    host: str
    status: Status
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: str = ""  # one line: why it is not ok
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last lines the command printed (stderr, else stdout), each cut to TAIL_WIDTH characters: for a
        message (a host may print a line of megabytes)."""
        text = self.stderr.rstrip() or self.stdout.rstrip()
        start = len(text)
        for _ in range(lines):  # the last `lines` lines, found from the end (the output may be large)
            start = text.rfind("\n", 0, start)
            if start < 0:
                break
        head = start < 0 or text[: start + 1].isspace()  # the first line: stripped as the whole text would be
        kept = (text.lstrip() if head else text[start + 1 :]).splitlines()[-lines:]
        return "\n".join(line if len(line) <= TAIL_WIDTH else line[:TAIL_WIDTH] + "…" for line in kept)


@dataclass
class Results:
    """Outcomes of one phase, in inventory order."""

    by_host: dict[str, HostResult] = field(default_factory=dict)

    def __getitem__(self, name: str) -> HostResult:
        return self.by_host[name]

    def __iter__(self):
        return iter(self.by_host.values())

    def __len__(self) -> int:
        return len(self.by_host)

    def with_status(self, status: Status) -> list[HostResult]:
        return [r for r in self if r.status is status]

    def exit_code(self) -> ExitCode:
        if any(r.status in (Status.UNREACHABLE, Status.HOST_KEY_REJECTED) for r in self):
            return ExitCode.UNREACHABLE
        if any(r.status is Status.FAILED for r in self):
            return ExitCode.FAILED
        return ExitCode.OK


CommandFor = Command | Mapping[str, Command] | Callable[[Host], Command]



_NETWORK_ERRNOS = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTDOWN, errno.EPIPE}


def _network_fault(exc: BaseException) -> bool:
    """A lost or broken connection (the host is unreachable), as opposed to a local fault such as a missing file
    or a permission error on this machine, which is a failure with its traceback."""
    if isinstance(exc, (paramiko.SSHException, EOFError, ConnectionError, TimeoutError, socket.gaierror)):
        return True
    return isinstance(exc, OSError) and exc.errno in _NETWORK_ERRNOS

class Fleet:
    """Open connections to the inventory's hosts; run commands on all of them in parallel."""

    def __init__(self, inventory: Inventory, timeouts: Timeouts = Timeouts(), max_workers: int = 64) -> None:
        self.inventory = inventory
        self.timeouts = timeouts
        self.max_workers = max(1, min(max_workers, len(inventory.hosts)))
        self._trusted = load_trusted(known_hosts_files(inventory.known_hosts))  # unreadable: bad input, before any host
        self._config: fabric.Config | None = None
        if any(not h.is_local for h in inventory.hosts):
            distinct_targets(inventory, self._fabric_config(), timeouts)
        self._connections: dict[str, Connection] = {}
        self._broken: dict[str, HostResult] = {}  # hosts that could not be reached, kept for later phases
        # daemon threads: a host that hangs (accepts TCP, never speaks SSH) never holds up Ctrl-C (mnft.core.threads)
        self._pool = DaemonPool(max_workers=self.max_workers, thread_name_prefix="mnft-host")

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for conn in list(self._connections.values()):  # a worker may still be adding one (after an error)
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing must never mask the real outcome
                pass
        self._connections.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ connections

    def _fabric_config(self) -> fabric.Config:
        if self._config is None:  # read ~/.ssh/config once for all hosts
            self._config = fabric.Config()
        return self._config

    def connection(self, host: Host) -> Connection:
        """The host's open connection; raises Unreachable / HostKeyRejected (remembered for later phases)."""
        if host.name in self._broken:
            broken = self._broken[host.name]
            raise (HostKeyRejected if broken.status is Status.HOST_KEY_REJECTED else Unreachable)(broken.error)
        conn = self._connections.get(host.name)
        if conn is None:
            started = time.monotonic()
            try:
                conn = open_connection(host, self._trusted, self.timeouts, None if host.is_local else self._fabric_config())
            except HostKeyRejected as exc:
                self._broken[host.name] = HostResult(host.name, Status.HOST_KEY_REJECTED, error=str(exc), seconds=_since(started))
                raise
            except Unreachable as exc:
                self._broken[host.name] = HostResult(host.name, Status.UNREACHABLE, error=str(exc), seconds=_since(started))
                raise
            self._connections[host.name] = conn
        return conn

    def connect_all(self, hosts: Iterable[Host] | None = None) -> Results:
        def one(host: Host) -> HostResult:
            started = time.monotonic()
            try:
                self.connection(host)
            except (Unreachable, HostKeyRejected):
                return self._broken[host.name]
            return HostResult(host.name, Status.OK, seconds=_since(started))

        return self.map(one, hosts)

    def mark_unreachable(self, name: str, error: str) -> None:
        self._broken[name] = HostResult(name, Status.UNREACHABLE, error=error)
        conn = self._connections.pop(name, None)
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - a broken session may fail to close: it is unreachable either way
                pass

    # ------------------------------------------------------------------ running

    def map(self, fn: Callable[[Host], HostResult], hosts: Iterable[Host] | None = None) -> Results:
        """Apply fn to every host in parallel; results in inventory order. A host whose fn raised is that host's
        outcome (unreachable for an SSH/network fault, failed otherwise), never the end of the others'; only an
        expected error (MnftError: bad input) is raised, after every host is done."""
        chosen = list(self.inventory.hosts if hosts is None else hosts)
        started = time.monotonic()
        futures = {host.name: self._pool.submit(fn, host) for host in chosen}
        results: dict[str, HostResult] = {}
        expected: MnftError | None = None
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except MnftError as exc:
                expected = expected or exc
                results[name] = HostResult(name, Status.FAILED, error=str(exc), seconds=_since(started))
            except Exception as exc:  # noqa: BLE001 - one host's fault must not hide the others
                results[name] = self._fault(name, exc, started)
        if expected is not None:
            raise expected
        return Results(results)

    def _fault(self, name: str, exc: Exception, started: float) -> HostResult:
        """An exception nothing below turned into an outcome: a lost or broken SSH session makes the host
        unreachable; anything else is a bug in mnft, failed with its traceback on stderr."""
        if _network_fault(exc):
            error = f"SSH error: {exc.__class__.__name__}: {exc}".splitlines()[0]
            self.mark_unreachable(name, error)
            return HostResult(name, Status.UNREACHABLE, error=error, seconds=_since(started))
        traceback.print_exception(exc, file=sys.stderr)
        error = f"internal error (a bug in mnft): {exc.__class__.__name__}: {exc}".splitlines()[0]
        return HostResult(name, Status.FAILED, error=error, seconds=_since(started))

    def start(self, host: Host, command: Command) -> Process:
        return self.connection(host).start(command.render())

    def run_one(self, host: Host, command: Command, stdin: bytes | None = None, timeout: float | None = None) -> HostResult:
        started = time.monotonic()
        timeout = self.timeouts.command if timeout is None else timeout
        try:
            conn = self.connection(host)
        except (Unreachable, HostKeyRejected):
            return self._broken[host.name]
        except MnftError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a paramiko fault open_connection does not name
            result = self._fault(host.name, exc, started)
            if result.status is Status.UNREACHABLE:
                self._broken[host.name] = result
            return result
        try:
            done = conn.run(command.render(), stdin=stdin, timeout=timeout)
        except CommandTimeout as exc:
            return HostResult(host.name, Status.FAILED, error=f"command {exc}", seconds=_since(started))
        except OutputTooLarge as exc:  # a host that says too much: failed in one line, none of it believed
            return HostResult(host.name, Status.FAILED, error=str(exc), seconds=_since(started))
        except Unreachable as exc:
            self.mark_unreachable(host.name, str(exc))
            return HostResult(host.name, Status.UNREACHABLE, error=str(exc), seconds=_since(started))
        except MnftError:
            raise
        except Exception as exc:  # noqa: BLE001 - one host's SSH fault never hides the others
            return self._fault(host.name, exc, started)
        status = Status.OK if done.exit_code == 0 else Status.FAILED
        result = HostResult(host.name, status, done.exit_code, done.stdout, done.stderr, seconds=_since(started))
        if status is Status.FAILED:
            last = result.tail(1)
            result.error = f"exit code {done.exit_code}" + (f": {last}" if last else "")
        return result

    def run(
        self,
        command: CommandFor,
        *,
        stdin: bytes | Mapping[str, bytes] | None = None,
        timeout: float | None = None,
        hosts: Iterable[Host] | None = None,
    ) -> Results:
        """Run a command (the same, a mapping host -> command, or a function of the host) on every host."""

        def one(host: Host) -> HostResult:
            cmd = command if isinstance(command, Command) else command[host.name] if isinstance(command, Mapping) else command(host)
            data = stdin.get(host.name) if isinstance(stdin, Mapping) else stdin
            return self.run_one(host, cmd, data, timeout)

        return self.map(one, hosts)


def distinct_targets(inventory: Inventory, config: fabric.Config, timeouts: Timeouts) -> None:
    """Two names that ~/.ssh/config sends to the same user@machine:port would run two node_ranks' work on one
    machine (the inventory's own check sees only what the file says): bad input, refused before any host."""
    seen: dict[tuple[str, int, str], str] = {}
    for host in inventory.hosts:
        if host.is_local:
            continue
        target = ssh_target(fabric_connection(host, timeouts, config))
        if target in seen:
            hostname, port, user = target
            where = inventory.path or "<inventory>"
            raise InputError(f"{where}: host {host.name!r}: duplicate host: ~/.ssh/config sends it to {user}@{hostname}:{port} like {seen[target]!r}")
        seen[target] = host.name


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
