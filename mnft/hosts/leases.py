"""What an operation holds on each host, the controller's side (the host's is mnft.onhost.leasehost; the model is
docs/lab.md): a run takes its devices (`Scope.gpus` of them, or every one) and its workdir, a sync the directory
it writes (`sync_scope`), setup (and a provision of an environment outside the user's home) the whole host (no
scope), which they get only while no run holds a device there; a provision of the user's own `~/…` environment
(`provision_scope`) takes only that directory, and waits only for that user's own runs, which use it; a run that finds its devices taken may wait in line for them (`Scope.wait`: a ticket on every host,
in each host's fair order, mnft.onhost.line; its place told through `on_wait`; refused at once, `line-full`, when
its user has the lab's max_waiting runs waiting there already).

train, sync, provision and setup take their leases on every host they will change before they change anything,
and keep them to their end: on each host a `hold` process, started on the fleet's open connection, holds the host's
lease file for as long as its channel lives, and this controller writes it a heartbeat. The lease is the
machine's, not the login's: two users of one host (or two controllers) are kept apart. One busy host refuses the
whole operation with one line naming the host and its holder (`HostBusy`, exit 1: the host is not wrong, it is
taken; the same command succeeds once the holder is done), before anything changed on any host; the leases taken
so far are let go. A lease file mnft must not use (a link or anything planted there, another user's file it may
not open) refuses the operation the same way, naming the file, its owner and what to do. A lease whose holder is
gone (nobody holds its lock: its controller's channel closed or went silent, its run ended) is taken over, and
that is said once. A host that cannot be reached, or whose lease script fails otherwise, is left to the
operation, which reports it. Takes nested in one controller process (train's own sync) are no-ops.

What a lease file names is written by whoever took it last: any user of the host may write it, so it is shown
cut and without control characters, never interpreted.
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
from typing import Any, Callable, Iterable, Iterator, Sequence

from mnft.core.errors import MnftError
from mnft.hosts import pyrun
from mnft.hosts.connection import HostKeyRejected, Process, Unreachable
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host
from mnft.onhost.leases import progress_numbers

HEARTBEAT_EVERY = 10.0
DEADMAN = 25.0  # seconds without a heartbeat (one every 10 s) before a host lets the lease go (a controller gone without a FIN)
REPLY_TIMEOUT = 60.0


def script() -> bytes:
    """The lease entry's payload (pyrun.payload): built once on this controller for every host and look."""
    return pyrun.payload("leasehost")


class HostBusy(MnftError):
    """Another operation holds a host's lease: nothing was changed on any host."""


def _since(started) -> str:
    if not isinstance(started, (int, float)) or isinstance(started, bool) or not 0 < started < 1e11:
        return "?"
    when = time.localtime(started)
    return time.strftime("%H:%M" if time.strftime("%Y-%m-%d", when) == time.strftime("%Y-%m-%d") else "%Y-%m-%d %H:%M", when)


def shown(value, limit: int = 64) -> str | None:
    """A value from a lease file as it may be printed: text or a number, control characters as '?', cut to limit."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = "".join(c if c.isprintable() else "?" for c in str(value)[:limit])
    return text or None


def holder_login(holder: dict | None) -> str | None:
    """The login user on the host that took the lease (None: not named)."""
    return shown((holder or {}).get("login"))


def describe(holder: dict | None) -> str:
    """"train run R by alice@ctl pid 123 since 10:02"; "… by lab (alice@ctl) …" when the host login differs from the
    controller's user (what a lease file names)."""
    if not isinstance(holder, dict) or not holder:
        return "another mnft (its lease names no holder)"
    what = shown(holder.get("command"), 20) or "an operation"
    run_id = shown(holder.get("run_id"))
    if run_id:
        what += f" run {run_id}"
    user, login = shown(holder.get("user")), holder_login(holder)
    who = f"{user or '?'}@{shown(holder.get('controller')) or '?'}"
    if login and login != user:
        who = f"{login} ({who})"
    pid = holder.get("pid")
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else "?"
    return f"{what} by {who} pid {pid} since {_since(holder.get('started'))}"


def busy_line(host: str, holder: dict | None, run_processes: int = 0, same_login: bool = True) -> str:
    """"h1 is busy: train run R by u@ctl pid 123 since 10:02 (mnft stop R, or wait)"; another login's holder:
    "… (wait, or ask alice; `mnft status R` on ctl shows it)"."""
    holder = holder if isinstance(holder, dict) else None
    run_id = shown((holder or {}).get("run_id"))
    login = holder_login(holder)
    if not same_login and login:
        hint = f"wait, or ask {login}"
        if run_id:
            hint += f"; `mnft status {run_id}` on {shown(holder.get('controller')) or 'their controller'} shows it"
    else:
        hint = f"mnft stop {run_id}, or wait" if run_id else "wait for it to end"
    if run_processes and not (holder or {}).get("command"):
        hint = f"{run_processes} process(es) of its run are alive; " + hint
    return f"{host} is busy: {describe(holder)} ({hint})"


def device_label(device: dict) -> str:
    from mnft.onhost.health import device_label as label

    return label(device)


def join_labels(labels: Sequence[str]) -> str:
    """["GPU 0", "GPU 1", "workdir /x"] -> "GPU 0, 1, workdir /x"."""
    gpus = [label[4:] for label in labels if label.startswith("GPU ")]
    rest = [label for label in labels if not label.startswith("GPU ")]
    return ", ".join(([f"GPU {', '.join(gpus)}"] if gpus else []) + rest)


def verified(holder: dict | None, lockers: Sequence[str] | None) -> str:
    """" (its lock held by bob pid 42)" when /proc/locks names someone else than the login the file claims: the
    kernel's record of the lock's holder is what no user can forge."""
    users = sorted({str(w).split(" pid ")[0] for w in lockers or ()})
    login = holder_login(holder)
    if users and login not in users:
        return f" (its lock is held by {', '.join(shown(w) or '?' for w in (lockers or ())[:3])})"
    return ""


def grouped(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """(label, what) pairs as one line per what, its labels joined: "GPU 0, 1, workdir /x: train run R by …"."""
    groups: dict[str, list[str]] = {}
    for label, text in pairs:
        groups.setdefault(text, []).append(label)
    return [f"{join_labels(labels)}: {text}" for text, labels in groups.items()]


def holders_of(devices: Sequence[dict]) -> list[str]:
    """"GPU 0, 1: train run R by alice@ctl pid 5 since 10:02" per holder, "GPU 2: in use outside mnft (pid 77 of
    carol)" per device used by a process no lease accounts for."""
    pairs = []
    for d in devices:
        if d.get("state") == "held":
            pairs.append((device_label(d), describe(d.get("holder")) + verified(d.get("holder"), d.get("lockers"))))
        elif d.get("state") == "outside":
            procs = ", ".join(f"pid {shown(p.get('pid'))} of {shown(p.get('user')) or '?'}" for p in (d.get("processes") or [])[:4])
            pairs.append((device_label(d), f"in use outside mnft ({procs})"))
        elif d.get("state") == "drained":
            pairs.append((device_label(d), drained_words(d.get("drain"))))
        elif d.get("state") == "unhealthy":
            pairs.append((device_label(d), f"unhealthy: {shown(d.get('broken'), 300)}"))
    return grouped(pairs)


def drained_words(mark: dict | None) -> str:
    """"drained by ops on h1 at 10:02: fan noise" (the host drained: "the host drained by …")."""
    mark = mark if isinstance(mark, dict) else {}
    when = mark.get("at")
    at = time.strftime("%Y-%m-%d %H:%M", time.localtime(when)) if isinstance(when, (int, float)) and not isinstance(when, bool) else "?"
    whole = "the host " if mark.get("scope") == "host" else ""
    by = shown(mark.get("by"), 80)
    return f"{whole}drained by {shown(mark.get('login')) or '?'}{f' ({by})' if by else ''} at {at}: {shown(mark.get('reason'), 300) or 'no reason given'}"


def directory_label(path: Any) -> str:
    """"job directory ~/mnft/outputs/J" for a run's job directory (mnft.sync.snapshot.job_dir), else "workdir /x"."""
    return ("job directory " if "/outputs/" in str(path or "") else "workdir ") + str(shown(path, 200))


def scope_busy_line(host: str, reply: dict) -> str:
    """Why a run (or a sync) cannot have what it asked of a host: its devices, its workdir, the whole host."""
    what = reply.get("what")
    if what == "host":  # setup or provision changes the whole host now
        return busy_line(host, reply.get("holder"), 0, reply.get("same_login", True))
    if what == "workdir":
        holder = reply.get("holder")
        run_id = shown((holder or {}).get("run_id"))
        if "/outputs/" in str(reply.get("workdir") or ""):  # a job's working directory: the same job twice at once
            hint = f"mnft stop {run_id}, or wait for it" if run_id else "wait for it to end"
            return (f"{host}: the job's working directory {shown(reply.get('workdir'), 200)} is in use by {describe(holder)}"
                    f"{verified(holder, reply.get('lockers'))}: one job runs once at a time, as both runs would write its files "
                    f"(a --resume of a job still running?) ({hint}; a new run without --resume gets a directory of its own)")
        hint = f"mnft stop {run_id}, or wait" if run_id else "wait"
        return f"{host}: workdir {shown(reply.get('workdir'), 200)} is busy: {describe(holder)}{verified(holder, reply.get('lockers'))} ({hint})"
    if what == "unavailable":  # drained or unhealthy devices: waiting would not help
        devices, want = reply.get("devices") or [], reply.get("want")
        usable = sum(1 for d in devices if d.get("state") not in ("drained", "unhealthy"))
        asked = "every device of the host (no --gpus)" if want is None else f"{want} GPU(s)"
        out = [d for d in devices if d.get("state") in ("drained", "unhealthy")]
        return (f"{host}: {asked} asked, {usable} of {len(devices)} in service: {'; '.join(holders_of(out))} "
                f"(never leased, waiting would not help: --gpus {usable} or fewer, or other hosts; `mnft lab` shows the lab)")
    if what == "own-runs":  # a provision of this user's environment, under this user's own run
        pairs = [(device_label(h["device"]) if isinstance(h.get("device"), dict) else directory_label(h.get("workdir")),
                  describe(h) + verified(h, h.get("lockers"))) for h in reply.get("held") or []]
        return (f"{host}: your environment {shown(reply.get('workdir'), 200)} is not changed under your own run: {'; '.join(grouped(pairs))} "
                f"(it runs from that environment: wait for it to end, or mnft stop it)")
    if what == "line-full":  # the lab's max_waiting: this user's runs already waiting here
        return (f"{host}: you have {reply.get('waiting')} run(s) waiting in line here, and the lab allows each user at most "
                f"{reply.get('max_waiting')} (max_waiting in {shown(reply.get('path'), 200) or 'the lab policy'}): wait for one of "
                f"your waiting runs to start, or stop one (`mnft lab` shows the line)")
    if what == "no-gpus":
        return f"{host} has no GPUs (no nvidia-smi) for --gpus {reply.get('want')}: leave --gpus out (its CPUs are one device) or use GPU hosts"
    if what == "runs":  # grouped by holder: "GPU 0, 1, workdir /home/a/mnft: train run R by alice …"
        pairs = []
        for h in reply.get("held") or []:
            device = h.get("device") if isinstance(h.get("device"), dict) else None
            pairs.append((device_label(device) if device else directory_label(h.get("workdir")), describe(h) + verified(h, h.get("lockers"))))
        parts = grouped(pairs)
        return f"{host} is busy: {'; '.join(parts)}: the whole host is not changed under a run (wait for it to end, or ask its user)"
    devices, want = reply.get("devices") or [], reply.get("want")
    free = sum(1 for d in devices if d.get("state") == "free")
    asked = "every device of the host (no --gpus)" if want is None else f"{want} GPU(s)"
    why = "; ".join(holders_of(devices))
    ahead = [describe(h) for h in reply.get("ahead") or []]
    line = f"{host}: {asked} asked, {free} of {len(devices)} free" + (f": {why}" if why else "")
    if ahead:
        line += f"; {len(ahead)} run(s) wait in line before this one: {'; '.join(ahead[:3])}"
    return line + " (--wait to wait in line; `mnft lab` shows the lab)"


@dataclass(frozen=True)
class Scope:
    """What a run or a sync takes on each host instead of the whole host: `gpus` devices (None: every one, as a run
    without --gpus; 0: none, as a sync) and a directory of the host's. `wait`: seconds to wait in line for them
    (None: do not wait; inf: as long as it takes)."""

    gpus: int | None = None
    directory: str | None = "workdir"  # the host setting naming the directory it takes: workdir, data_dir (sync --data), venv
    wait: float | None = None
    below: str = ""  # a directory below it instead (a run: its job's working directory, outputs/<job>)
    own: bool = False  # the directory is what this login's own runs use (its environment): none of them may run meanwhile

    def on(self, host: Host) -> dict:
        if not self.directory:
            return {"gpus": self.gpus, "workdir": None}
        base = getattr(host, self.directory)
        found = {"gpus": self.gpus, "workdir": base.rstrip("/") + "/" + self.below if self.below else base}
        return dict(found, own=True) if self.own else found


def in_own_home(path: str | None) -> bool:
    """Whether a host path is written in its login's home (`~/…`): a change there is that user's alone."""
    return bool(path) and (path == "~" or path.startswith("~/"))


def provision_scope(host: Host) -> Scope | None:
    """What a provision takes on a host: an environment in the user's own home (venv `~/…`, the default) changes
    nothing of anyone else's, so it takes only that directory, and waits for none of the others' runs (but for this
    user's own, which run from it); an environment elsewhere (a lab's shared /opt/env) changes the whole host: None,
    the host's lease, never taken under a run."""
    return Scope(gpus=0, directory="venv", own=True) if in_own_home(host.venv) else None


def sync_scope(kind: str) -> Scope:
    """A sync takes no device, only the directory it writes: one user's sync never waits for another user's run."""
    return Scope(gpus=0, directory="workdir" if kind == "code" else "data_dir")


def host_key(host: Host) -> tuple:
    """One lease per machine: what two inventory names (or two logins) for the same machine share."""
    return ("local",) if host.is_local else (host.address, host.port)


def say_took_over(host: str, previous: dict) -> None:
    """The default word on a lease taken over: once, on stderr."""
    from mnft.core.output import console, plain

    console(stderr=True).print(plain(took_over_line(host, previous), "yellow"))


def took_over_line(host: str, previous: dict) -> str:
    """A detached run's keeper holds its lease to the run's end without marking it released, so a run's lease
    nobody holds any more is one whose run ended, or whose controller and processes are gone."""
    why = "nobody holds it any more: the run ended, or its controller is gone" if isinstance(previous, dict) and shown(previous.get("run_id")) \
        else "its holder is gone"
    return f"{host}: took over the lease of {describe(previous)}: {why}"


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
    scope: Scope | None = None  # None: the whole host (setup, provision)
    per_host: Callable[[Host], Scope | None] | None = None  # a scope decided host by host instead (provision_scope)
    op: str = field(default_factory=lambda: secrets.token_hex(8))
    processes: dict[str, Process] = field(default_factory=dict)
    keys: dict[str, tuple] = field(default_factory=dict)
    took_over: dict[str, dict] = field(default_factory=dict)
    devices: dict[str, list[dict]] = field(default_factory=dict)  # host -> the devices taken there (scoped)
    paths: dict[str, list[str]] = field(default_factory=dict)  # host -> the lease files held there
    on_wait: Callable[[str, dict], None] | None = None  # a waiting host's place in line, each time it changes
    image: str | None = None  # the run's container image, shown by `mnft lab`
    shows: str | None = None  # an interactive session's command (`mnft shell -- CMD`), shown by `mnft lab`
    supervised: bool = False  # held by a detached run's supervisor on the lab (mnft.run.supervised), shown by `mnft lab`
    _stop: threading.Event = field(default_factory=threading.Event)
    _beat: threading.Thread | None = None
    _writing: threading.Lock = field(default_factory=threading.Lock)  # a heartbeat never cuts into a run request
    _running: dict[str, threading.Lock] = field(default_factory=dict)  # host -> held while a run is asked and answered
    _give_up: threading.Event = field(default_factory=threading.Event)  # a host refused outright: nobody waits on
    _progress: dict | None = None  # the run's last step, told to its hosts with the next heartbeat (progress())
    _told: dict | None = None

    def holder(self) -> dict:
        holder = {"op": self.op, "command": self.command, "run_id": self.run_id, "user": getpass.getuser(), "controller": socket.gethostname(),
                  "pid": os.getpid(), "started": time.time(), "deadman": DEADMAN}
        if self.image:
            holder["image"] = self.image
        if self.shows:
            holder["session"] = self.shows
        if self.supervised:
            holder["supervised"] = True
        if self.scope is not None and self.scope.wait is not None:  # one place in every host's line: the same ticket
            holder.update(wait=True, queued=time.time(), ticket=secrets.token_hex(8), want=self.scope.gpus)
        return holder

    def holder_on(self, holder: dict, host: Host) -> dict:
        scope = self.per_host(host) if self.per_host is not None else self.scope
        return holder if scope is None else dict(holder, scope=scope.on(host))

    def take(self, fleet: Fleet, hosts: Iterable[Host], on_took_over: Callable[[str, dict], None] = say_took_over,
             on_problem: Callable[[str, str], None] = say_problem, python: Callable[[Host], str | None] = lambda host: None) -> None:
        """Take every host's lease (hosts this process already holds are skipped); raise HostBusy naming the first
        busy host (and how many more) after letting go of the ones taken, or the first whose lease file mnft will not
        use. A host whose lease script failed otherwise (its lease directory not writable, say) is named through
        on_problem and left to the operation. python: the interpreter
        to run the host's side with (default the host's; provision gives its base Python)."""
        hosts = list(hosts)
        holder = self.holder()
        if holder.get("ticket"):  # how many hosts the run waits for: a run over several is first come, first served
            holder["hosts"] = len({host_key(h) for h in hosts})  # in every host's line (mnft.onhost.line)
        todo = []
        with _held_lock:
            for host in hosts:
                key = host_key(host)
                if key not in _held and key not in self.keys.values():
                    todo.append(host)
                    _held[key] = self
                    self.keys[host.name] = key
        self._give_up = threading.Event()
        if self.scope is not None and self.scope.wait is not None:
            self._start_heartbeat()  # waiting hosts are kept alive while they wait
        try:
            results = fleet.map(lambda h: self._take_one(fleet, h, self.holder_on(holder, h), python(h)), todo)
        except BaseException:  # an interrupt, bad input: nothing of this take is kept
            self.release()
            raise
        replies = {r.host: json.loads(r.stdout) if r.ok else {} for r in results}
        refusals = []
        for r in results:
            reply = replies[r.host]
            if reply.get("busy") and reply.get("what"):
                waited = f"still waiting after {self.scope.wait:g}s: " if self.scope and self.scope.wait and reply.get("waited") else ""
                refusals.append((r.host, waited + scope_busy_line(r.host, reply)))
            elif reply.get("busy"):
                refusals.append((r.host, busy_line(r.host, reply.get("holder"), reply.get("run_processes") or 0, reply.get("same_login", True))))
            elif reply.get("refused"):  # a lease file mnft will not use: the host is not to be changed either
                refusals.append((r.host, f"{r.host}: no lease can be taken: {shown(reply['refused'], 1000)}"))
            if not reply.get("taken"):
                self._forget(r.host)  # not held there: unreachable or failed hosts are the operation's to report
        if refusals:
            self.release()
            name, line = refusals[0]
            more = f" (and {len(refusals) - 1} more host(s): {', '.join(n for n, _ in refusals[1:])})" if len(refusals) > 1 else ""
            raise HostBusy(line + more + "; nothing was changed on any host")
        for r in results:
            if r.status is Status.FAILED or replies[r.host].get("error"):
                on_problem(r.host, r.error or replies[r.host]["error"])
            if replies[r.host].get("taken"):
                self.devices[r.host] = [d for d in replies[r.host].get("devices") or [] if isinstance(d, dict)]
                self.paths[r.host] = [p for p in replies[r.host].get("paths") or [] if isinstance(p, str)]
            previous = replies[r.host].get("took_over")
            if previous:
                self.took_over[r.host] = previous
                on_took_over(r.host, previous)
        if self.processes:
            self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="mnft-lease-heartbeat")
            self._beat.start()

    def _take_one(self, fleet: Fleet, host: Host, holder: dict, python: str | None = None) -> HostResult:
        try:
            process = fleet.start(host, pyrun.command(host, "hold", python=python, site=False))
            process.write(script() + json.dumps(holder).encode() + b"\n")
        except (Unreachable, HostKeyRejected) as exc:
            return HostResult(host.name, Status.UNREACHABLE, error=str(exc))
        waiting = self.scope is not None and self.scope.wait is not None
        if waiting:
            self.processes[host.name] = process  # heartbeats while it waits
        reply, said = process.json_reply(REPLY_TIMEOUT)
        if waiting:
            reply = self._wait(host.name, process, reply)
        if reply is not None:
            if reply.get("taken") and not reply.get("paths"):  # nothing to hold (a session of --gpus 0): the hold has ended,
                self.processes.pop(host.name, None)          # so no run is asked of it (run_held: a round-trip of its own)
                process.close_stdin()
            elif reply.get("taken"):
                self.processes[host.name] = process
            else:
                self.processes.pop(host.name, None)
                process.close_stdin()
                if not reply.get("waited"):
                    self._give_up.set()  # refused outright: the other hosts stop waiting
                if waiting:  # its ticket goes with its hold process: gone when the refusal is told
                    try:
                        process.wait(5.0)
                    except Exception:  # noqa: BLE001 - a host that does not end its hold: its ticket holds no place once it does
                        pass
            return HostResult(host.name, Status.OK, stdout=json.dumps(reply))
        self.processes.pop(host.name, None)
        process.close_stdin()
        return HostResult(host.name, Status.FAILED, error="the lease script gave no answer" + (f": {said[-1]}" if said else ""))

    def _wait(self, host: str, process: Process, reply: dict | None) -> dict | None:
        """Follow a host's place in line until its devices are taken, the wait's time is up, or another host was
        refused outright (then the last word on this host, marked "waited", is the refusal)."""
        deadline = time.monotonic() + (self.scope.wait if self.scope and self.scope.wait is not None else 0)
        last = None
        while reply is not None and reply.get("waiting") is True and not reply.get("busy"):  # a line-full refusal counts its "waiting" runs
            last = reply
            if self.on_wait is not None:
                self.on_wait(host, reply)
            while True:
                if self._give_up.is_set() or time.monotonic() > deadline:
                    return dict(last, busy=True, waiting=False, waited=True, devices=last.get("devices"))
                got, _ = process.json_reply(1.0)
                if got is not None:
                    reply = got
                    break
                if process.stdout_ended:
                    return None
        return reply

    def progress(self, metric: dict) -> None:
        """The run's last step (its step and loss, nothing else): each host writes it into its lease with the next
        heartbeat, so the lab's other members see how far the run is (mnft lab --json, the board)."""
        seen = progress_numbers({"step": metric.get("step"), "loss": metric.get("loss"), "at": round(time.time(), 1)})
        if seen is not None:
            self._progress = seen

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY):
            told, beat = self._progress, b"hb\n"
            if told is not None and told is not self._told:
                beat = b"progress " + json.dumps(told).encode() + b"\n"
            for process in list(self.processes.values()):
                try:
                    with self._writing:
                        process.write(beat)
                except Exception:  # noqa: BLE001 - a lost channel: the host let the lease go itself
                    pass
            self._told = told

    def run(self, host: str, entry: str, args: Sequence[str], stdin: str = "", timeout: float = REPLY_TIMEOUT) -> HostResult | None:
        """Run a host entry (mnft.onhost.<entry>'s main(args), its stdin the text given) in
        the host's hold process, forked: no new SSH session nor interpreter on the host. None when this lease is
        not held there (the caller makes its own round-trip). One run per host at a time."""
        process = self.processes.get(host)
        if process is None:
            return None
        request = json.dumps(pyrun.run_request(entry, args, stdin)).encode()
        started = time.monotonic()
        with self._running.setdefault(host, threading.Lock()):
            try:
                with self._writing:
                    process.write(b"run %d\n" % len(request) + request)
            except Exception as exc:  # noqa: BLE001 - the channel is gone: so is the lease there
                return HostResult(host, Status.FAILED, error=f"the lease holder is gone: {exc}")
            reply, said = process.json_reply(timeout)
        if reply is None:
            return HostResult(host, Status.FAILED, error=f"the lease holder gave no answer within {timeout:g}s", stderr="\n".join(said))
        code = reply.get("ran", 1)
        code = code if isinstance(code, int) and not isinstance(code, bool) else 1  # a hostile reply: a failed run, never a traceback
        error = reply.get("error") or ("" if code == 0 else f"exit status {code}")
        return HostResult(host, Status.OK if code == 0 else Status.FAILED, code, str(reply.get("out") or ""), "\n".join(said), error,
                          round(time.monotonic() - started, 3))

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


def run_held(host: Host, entry: str, args: Sequence[str], stdin: str = "", timeout: float = REPLY_TIMEOUT) -> HostResult | None:
    """Leases.run in whichever of this controller's leases holds the host (a nested operation's too), or None."""
    with _held_lock:
        holder = _held.get(host_key(host))
    return holder.run(host.name, entry, args, stdin, timeout) if holder is not None else None


@contextmanager
def hold(fleet: Fleet, hosts: Iterable[Host], command: str, run_id: str | None = None, *, skip: bool = False,
         on_took_over: Callable[[str, dict], None] = say_took_over, python: Callable[[Host], str | None] = lambda host: None,
         scope: Scope | None = None, per_host: Callable[[Host], Scope | None] | None = None) -> Iterator[Leases]:
    """Hold the hosts' leases for the block (see the module docstring); HostBusy before it if one is taken.
    skip: take none (a dry run changes nothing). scope: devices and the workdir instead of the whole host; per_host:
    that decided for each host (None there: the whole host)."""
    leases = Leases(command, run_id, scope, per_host=per_host)
    if not skip:
        leases.take(fleet, hosts, on_took_over, python=python)
    try:
        yield leases
    finally:
        leases.release()


def show(fleet: Fleet, hosts: Iterable[Host]) -> dict[str, dict]:
    """host -> {"held": bool, "holder": {...} or None, "path"} (or {"error"} / {"refused"} for a host that did not
    answer or whose lease file mnft will not use)."""
    results = fleet.run(lambda h: pyrun.command(h, "show", site=False), stdin=script(), hosts=list(hosts), timeout=30)
    out = {}
    for result in results:
        data = pyrun.reply(result, "the lease script")
        out[result.host] = data if data is not None else {"error": result.error or result.status.value}
    return out


def lab(fleet: Fleet, hosts: Iterable[Host], timeout: float = 30) -> dict[str, dict]:
    """host -> what its lease directory and nvidia-smi say now (mnft.onhost.leases.lab), one round-trip each;
    {"error": …} for a host that did not answer (its status in "status")."""
    results = fleet.run(lambda h: pyrun.command(h, "lab", site=False), stdin=script(), hosts=list(hosts), timeout=timeout)
    out = {}
    for result in results:
        data = pyrun.reply(result, "the lease script")
        out[result.host] = data if data is not None else {"error": result.error or result.status.value, "status": result.status.value}
    return out


def run_drain(fleet: Fleet, host: Host, request: dict, undrain: bool) -> dict:
    """One host's drain or undrain (leasehost's `drain`/`undrain` modes, the request on stdin after the script)."""
    mode = "undrain" if undrain else "drain"
    stdin = script() + json.dumps(request).encode() + b"\n"
    result = fleet.run_one(host, pyrun.command(host, mode, site=False), stdin=stdin, timeout=30)
    data = pyrun.reply(result, "the lease script")
    return data if data is not None else {"error": result.error or result.status.value, "status": result.status.value}
