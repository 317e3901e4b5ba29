"""Gang supervision: start every host's run in parallel and treat them as one.

Each host runs mnft.onhost.agent `launch` over its own SSH session: the agent starts torchrun under a keeper in a new
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

from mnft.core.errors import MnftError
from mnft.hosts import pyrun
from mnft.hosts.command import Command
from mnft.hosts.connection import HostKeyRejected, Process, Unreachable
from mnft.hosts.fleet import Fleet, Status
from mnft.run.launch import HostLaunch, LaunchOptions

LOST_AFTER = 10.0  # seconds without any event from an agent before its host counts as lost (while others are heard)
ALONE_AFTER = 30.0  # … when no host was heard either (the controller itself starved or cut off)
HEARTBEAT_EVERY = 2.0
START_TIMEOUT = 60.0
TAIL = 200  # output lines kept per host: enough for a rank's traceback
# torchrun --tee prefixes each worker line: with mnft's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE "[rank<global rank>]:"
# (the rank torch actually gave the worker: with --rdzv c10d it is not the inventory order), else torchrun's
# default "[default<local rank>]:" (older runs)
RANK_PREFIX = re.compile(r"^\[(rank|default)(\d+)\]:(.*)$", re.S)
# torchrun's tee prints a worker's unfinished stderr line (a progress bar's \r update) and then another worker
# line after it on the same line: "[rank0]: 60%|███ | 12/20[rank0]:{'loss': …}"
EMBEDDED_PREFIX = re.compile(r"\[(rank|default)(\d+)\]:")


# what a rank raises when a peer is gone rather than on its own: gloo and NCCL on a closed or reset connection, the
# TCPStore losing its server, the collective watchdog, a worker SIGTERMed by its own torchrun
COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited|NCCL communicator was aborted"
    r"|ncclRemoteError|DistNetworkError|failed to recv, got 0 bytes|Watchdog caught collective operation timeout"
    r"|Signal 15 \(SIGTERM\) received")
# torch's own log records (torchrun's agent): "E1127 06:07:24.063000 1529 …/api.py:1010] text"; a record of several
# lines (an exception it logged, its traceback) repeats the same prefix on every line
TORCH_RECORD = re.compile(r"^([EWIDC]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\s]+:\d+\] )")
# c10d's own warnings (C++): "[W1128 01:04:58.731546814 TCPStore.cpp:138] [c10d] text", then the exception's C++
# stack: "Exception raised from …", "frame #0: …", "<omitting python frames>", a blank line
CPP_RECORD = re.compile(r"^\[[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ [\w.]+\.(?:cpp|hpp|h):\d+\] ")
CPP_STACK = re.compile(r"^(Exception raised from |frame #\d+: |<omitting python frames>)")
# torchrun's teardown once this host's ranks have returned: its exit barrier (or the rendezvous' shutdown) meets the
# store the master's torchrun already closed, and c10d and torchrun each log it ("DistNetworkError: Failed to recv,
# got 0 bytes"); torchrun exits 0 (torch enters the exit barrier only on success). The same closed store mid-run is
# a master that went away: the run fails, and its cause is said from the master's side
TEARDOWN = re.compile(r"Error waiting on exit barrier|has failed to shutdown the rendezvous|\[c10d\] .*Failed to recv, got 0 bytes")
# c10d's warning on every run where a host's reverse lookup of a peer's address fails (getnameinfo: no PTR record, as on
# most labs and the test bed), from torchrun and from each rank: harmless, kept in the host's log, never shown
QUIET = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved")
SETTLE = 5.0  # seconds to wait for the root cause after a host failed as a victim of another
FINISH_GRACE = 60.0  # seconds the other hosts get to end on their own after one failed once its work was done


class GangError(MnftError):
    pass


class TeardownNoise:
    """torchrun's own records of its teardown (TEARDOWN) on one host, and the warnings printed on every run (QUIET): kept
    in the host's log and its tail, never shown as they come; `note` is the one line said instead. A record is its first line (a torchrun line, not a
    rank's, that TEARDOWN matches) and what belongs to it: the lines with the same prefix (torch's logger), the C++
    stack after a c10d warning, or the traceback after a line without either."""

    def __init__(self) -> None:
        self.hidden = 0
        self._said = False
        self._open: tuple[str, str] | None = None  # the record being hidden: ("prefix", its prefix) | ("cpp", "") | ("plain", "")

    def hides(self, rank: int | None, text: str) -> bool:
        if QUIET.search(text):  # noise on every run (torchrun's or a rank's): in the log, not on the terminal, not counted
            return True
        if rank is not None:  # a rank's line (they come between torchrun's): never torchrun's teardown
            return False
        if self._open is not None and self._continues(text):
            self.hidden += 1
            return True
        self._open = None
        if TEARDOWN.search(text):
            match = TORCH_RECORD.match(text)
            self._open = ("prefix", match.group(1)) if match else ("cpp", "") if CPP_RECORD.match(text) else ("plain", "")
            self.hidden += 1
            return True
        return False

    def _continues(self, text: str) -> bool:
        kind, prefix = self._open or ("", "")
        if kind == "prefix":
            return text.startswith(prefix)
        if kind == "cpp":
            if not text.strip():  # the blank line that ends c10d's C++ stack
                self._open = None
                return True
            return bool(CPP_STACK.match(text))
        if text.startswith("Traceback (most recent call last)") or text[:1].isspace():
            return True
        if re.match(r"[\w.]+(Error|Exception)\b", text):  # the exception's own line: the traceback's last
            self._open = None
            return True
        return False

    def note(self, log: str, exit_code: int | None) -> str | None:
        """The one line said for what was hidden, once, when the host's torchrun has ended (None: nothing was)."""
        if not self.hidden or self._said:
            return None
        self._said = True
        if exit_code == 0:
            return (f"torchrun's teardown after every rank here finished met the master's closed store: not a failure "
                    f"({self.hidden} line(s) kept in {log})")
        return f"torchrun found the master's store closed ({self.hidden} line(s) kept in {log})"


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
    ended_by: str | None = None  # why its keeper ended the run itself (its GPUs idle: --idle-stop, the lab's idle_stop)
    done_ranks: tuple[int, ...] = ()  # ranks whose entry point returned (mnft.onhost.entry's markers)
    stopping: bool = False  # mnft is stopping it (another host failed): its output is kept, not shown live
    noise: TeardownNoise = field(default_factory=TeardownNoise)  # torchrun's teardown: kept, not shown

    @property
    def done(self) -> bool:
        return self.state in ("exited", "stopped", "lost", "failed-to-start")

    @property
    def work_done(self) -> bool:
        """Every rank of this host returned from the job's entry point (whatever happened after, at exit)."""
        return len(set(self.done_ranks)) >= self.launch.slots


@dataclass
class GangResult:
    ok: bool
    failed_host: str | None
    reason: str
    hosts: dict[str, HostRun]
    first_step_at: float | None = None
    leftovers: dict[str, list[int]] = field(default_factory=dict)
    after_work: dict[str, str] = field(default_factory=dict)  # host -> its failure once every rank's work was done


STOP_BEYOND_GRACE = 35.0  # an agent's stop after its grace: the keeper's 5 s, the kill's settle 5 s, nvidia-smi 10 s, start-up


def agent_command(fleet: Fleet, host_name: str, *args: str) -> Command:
    return pyrun.command(fleet.inventory.host(host_name), *args, site=False)  # the agent is standard library only


def agent_payload() -> bytes:
    return pyrun.payload("agent")


def split_rank(text: str, rank_offset: int) -> tuple[int | None, str]:
    """A worker's output line -> (its global rank, the text without torchrun's prefix)."""
    match = RANK_PREFIX.match(text)
    if not match:
        return None, text
    number = int(match.group(2))
    return (number if match.group(1) == "rank" else rank_offset + number), match.group(3)


def split_ranks(text: str, rank_offset: int) -> list[tuple[int | None, str]]:
    """An output line -> each piece with the global rank of the worker that wrote it (several pieces when torchrun
    glued a worker's unfinished line and the next one together). torch prefixes a worker's uncaught traceback
    with "[rankN]: " itself, which torchrun's own prefix then precedes: "[rank1]:[rank1]:   File …" is one piece,
    "  File …"."""
    parts = EMBEDDED_PREFIX.split(text)
    out: list[tuple[int | None, str]] = [(None, parts[0])] if parts[0] or len(parts) == 1 else []
    nested = False
    for i in range(1, len(parts), 3):
        number = int(parts[i + 1])
        rank = number if parts[i] == "rank" else rank_offset + number
        piece = parts[i + 2]
        if nested and out and out[-1] == (rank, ""):
            out.pop()
            piece = piece[1:] if piece.startswith(" ") else piece
        out.append((rank, piece))
        nested = piece == ""
    return out


def failure_excerpt(tail: list[tuple[int | None, str]], limit: int = 40) -> tuple[int | None, list[str]]:
    """The rank that failed first on a host and its traceback, from the host's last output lines.

    torchrun's own summary names the root cause ("rank: 1 (local_rank: 1)" under "Root Cause"); else the last
    traceback on the host is taken. A root-cause rank that printed no traceback (argparse's `error: argument --lr:
    invalid float value: 'abc'`, a `sys.exit("…")`) gives its own last lines instead, up to its last error line
    (ERROR_LINE): the script's own words, never torchrun's summary. Returns (rank or None, the lines: at most
    `limit`, their end kept)."""
    rank = None
    for i, (_, text) in enumerate(tail):
        if "Root Cause" in text:
            for _, later in tail[i:i + 8]:
                match = re.search(r"\brank\s*:\s*(\d+)", later)
                if match:
                    rank = int(match.group(1))
                    break
    starts = [i for i, (r, text) in enumerate(tail) if text.lstrip().startswith("Traceback (most recent call last)")
              and (rank is None or r == rank)]
    if not starts:
        return rank, (_last_words([text for r, text in tail if r == rank], min(limit, 8)) if rank is not None else [])
    start = starts[-1]
    owner = tail[start][0]
    lines = [text for r, text in tail[start:] if r == owner]
    end = next((i + 1 for i, text in enumerate(lines) if i > 0 and text and not text.startswith((" ", "\t", "Traceback"))), len(lines))
    return (owner if rank is None else rank), lines[:end][-limit:]


# a line a script prints for its own error: argparse's `prog: error: …`, an exception's name, a logger's ERROR/FATAL
ERROR_LINE = re.compile(r"\berror\b|\w(Error|Exception)\b|\b(ERROR|FATAL|CRITICAL)\b|\bfailed\b", re.IGNORECASE)


def _last_words(lines: list[str], limit: int) -> list[str]:
    """A rank's last lines that say anything, ending at its last error line; none without one (a rank killed by a
    signal says nothing of it: its last step line is no cause)."""
    end = next((i for i in reversed(range(len(lines))) if ERROR_LINE.search(lines[i])), None)
    return [text for text in lines[:end + 1] if text.strip()][-limit:] if end is not None else []


def collateral(run: HostRun) -> bool:
    """Whether the host's run failed only because another's did (see COLLATERAL): judged on its failed rank's
    traceback, else on its last output lines."""
    if run.state != "exited":
        return False
    _, trace = failure_excerpt(list(run.tail))
    text = "\n".join(trace[-3:]) if trace else "\n".join(text for _, text in list(run.tail)[-30:])
    return bool(COLLATERAL.search(text))


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
        on_sample: Callable[[str, dict], None] = lambda host, sample: None,
        parse_metric: Callable[[str], dict | None] = lambda text: None,
        metrics_from_output: bool = False,
    ) -> None:
        self.fleet = fleet
        self.run_id = run_id
        self.options = options
        self.secrets = secrets
        self.after_work: dict[str, str] = {}
        self.runs = {l.host: HostRun(l) for l in launches}
        self.events: "queue.Queue[tuple[str, dict]]" = queue.Queue()
        self.on_line, self.on_metric, self.on_sample = on_line, on_metric, on_sample
        self.parse_metric = parse_metric  # the job's metrics format: a line of rank 0's output or metrics file -> a record
        self.metrics_from_output = metrics_from_output  # rank 0's output lines carry the metrics (no metrics file)
        self._stop_heartbeat = threading.Event()
        self.first_step_at: float | None = None
        self.stopped_by: str | None = None  # `mnft stop` is ending the run (a host's agent said so): its shutdown is not shown
        # host -> when its agent's stream last gave a line (set by its reader thread as the line arrives): a host
        # whose lines wait in the queue behind others' (a chatty master on a loaded controller) is not silent
        self.heard: dict[str, float] = {}

    # ---------------------------------------------------------------------------------------------- start

    def _start_one(self, name: str) -> HostRun:
        run = self.runs[name]
        host = self.fleet.inventory.host(name)
        try:
            process = self.fleet.start(host, agent_command(self.fleet, name, "launch"))
            process.keep = False  # its events are read as they come, for as long as the run lasts: none kept besides
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
                run.tail.append((None, line.rstrip("\n")))
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
        run.error = run.error or "the agent did not start: " + (" | ".join(text for _, text in run.tail) or "no output")
        return run

    def start(self) -> None:
        """Start every host in parallel; if any fails, stop the ones that started and raise. The heartbeat goes to
        each host as soon as its run has started: starting 64 hosts on a loaded machine took longer than an agent's
        dead-man time (15 s), and the first hosts started tore their runs down before the last one was up."""
        if not self.options.detach:
            threading.Thread(target=self._heartbeat, daemon=True).start()
        results = self.fleet.map(lambda host: _as_result(self._start_one(host.name)), [self.fleet.inventory.host(n) for n in self.runs])
        for r in results:  # an exception while starting (a broken SSH channel, a local error) is a failed start too
            if r.status is not Status.OK and self.runs[r.host].state != "failed-to-start":
                self.runs[r.host].state, self.runs[r.host].error = "failed-to-start", r.error or r.status.value
        failed = [self.runs[r.host] for r in results if self.runs[r.host].state == "failed-to-start"]
        if failed:
            self.teardown(f"{failed[0].launch.host} failed to start")
            names = ", ".join(f"{r.launch.host}: {r.error}" for r in failed)
            raise GangError(f"run {self.run_id} did not start on every host ({names}); the others were stopped")

    def _reader(self, name: str, process: Process) -> None:
        for stream, line in process.stream():
            self.heard[name] = time.monotonic()
            if stream == "stdout":
                self.events.put((name, _parse(line)))
            else:
                self.events.put((name, {"event": "stderr", "text": line.rstrip("\n")}))
        self.events.put((name, {"event": "eof", "overflow": process.overflow}))

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
            for rank, text in split_ranks(event.get("text", ""), run.launch.rank_offset):
                run.tail.append((rank, text))
                # a host mnft stops prints its own shutdown (SIGTERM tracebacks), torchrun its teardown: not a failure
                if not run.stopping and not run.noise.hides(rank, text):
                    self.on_line(name, rank, text)
                if self.metrics_from_output and rank == 0:
                    self._metric(self.parse_metric(text))
        elif kind == "stderr":
            run.tail.append((None, event["text"]))
            if not run.stopping and not run.noise.hides(None, event["text"]):
                self.on_line(name, None, event["text"])
        elif kind == "stopping":  # `mnft stop` from another shell marked the run before its signal: what follows is shutdown
            if self.stopped_by is None:
                self.stopped_by = str(event.get("by") or "mnft stop")
                for other in self.runs.values():  # every host's: a peer's ranks fail on this host's gone ones
                    other.stopping = True
                self.on_line(name, None, f"stopped by `{self.stopped_by}`: each host's shutdown is kept in its log "
                                         f"({run.launch.run_dir}/output.log on {name}), not shown")
        elif kind == "mline":
            self._metric(self.parse_metric(event.get("text", "")))
        elif kind == "sample":
            self.on_sample(name, {k: v for k, v in event.items() if k != "event"})
        elif kind == "exit":
            run.state, run.exit_code, run.ended_at = "exited", int(event.get("code", 1)), time.time()
            run.done_ranks = tuple(event.get("done") or ())
            run.ended_by = event.get("reason") or None
            if (said := run.noise.note(f"{run.launch.run_dir}/output.log on {name}", run.exit_code)) and not run.stopping:
                self.on_line(name, None, said)
            if run.ended_by:
                return f"{name}: {run.ended_by}"
            if run.exit_code != 0:
                why = f"{name}: torchrun exited with code {run.exit_code}"
                if run.work_done:  # it died after its work: let the others end on their own
                    self.after_work[name] = why
                    return None
                return why
        elif kind == "stopped":
            run.state, run.ended_at, run.stop_report = "stopped", time.time(), event
            run.done_ranks = tuple(event.get("done") or ())
            if not run.stopping:  # its agent stopped the run by itself (it lost the controller): the others cannot go on
                return f"{name}: its agent stopped the run ({event.get('reason') or 'no reason given'})"
        elif kind == "eof":
            if not run.done:
                if event.get("overflow"):  # the agent's stream could not be read whole: the host cannot be followed
                    self._lost(run, f"the host's agent {event['overflow']}")
                    return f"{name}: the host's agent {event['overflow']}"
                self._lost(run, "connection to the host's agent lost")
                return f"{name}: connection lost"
        return None

    def _metric(self, data: dict | None) -> None:
        if not data:
            return
        if "loss" in data and self.first_step_at is None:
            self.first_step_at = time.time()
        self.on_metric(data)

    def _lost(self, run: HostRun, why: str) -> None:
        """The host is gone: its own agent tears its run down (dead-man switch); later phases skip it."""
        run.state, run.error, run.ended_at = "lost", why, time.time()
        self.fleet.mark_unreachable(run.launch.host, why)

    def wait(self, tick: Callable[[], None] = lambda: None) -> GangResult:
        """Supervise until every host's run ended or one failed (then tear the gang down). tick: called about
        twice a second (the display's clock)."""
        reason = None
        failed = None
        finish_by = None
        try:
            while not all(r.done for r in self.runs.values()):
                if self.after_work and finish_by is None:
                    finish_by = time.monotonic() + FINISH_GRACE
                if finish_by is not None and time.monotonic() > finish_by:
                    failed = next(iter(self.after_work))
                    reason = self.after_work[failed] + f" after its work; the other hosts did not end within {FINISH_GRACE:g}s"
                    break
                try:
                    name, event = self.events.get(timeout=0.5)
                except queue.Empty:
                    name, event = None, None
                tick()
                if name is not None:
                    why = self._handle(name, event)
                    if why:
                        reason, failed = self._root_cause(name, why, tick)
                        break
                silent = self._silent(time.monotonic())
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
            if self.after_work:
                return GangResult(True, None, "every host finished its work", self.runs, self.first_step_at, after_work=dict(self.after_work))
            return GangResult(True, None, "every host finished", self.runs, self.first_step_at)
        leftovers = self.teardown(reason)
        return GangResult(False, failed, reason, self.runs, self.first_step_at, leftovers)

    def _silent(self, now: float) -> list[HostRun]:
        """The running hosts nothing came from for LOST_AFTER seconds while the others were heard. When nobody was
        (a controller too starved to read its 64 channels, its own network gone), a host counts as silent only
        after ALONE_AFTER: on a loaded 2-core test bed the controller read nothing for more than 10 s at a 64-host
        launch, and blamed whichever host it looked at first."""
        running = [r for r in self.runs.values() if r.state == "running"]
        heard = {r.launch.host: max(r.last_seen, self.heard.get(r.launch.host, 0.0)) for r in running}
        latest = max(heard.values(), default=now)
        return [r for r in running if now - heard[r.launch.host] > LOST_AFTER
                and (latest - heard[r.launch.host] > LOST_AFTER or now - heard[r.launch.host] > ALONE_AFTER)]

    def _root_cause(self, name: str, why: str, tick: Callable[[], None]) -> tuple[str, str]:
        """The host whose failure caused the others'. A rank that crashes closes its connections, and its peers'
        ranks then fail on them ("Connection closed by peer"): the victims' torchrun can exit before the crasher's.
        When the first failure is such a victim, wait up to SETTLE seconds for the host that failed on its own."""
        if not collateral(self.runs[name]):
            return why, name
        deadline = time.monotonic() + SETTLE
        while time.monotonic() < deadline and not all(r.done for r in self.runs.values()):
            try:
                other, event = self.events.get(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                tick()
                continue
            tick()
            other_why = self._handle(other, event)
            if other_why and not collateral(self.runs[other]):
                return other_why, other
        return why, name

    # ---------------------------------------------------------------------------------------------- teardown

    def teardown(self, reason: str) -> dict[str, list[int]]:
        """Stop every host's run that is still going, then sweep every reachable host by run id."""
        for run in self.runs.values():
            if run.state in ("running", "starting") and run.process is not None:
                run.stopping = True
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
            timeout=self.options.grace + STOP_BEYOND_GRACE,
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
    from mnft.hosts.fleet import HostResult, Status

    return HostResult(run.launch.host, Status.OK if run.state == "running" else Status.FAILED, error=run.error)
