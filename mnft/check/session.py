"""check's one command per host: the probe's `session` mode, one SSH session and one interpreter on each host for
the facts, the code hash and workdir marks, and the network test, its stdin and stdout a conversation:

    → the probe's payload, then {"run": the tree-hash payload, its arguments, its rules}    (one write)
    ← {"facts": …}            its clock read last: the skew is measured to this line, the SSH handshake outside it
    ← {"ran": …}              the tree hash's answer (the workdir's hash, the marks it saw), run in the probe's process
    → {"listen": …}  ← {"listen": …}      on the master, once every host's facts are in (its address) and the port
                                          is chosen (the next one on a refusal, with find_free_port)
    → {"connect": …} ← {"connect": …}     on every host, in waves of nettest.LISTEN_BACKLOG (the listener's queue)
    stdin closed: the listener stops, the probe ends

What each request says is planned from the facts, as before: the master's address and each host's source address
(mnft.check.rules), the port. Each host used to start an interpreter for each of these (facts with `site`, the tree
hash, a connect; the master a listener too): at 8 hosts on the test bed's 2 cores that was a third of check's time.
`check --image` keeps its own conversation (mnft.check.inimage) and the network test in commands of their own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from mnft.check.rules import probe_skew
from mnft.hosts import pyrun
from mnft.hosts.connection import (
    CommandTimeout,
    HostKeyRejected,
    OutputTooLarge,
    Process,
    SshConnection,
    Unreachable,
    bounded,
)
from mnft.hosts.fleet import Fleet, HostResult, Results, Status
from mnft.hosts.settings import Host

CLOSE_WAIT = 5.0  # seconds for every session to end once its stdin is closed (then it is ended)
ERROR_CHARS = 300  # a reason quoted from a host, at most

Run = tuple[str, Sequence[str], str]  # a host entry, its arguments and its stdin (mirror.code_request)


@dataclass
class Session:
    """One host's probe, between requests."""

    host: Host
    process: Process
    said: list[str] = field(default_factory=list)  # its stderr lines so far

    def ask(self, request: dict, key: str, timeout: float) -> tuple[dict | None, str | None]:
        """Send one request; the object under `key` of its answer, or None and why (one line)."""
        try:
            self.process.write(request_line(request))
        except Exception as exc:  # noqa: BLE001 - the channel is gone: this host's answer is missing
            return None, f"no answer from the host: {exc}".splitlines()[0]
        return self.ask_next(key, timeout)

    def ask_next(self, key: str, timeout: float) -> tuple[dict | None, str | None]:
        """The object under `key` of the next answer (to a request sent before), or None and why (one line)."""
        try:
            line, said = self.process.json_reply(timeout)
        except Exception as exc:  # noqa: BLE001 - the channel is gone: this host's answer is missing
            return None, f"no answer from the host: {exc}".splitlines()[0]
        self.said += said
        if line is None:
            last = f": {self.said[-1]}" if self.said else ""
            if self.process.stdout_ended:
                return None, f"no answer from the host: its probe ended{last}"
            return None, f"no answer from the host within {timeout:g}s"
        if not isinstance(line.get(key), dict):
            return None, "the probe answered " + _one_line(json.dumps(line.get("error") or line))
        return line[key], None

    def close(self) -> None:
        try:
            self.process.close_stdin()
        except Exception:  # noqa: BLE001 - the channel may be gone already: so is the probe
            pass


@dataclass
class Opened:
    """What the sessions' first exchange gave: each host's outcome, facts, clock skew and run (for those asked
    to run a script), and the sessions still open for the network test."""

    results: Results
    facts: dict[str, dict]
    skew: dict[str, float]
    ran: dict[str, HostResult]
    sessions: dict[str, Session]


def request_line(request: dict) -> bytes:
    return json.dumps(request).encode() + b"\n"


def session_command(host: Host, modules: Sequence[str] = ()):
    """The probe's session on the host's Python, with `site` (it finds the torch `import torch` would load), the
    probe's payload built on the controller once for every host (pyrun.payload)."""
    wanted = ("--modules", ",".join(modules)) if modules else ()
    return pyrun.command(host, "session", "--workdir", host.workdir, *wanted)


def run_request(entry: str, args: Sequence[str], stdin: str) -> dict:
    """A host entry for the session to run in its process (probe.run_script): its payload, arguments and stdin."""
    return {"run": pyrun.run_request(entry, args, stdin)}


def ran_result(name: str, ran: dict | None, why: str | None) -> HostResult:
    """Pure: a script's run in a session (the probe's run_script answer) as the HostResult its own round-trip
    would have given (read by mirror.parse_hash and sighting_of); failed, with why, when there is no answer."""
    if ran is None:
        return HostResult(name, Status.FAILED, error=why or "no answer")
    code = ran.get("exit_code")
    code = code if isinstance(code, int) and not isinstance(code, bool) else None
    stdout, stderr = str(ran.get("stdout") or ""), str(ran.get("stderr") or "")
    if code == 0:
        return HostResult(name, Status.OK, 0, stdout, stderr)
    error = _one_line(str(ran.get("error") or "")) or _one_line(stderr) or "no answer"
    return HostResult(name, Status.FAILED, code, stdout, stderr, f"exit code {code}: {error}" if code is not None else error)


def open_sessions(fleet: Fleet, hosts: Sequence[Host] | None, *, modules: Sequence[str] = (), run: Callable[[Host], Run | None] = lambda host: None,
                  run_timeout: float = 60.0, lifetime: float = 600.0) -> Opened:
    """Start the probe's session on every host, in parallel: its facts (with `modules`: which of them its Python
    resolves) and its clock skew vs this machine, then the script `run` gives for the host, if any (its answer
    within run_timeout). A host whose session ended or failed is not among the sessions; on the host the session
    ends by itself after `lifetime` seconds (coreutils timeout) should nobody close it."""
    timeout = fleet.timeouts.command
    facts: dict[str, dict] = {}
    skew: dict[str, float] = {}
    ran: dict[str, HostResult] = {}
    sessions: dict[str, Session] = {}

    def one(host: Host) -> HostResult:
        started = time.monotonic()
        payload = probe_payload()  # compiled by the first host's thread, while the others' handshakes go on
        script = run(host)
        begun = start(fleet, host, session_command(host, modules).render(), lifetime, started)
        if isinstance(begun, HostResult):
            return begun
        process, before = begun
        kept = False
        try:
            first = payload
            if script is not None:
                source, args, stdin = script
                first += request_line(run_request(source, args, stdin))
            process.write(first)
            line, said = process.json_reply(timeout)
            after = time.time()
            if line is None or not isinstance(line.get("facts"), dict):
                return no_reply(host.name, process, line, said, timeout, started)
            data = line["facts"]
            facts[host.name] = data
            if (seen := probe_skew(data, before, after)) is not None:
                skew[host.name] = seen
            session = Session(host, process, said)
            if script is not None:
                answer, why = session.ask_next("ran", run_timeout)
                ran[host.name] = ran_result(host.name, answer, why)
            if not process.stdout_ended:
                sessions[host.name] = session
                kept = True
            return HostResult(host.name, Status.OK, seconds=since(started))
        except (CommandTimeout, OutputTooLarge, Unreachable) as exc:
            return cut_short(fleet, host, exc, timeout, started)
        finally:
            if not kept:
                process.terminate()

    results = fleet.map(one, hosts)
    return Opened(results, {name: facts[name] for name in results.by_host if name in facts}, skew, ran, sessions)


def start(fleet: Fleet, host: Host, command: str, lifetime: float, started: float) -> tuple[Process, float] | HostResult:
    """The probe's command started on the host, and the time just before (where its clock skew's window begins):
    connected first, so that the SSH handshake is outside that window; ended on the host after `lifetime` seconds
    should nobody end it. A HostResult where it could not start."""
    try:
        conn = fleet.connection(host)
    except HostKeyRejected as exc:
        return HostResult(host.name, Status.HOST_KEY_REJECTED, error=str(exc))
    except Unreachable as exc:
        return HostResult(host.name, Status.UNREACHABLE, error=str(exc))
    before = time.time()
    try:
        return conn.start(bounded(command, lifetime) if isinstance(conn, SshConnection) else command), before
    except Unreachable as exc:
        fleet.mark_unreachable(host.name, str(exc))
        return HostResult(host.name, Status.UNREACHABLE, error=str(exc), seconds=since(started))


def cut_short(fleet: Fleet, host: Host, exc: CommandTimeout | OutputTooLarge | Unreachable, timeout: float, started: float) -> HostResult:
    """A probe's conversation that raised: it timed out, said too much, or its host is gone (marked so)."""
    if isinstance(exc, CommandTimeout):
        return HostResult(host.name, Status.FAILED, error=f"command timed out after {timeout:g}s", seconds=since(started))
    if isinstance(exc, OutputTooLarge):
        return HostResult(host.name, Status.FAILED, error=str(exc), seconds=since(started))
    fleet.mark_unreachable(host.name, str(exc))
    return HostResult(host.name, Status.UNREACHABLE, error=str(exc), seconds=since(started))


def close_sessions(sessions: dict[str, Session], wait: float = CLOSE_WAIT) -> None:
    """Close every session's stdin (its listener stops, its probe ends), then wait for each to end, at most `wait`
    seconds in all; one still running then is ended. The sessions are forgotten (closing again does nothing)."""
    for session in sessions.values():
        session.close()
    deadline = time.monotonic() + wait
    for session in sessions.values():
        try:
            session.process.wait(timeout=max(0.01, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - timed out, said too much, or its channel is gone: end it either way
            session.process.terminate()
    sessions.clear()


def probe_payload() -> bytes:
    return pyrun.payload("probe")


def no_reply(name: str, process: Process, first: dict | None, said: list[str], left: float, started: float) -> HostResult:
    """The host's command printed no facts: failed, with its exit code and last line (as pyrun.reply says it)."""
    process.close_stdin()
    code = None
    try:
        code = process.wait(timeout=min(5.0, left) or 0.001).exit_code
    except (CommandTimeout, OutputTooLarge):
        pass
    last = said[-1] if said else ""
    if first is not None:  # a JSON object, not the facts: the probe's own error report
        last = _one_line(json.dumps(first.get("errors") or first))
    if code not in (0, None):
        error = f"exit code {code}" + (f": {last}" if last else "")
    else:
        error = "the probe printed no JSON: " + (last or "no output")
    return HostResult(name, Status.FAILED, code, error=error, seconds=since(started))


def _one_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= ERROR_CHARS else last[:ERROR_CHARS] + "…"


def since(started: float) -> float:
    return round(time.monotonic() - started, 3)
