"""Collectives with the training stack: torch.distributed on every host running mnft.perf.allreduce, bounded.

A small launcher, kept apart so it can later go through the generic job plan (mnft.run.launch): `torchrun_argv` is
pure (host and cluster in, argument list out); `start_allreduce` ships the stdlib launcher (mnft.onhost.torchlaunch)
and the entry script over SSH stdin to every host with `--hold`: the ranks start and import torch (most of their
start-up) while the controller measures something else, then say they are ready and wait. `Pending.release` waits
until every host's ranks are ready, releases them all at once and collects one outcome per host plus the figures
rank 0 printed. A host whose ranks do not get ready (torch missing, Python failing, a crash) fails alone, named,
and nobody is released: the others' ranks would only wait for it at the rendezvous. Stdin stays open while the
ranks run; closing it (on the deadline, on a failure, or when this process dies) kills the host's process groups.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mnft.hosts import pyrun
from mnft.hosts.connection import CommandTimeout, Process, Unreachable
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host, Inventory

ENTRY = Path(__file__).with_name("allreduce.py")  # shipped, never imported here: it imports torch (seconds)
MARKER = "MNFT-PERF "  # the same as in allreduce.py (a test holds them equal)
READY = "MNFT-READY "


@dataclass
class CollectiveRun:
    outcomes: dict[str, HostResult] = field(default_factory=dict)
    figures: dict | None = None  # what rank 0 printed: world_size, backend, ranks, allreduce
    error: str | None = None  # why there are no figures
    sizes: list[int] = field(default_factory=list)
    budget: float = 0.0  # seconds after which the sweep stops (sizes not reached are dropped)
    elapsed: float = 0.0  # from the start (the ranks' imports overlap whatever the controller did meanwhile)
    launcher: str = "direct"
    not_started: dict[str, str] = field(default_factory=dict)  # host -> why its ranks did not get ready
    ready_wait: float | None = None  # seconds the controller waited for the ranks after it was done with the rest

    def dropped(self) -> list[int]:
        """The sizes asked for that the sweep did not reach (its time was spent)."""
        done = {r.get("bytes") for r in (self.figures or {}).get("allreduce") or []}
        return [size for size in self.sizes if size not in done] if self.figures else []


LAUNCHERS = ("torchrun", "direct")


def torchrun_argv(host: Host, inventory: Inventory, master_addr: str, port: int, entry_args: list[str], launcher: str = "torchrun") -> list[str]:
    """torchlaunch's arguments for one host: the launcher, torchrun's arguments (static rendezvous: node_rank =
    inventory order), `--`, the entry script's arguments (torchlaunch puts the shipped script between them)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: use one of {LAUNCHERS}")
    return [
        launcher,
        "--nnodes", str(len(inventory.hosts)),
        "--nproc-per-node", str(host.slots),
        "--node-rank", str(host.rank),
        "--master-addr", master_addr,
        "--master-port", str(port),
        "--max-restarts", "0",
        "--", *entry_args,
    ]


def host_env(iface: str | None) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if iface:
        env["NCCL_SOCKET_IFNAME"] = iface
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


def parse_figures(text: str) -> dict | None:
    for line in text.splitlines():
        if line.startswith(MARKER):
            try:
                data = json.loads(line[len(MARKER):])
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


GRACE = 3.0  # seconds the other hosts get to finish or fail on their own after one host failed


@dataclass
class Pending:
    """The allreduce job, started and held: `release()` runs it, `cancel()` stops it."""

    fleet: Fleet
    run: CollectiveRun
    processes: dict[str, Process]
    started: float
    timeout: float

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def cancel(self, why: str) -> CollectiveRun:
        """Stop every host's ranks (closing stdin kills their process groups); the run has no figures."""
        for name, process in self.processes.items():
            _close(process)
            self.run.outcomes.setdefault(name, HostResult(name, Status.FAILED, error=f"not run: {why}"))
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except Exception:  # noqa: BLE001 - the launcher also stops by itself when stdin closes
                pass
        self.run.error = self.run.error or why
        self.run.elapsed = time.monotonic() - self.started
        return self.run

    def release(self, progress: Callable[[str], None] | None = None, before_release: Callable[[], None] | None = None) -> CollectiveRun:
        """Wait until every host's ranks are ready (and `before_release` returned), release them all, wait for
        them to finish."""
        run = self.run
        if self.processes and progress:
            progress("collectives: waiting for torch to start on every host")
        ready_at = time.monotonic()
        for name, process in self.processes.items():
            why = _wait_ready(process, self.fleet.inventory.host(name).slots, self.deadline)
            if why is not None:
                run.not_started[name] = why
                run.outcomes[name] = HostResult(name, Status.FAILED, error=f"the torch worker did not start: {why}",
                                                seconds=round(time.monotonic() - self.started, 3))
        failed = run.not_started or {n: r.error for n, r in run.outcomes.items() if not r.ok}
        if failed:
            return self.cancel(f"the torch workers did not start on {', '.join(sorted(failed))}")
        run.ready_wait = round(time.monotonic() - ready_at, 3)
        if before_release:
            before_release()
        if progress:
            progress("collectives: compute, then all_reduce")
        for process in self.processes.values():
            process.write(b"go\n")
        self._finish()
        if run.figures is None:
            failed = [f"{r.host}: {r.error}" for r in run.outcomes.values() if not r.ok]
            run.error = "; ".join(failed) if failed else "rank 0 printed no figures"
        run.elapsed = time.monotonic() - self.started
        return run

    def _finish(self) -> None:
        """Every host's outcome; once one fails, the others get GRACE seconds, then they are stopped (they would
        wait for it until the collectives' timeout)."""
        run, names = self.run, {}
        with ThreadPoolExecutor(max_workers=max(1, len(self.processes)), thread_name_prefix="mnft-perf-wait") as pool:
            for name, process in self.processes.items():
                names[pool.submit(_wait_done, process, self.deadline, self.timeout)] = name
            pending, stop_at, first = set(names), self.deadline, None
            while pending:
                done, pending = wait(pending, timeout=max(0.0, stop_at - time.monotonic()), return_when=FIRST_COMPLETED)
                for future in done:
                    name = names[future]
                    result = future.result()
                    result.host, result.seconds = name, round(time.monotonic() - self.started, 3)
                    if first is not None and not result.ok and not result.error.startswith(TOO_LATE):
                        result.error = f"stopped after {first} failed ({result.error})"
                    run.outcomes[name] = result
                    if run.figures is None:
                        run.figures = parse_figures(result.stdout)
                    if not result.ok and first is None:
                        first, stop_at = name, min(self.deadline, time.monotonic() + GRACE)
                if pending and time.monotonic() >= stop_at:
                    for future in pending:
                        _close(self.processes[names[future]])
                    stop_at = self.deadline + 30  # the launchers end their groups within seconds of losing stdin
        for process in self.processes.values():
            _close(process)


def start_allreduce(fleet: Fleet, master_addr: str, port: int, ifaces: dict[str, str | None], sizes: list[int],
                    budget: float, compute: float, timeout: float, launcher: str = "direct", limit: float | None = None) -> Pending:
    """Start the job on every host, held before the rendezvous (see the module's docstring)."""
    inventory = fleet.inventory
    run = CollectiveRun(sizes=sizes, budget=max(budget, limit or 0.0), launcher=launcher)
    started = time.monotonic()
    entry_args = ["--sizes", ",".join(map(str, sizes)), "--budget", f"{budget:g}", "--compute", f"{compute:g}",
                  "--init-timeout", f"{max(10.0, timeout):g}", *(["--limit", f"{limit:g}"] if limit else [])]
    payload = pyrun.payload("torchlaunch") + pyrun.text(ENTRY.read_text())
    processes: dict[str, Process] = {}
    for host in inventory.hosts:
        argv = torchrun_argv(host, inventory, master_addr, port, entry_args, launcher)
        argv.insert(1, "--hold")
        command = pyrun.command(host, *argv, env=host_env(host.iface or ifaces.get(host.name)))
        try:
            processes[host.name] = fleet.start(host, command)
            processes[host.name].write(payload)
        except Exception as exc:  # noqa: BLE001 - this host fails; release() releases nobody
            run.outcomes[host.name] = HostResult(host.name, Status.FAILED, error=f"could not start the torch worker: {exc}")
            run.not_started[host.name] = f"could not start it: {exc}"
    return Pending(fleet, run, processes, started, timeout)


def _wait_ready(process: Process, ranks: int, deadline: float) -> str | None:
    """None when `ranks` ranks said they are ready; else why not (the launcher ended: its error; or the deadline)."""
    ready = 0
    while ready < ranks:
        item = process.readline(timeout=max(0.0, deadline - time.monotonic()))
        if item is None:
            _close(process)
            return f"{ready} of {ranks} ranks ready when the time ran out"
        stream, line = item
        if line is None:
            if stream == "stdout":  # the launcher ended before its ranks were ready
                try:
                    done = process.wait(timeout=10)
                except Exception as exc:  # noqa: BLE001
                    return f"the launcher ended ({exc})"
                return f"exit code {done.exit_code}: {_last_error(done.stderr or done.stdout)}"
            continue
        if stream == "stdout" and line.startswith(READY):
            ready += 1
    return None


TOO_LATE = "did not finish within"


def _wait_done(process: Process, deadline: float, timeout: float) -> HostResult:
    try:
        done = process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except CommandTimeout:
        return HostResult("", Status.FAILED, error=f"{TOO_LATE} {timeout:g}s")
    except Exception as exc:  # noqa: BLE001 - e.g. the connection dropped: this host's outcome, not the end
        return HostResult("", Status.UNREACHABLE if isinstance(exc, Unreachable) else Status.FAILED, error=f"{type(exc).__name__}: {exc}")
    result = HostResult("", Status.OK if done.exit_code == 0 else Status.FAILED, done.exit_code, done.stdout, done.stderr)
    if not result.ok:
        result.error = f"exited with {done.exit_code}: {_last_error(done.stderr or done.stdout)}"
    return result


def _close(process: Process) -> None:
    try:
        process.close_stdin()
    except Exception:  # noqa: BLE001
        pass


def _last_error(text: str) -> str:
    """The line that says what went wrong: the last exception line of a traceback, else the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line.split(":", 1)[0] or line.startswith(("RuntimeError", "torch.distributed")):
            return line[:300]
    return lines[-1][:300] if lines else "no output"
