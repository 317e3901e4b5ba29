"""Automatic recovery (`invoke train --max-restarts N`): why an attempt failed and what to do next. Pure rules:
what the supervisor saw of the failed attempt in, a cause and a decision out; mnft.run.train does the waiting, the
re-check and the relaunch.

Causes, in the order they are recognised:
  host-lost    a host's agent stopped answering (link cut, machine down): the host is waited for, then reused,
               replaced by a spare, or dropped (--min-nodes)
  gpu-xid      a GPU the attempt ran on logged an Xid in its host's kernel log after the attempt started (whatever
               else the workers said: that is kept in the detail): the host is never used again in this run, as a
               host lost for good (a spare in its place, or fewer hosts)
  resume-exit  a worker exited with a code the job declared as "stopped on its own, resume me" (VILA's 124):
               restarted without counting against N, unless it made no progress since the previous attempt
  non-finite   the job stopped because its loss or gradients were not finite: never retried (it diverged; a
               person lowers the learning rate or skips the data)
  startup      a failure before the first training step (an import error, a bad argument): never retried, it
               would fail again
  signal       a worker was killed by a signal (SIGKILL, with the kernel's OOM note when the host's log says so), or,
               with no worker summary, the host's torchrun or container was (exit code 128+N: `podman kill` is 137)
               or, with no worker summary, the host's torchrun or container was (exit code 128+N: `podman kill` is 137)
  failed       a worker exited with an error code
A failure with the same cause at the same step as the attempt before is deterministic: stop.

Every later check of a run (the re-check before a restart, the gang with a spare in a lost host's place or shrunk,
a run continued with --resume, a requeued Slurm attempt) judges what the run's first check judged: the job's image by
the id that check verified (never the hosts' own Python, which a lab training in an image may lack torch in), its
modules and files, the run's devices (`later_check`, `resumed_image_id`).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, replace

from mnft.check.findings import CheckOptions
from mnft.onhost.health import bus_key

# torchrun's error summary, per failed worker: "rank      : 3 (local_rank: 1)" then "exitcode  : -6 (pid: 8081)"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
SIGNALS = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL", 11: "SIGSEGV",
           13: "SIGPIPE", 15: "SIGTERM"}
STARTUP_ERRORS = ("ModuleNotFoundError", "ImportError", "SyntaxError", "IndentationError", "FileNotFoundError",
                  "ConfigError", "usage:", "error: unrecognized arguments", "error: argument")
NON_FINITE = re.compile(r"non-finite|not finite|\bnan\b loss|loss is nan|loss became (nan|inf)", re.I)
RECIPE_CONFIG_EXIT = 2  # mnft's recipes: bad input (a ConfigError) exits 2 on every rank


@dataclass(frozen=True)
class WorkerExit:
    rank: int | None
    code: int

    @property
    def signal(self) -> str | None:
        return SIGNALS.get(-self.code, f"signal {-self.code}") if self.code < 0 else None


def worker_exits(lines: list[str]) -> list[WorkerExit]:
    """The failed workers torchrun's error summary lists (rank and exit code; negative: killed by that signal)."""
    out, rank = [], None
    for text in lines:
        match = _RANK.match(text)
        if match:
            rank = int(match.group(1))
            continue
        match = _EXITCODE.match(text)
        if match:
            out.append(WorkerExit(rank, int(match.group(1))))
            rank = None
    return out


_PID = re.compile(r"^\s*exitcode\s*:\s*-9\s*\(pid:\s*(\d+)\)")


def killed_pids(lines: list[str]) -> list[int]:
    """The pids of workers torchrun says were killed by SIGKILL (the OOM killer's signal)."""
    return [int(m.group(1)) for m in (_PID.match(t) for t in lines) if m]


def oom_killed(kernel_log: str, pids: list[int]) -> bool:
    """Whether the kernel's log says the OOM killer killed one of these pids."""
    return any(re.search(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)", kernel_log) for pid in pids)


def launcher_signal(code: int | None) -> str | None:
    """The signal that killed a host's launcher, from its exit code: negative (Python's -N) or 128+N (a shell's, a
    container runtime's: `podman kill` makes `podman run` exit 137); None for an ordinary exit."""
    if code is None:
        return None
    number = -code if code < 0 else code - 128 if 128 < code < 160 else None
    return SIGNALS.get(number, f"signal {number}") if number else None


XID_SLACK_S = 1.0  # an Xid logged up to this long before the attempt's start counts as its own (clocks, rounding)


@dataclass(frozen=True)
class GpuXid:
    """An Xid a host's kernel logged for one of the run's GPUs."""

    host: str
    gpu: int | None
    xid: int
    at: float  # wall time
    text: str = ""

    def words(self) -> str:
        """"Xid 79 (fallen off the bus) on h1 GPU 0 at 10:02:03"."""
        from mnft.onhost.health import RESET_XIDS

        what = RESET_XIDS.get(self.xid) or " ".join(self.text.split()[-6:]) or "see dmesg"
        return f"Xid {self.xid} ({what}) on {self.host} GPU {'?' if self.gpu is None else self.gpu} at {time.strftime('%H:%M:%S', time.localtime(self.at))}"

    def to_json(self) -> dict:
        return {"host": self.host, "gpu": self.gpu, "xid": self.xid, "at": self.at, "text": self.text}


def new_xids(views: dict[str, dict], visible: dict[str, tuple[int, ...]], since: float,
             taken: dict[str, tuple[dict, ...]] | None = None) -> tuple[GpuXid, ...]:
    """The Xids logged since an attempt started on the GPUs it ran on. views: host -> its lab view (mnft.hosts.lab.look:
    each device with its health's `xids`, read from the host's kernel log); visible: host -> the GPUs the run took
    there (--gpus; a host not named: the run had every GPU of it); taken: host -> those GPUs as the take named them
    (index, UUID, bus id). Pure.

    A run's GPU is told by its UUID and bus, never by its index in the look after the failure: that look sees the
    GPU as the driver has it at that instant — still listed at its index, lost (an Xid 79: its handle error), or gone
    with the GPUs after it renumbered, its index now another GPU's — so matching by index named the Xid or not
    depending on how far the GPU had fallen when the supervisor looked (the race of issue 44). Each Xid is named
    with the index the run had the GPU under."""
    found = []
    for host, view in views.items():
        mine = visible.get(host)
        ids = [d for d in (taken or {}).get(host) or () if isinstance(d, dict) and (d.get("uuid") or d.get("bus_id"))]
        for device in view.get("devices") or []:
            if not isinstance(device, dict):
                continue
            index = device.get("index")
            if ids:
                match = [d for d in ids if (device.get("uuid") and d.get("uuid") == device.get("uuid"))
                         or (device.get("bus_id") and d.get("bus_id") and bus_key(d["bus_id"]) == bus_key(device["bus_id"]))]
                if not match:
                    continue
                index = match[0].get("index")
            elif mine and index not in mine:
                continue
            for x in (device.get("health") or {}).get("xids") or []:
                at, code = x.get("at"), x.get("xid")
                if isinstance(code, int) and isinstance(at, (int, float)) and at >= since - XID_SLACK_S:
                    found.append(GpuXid(host, index if isinstance(index, int) else None, code, float(at), str(x.get("text") or "")[:200]))
    return tuple(sorted(found, key=lambda x: (x.at, x.host, x.gpu if x.gpu is not None else -1)))


@dataclass(frozen=True)
class Seen:
    """What the supervisor saw of a failed attempt (mnft.run.train gathers it)."""

    failed_host: str | None
    host_state: str | None  # the failed host's run: lost | exited | failed-to-start
    exit_code: int | None  # torchrun's
    tail: tuple[str, ...] = ()  # the failed host's last output lines
    traceback: tuple[str, ...] = ()
    first_step: bool = False  # a training step was seen in this attempt
    last_step: int | None = None
    last_loss: float | None = None
    resume_codes: tuple[int, ...] = ()
    oom: bool = False  # the host's kernel log says it killed one of the run's processes for memory
    container: bool = False  # the job ran in a container (a job with an image): the host's launcher is its runtime's process
    xids: tuple[GpuXid, ...] = ()  # Xids the run's GPUs logged since the attempt started (new_xids)


@dataclass(frozen=True)
class Cause:
    kind: str  # host-lost | gpu-xid | resume-exit | non-finite | startup | signal | failed
    host: str | None
    detail: str  # one line for a person
    step: int | None = None  # the last training step seen
    code: int | None = None  # the worker's exit code (negative: signal)
    xids: tuple[GpuXid, ...] = ()  # gpu-xid: the Xids, each with its host and GPU

    @property
    def unfit(self) -> dict[str, str]:
        """host -> why the next attempts never run there (its GPU logged an Xid during this attempt)."""
        out: dict[str, list[str]] = {}
        for x in self.xids:
            out.setdefault(x.host, []).append(f"Xid {x.xid} on its GPU {'?' if x.gpu is None else x.gpu}")
        return {host: ", ".join(dict.fromkeys(words)) for host, words in out.items()}

    @property
    def retried(self) -> bool:
        return self.kind not in ("non-finite", "startup")

    @property
    def counted(self) -> bool:
        return self.kind != "resume-exit"

    def same(self, other: "Cause") -> bool:
        """The same failure: same kind and code (and host, for a lost host) at the same step."""
        return (self.kind, self.code, self.step, self.host if self.kind == "host-lost" else None, self._what()) == (
            other.kind, other.code, other.step, other.host if other.kind == "host-lost" else None, other._what())

    def _what(self) -> str:
        if self.kind == "gpu-xid":  # the same Xid codes at the same step on other GPUs: the job's doing (Xid 13, 31)
            return ",".join(str(c) for c in sorted({x.xid for x in self.xids}))
        return self.detail.rsplit(": ", 1)[-1] if self.kind in ("failed", "startup") else ""

    def to_json(self) -> dict:
        out = {"kind": self.kind, "host": self.host, "detail": self.detail, "step": self.step, "code": self.code}
        if self.xids:
            out["xids"] = [x.to_json() for x in self.xids]
        return out


def classify(seen: Seen) -> Cause:
    """The cause of a failed attempt. An Xid on one of its GPUs since it started names it (gpu-xid), with what the
    workers said before it: the GPU, not the job, is the first suspect (a lost host stays host-lost)."""
    cause = _classify(seen)
    if not seen.xids or cause.kind == "host-lost":
        return cause
    return Cause("gpu-xid", cause.host, f"{cause.detail}; " + "; ".join(x.words() for x in seen.xids), cause.step, cause.code, seen.xids)


def _classify(seen: Seen) -> Cause:
    host = seen.failed_host
    step = seen.last_step
    if seen.host_state == "lost":
        return Cause("host-lost", host, f"{host} stopped answering (link cut or machine down)", step)
    workers = worker_exits(list(seen.tail))
    first = workers[-1] if workers else None  # torchrun lists the root cause (first observed failure) last
    code = first.code if first else seen.exit_code
    who = f"{host} rank {first.rank}" if first and first.rank is not None else f"{host}"
    if code in seen.resume_codes or (seen.exit_code in seen.resume_codes and not workers):
        return Cause("resume-exit", host, f"{who} exited {code}: the job asks to be resumed", step, code)
    last = seen.traceback[-1] if seen.traceback else ""
    text = " ".join(seen.traceback[-3:]) + " " + " ".join(seen.tail[-20:])
    if (seen.last_loss is not None and not math.isfinite(seen.last_loss)) or NON_FINITE.search(text):
        return Cause("non-finite", host, f"{who}: the loss or gradients were not finite" + (f" at step {step}" if step else ""), step, code)
    startup = any(marker in last for marker in STARTUP_ERRORS) or code == RECIPE_CONFIG_EXIT
    if not seen.first_step and startup:
        return Cause("startup", host, f"{who} failed before the first step: {last or f'exit code {code}'}", step, code)
    if first is not None and first.signal:
        oom = " (the kernel's OOM killer: out of memory)" if seen.oom else ""
        return Cause("signal", host, f"{who} was killed by {first.signal}{oom}", step, code)
    if first is None and (name := launcher_signal(code)) is not None:  # no worker summary: torchrun itself (or its container) was killed
        what = f"{host}'s container" if seen.container else f"{host}'s torchrun"
        how = f" (exit code {code})" if code is not None and code > 0 else ""
        return Cause("signal", host, f"{what} was killed by {name}{how} from outside the run" + (" (the kernel's OOM killer: out of memory)"
                                                                                             if seen.oom else ""), step, code)
    return Cause("failed", host, f"{who} exited with code {code}" + (f": {last}" if last else ""), step, code)


# ------------------------------------------------------------------------------------------------ the decision


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 0
    min_nodes: int | None = None  # shrink to no fewer hosts than this when a lost host has no spare (None: never)
    backoff_s: float = 5.0  # before attempt 2; doubled each attempt, at most backoff_max_s
    backoff_max_s: float = 60.0
    reuse_wait_s: float = 20.0  # how long a lost host may take to answer again before it is replaced

    def backoff(self, restarts: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, restarts - 1))


@dataclass(frozen=True)
class Attempt:
    """An ended attempt as the decision needs it."""

    number: int
    hosts: tuple[str, ...]
    cause: Cause | None
    counted: bool


@dataclass(frozen=True)
class Decision:
    restart: bool
    why: str
    counted: bool = True


def should_restart(policy: Policy, history: list[Attempt], cause: Cause) -> Decision:
    """Restart after this cause? history: the attempts before the one that just failed (oldest first)."""
    used = sum(1 for a in history if a.counted) + (1 if cause.counted else 0)
    if policy.max_restarts <= 0:
        return Decision(False, "no restarts allowed (--max-restarts 0)")
    if not cause.retried:
        return Decision(False, {"startup": "a failure before the first step would fail again: not retried",
                                "non-finite": "the run diverged: not retried (lower the learning rate, or resume by hand)"}[cause.kind])
    previous = history[-1].cause if history else None
    if previous is not None and cause.same(previous):
        return Decision(False, f"the same failure at the same step as attempt {history[-1].number}: deterministic, not retried")
    if cause.kind == "resume-exit":
        if previous is not None and previous.kind == "resume-exit" and cause.step is not None and cause.step == previous.step:
            return Decision(False, "the job asked to be resumed again without a step of progress: not retried")
        return Decision(True, "the job asked to be resumed (not counted against --max-restarts)", counted=False)
    if used > policy.max_restarts:
        return Decision(False, f"--max-restarts {policy.max_restarts} used up")
    return Decision(True, f"restart {used} of {policy.max_restarts}")


@dataclass(frozen=True)
class Gang:
    """The hosts of the next attempt, and what changed."""

    hosts: tuple[str, ...] | None  # None: no gang can be formed
    replaced: dict[str, str] = field(default_factory=dict)  # lost host -> the spare in its place
    dropped: tuple[str, ...] = ()
    why: str = ""


def next_gang(gang: tuple[str, ...], lost: list[str], back: set[str], spares: list[str], min_nodes: int | None,
              elastic: bool, unfit: dict[str, str] | None = None) -> Gang:
    """Hosts that answered again keep their place; a lost host gets a spare's place (in order); without a spare
    the gang shrinks when the job allows it and at least min_nodes remain; else no gang. unfit: host -> why it is
    never used again in this run (a GPU's Xid, Cause.unfit): replaced or dropped as a host lost for good."""
    unfit = {h: why for h, why in (unfit or {}).items() if h in gang}
    lost = list(lost) + [h for h in unfit if h not in lost]
    back = set(back) - set(unfit)
    hosts = list(gang)
    replaced: dict[str, str] = {}
    dropped: list[str] = []
    free = [s for s in spares if s not in gang and s not in unfit]
    for name in lost:
        if name in back:
            continue
        if free:
            spare = free.pop(0)
            hosts[hosts.index(name)] = spare
            replaced[name] = spare
        else:
            hosts.remove(name)
            dropped.append(name)
    def why(name: str) -> str:
        return f" ({unfit[name]}: not used again in this run)" if name in unfit else ""

    notes = [f"{a} replaced by the spare {b}{why(a)}" for a, b in replaced.items()]
    if dropped:
        which = ", ".join(f"{d}{why(d)}" for d in dropped)
        if not elastic:
            return Gang(None, replaced, tuple(dropped), f"{which} lost and no spare left; the job is not elastic "
                        "(a job file's `elastic: true` allows running on fewer hosts)")
        if min_nodes is None or len(hosts) < min_nodes:
            need = "--min-nodes is not set" if min_nodes is None else f"fewer than --min-nodes {min_nodes} would remain"
            return Gang(None, replaced, tuple(dropped), f"{which} lost and no spare left; {need}")
        notes.append(f"{which} dropped: continuing on {len(hosts)} hosts")
    notes += [f"{n} answers again: reused" for n in lost if n in back]
    return Gang(tuple(hosts), replaced, tuple(dropped), "; ".join(notes) or "the same hosts")


# ------------------------------------------------------------------------------------------------ later checks


def later_check(first: CheckOptions, verified_image_id: str | None, port: int | None) -> CheckOptions:
    """A later check of the run (the re-check of the next gang): the first check's options (the image, the job's
    modules and files, the run's devices), the image required by the id the first check verified, and the rendezvous
    port searched from `port`. Pure."""
    return replace(first, port=port, find_free_port=True, image_id=first.image_id or (verified_image_id if first.image else None))


def resumed_image_id(previous: dict, image: str | None) -> str | None:
    """The image id a run continued with --resume requires: the one the run it continues verified, when it ran in the
    same image (a job given another image by hand is judged as a new one). previous: the earlier run.json's data."""
    if not image:
        return None
    verified = previous.get("image") if isinstance(previous.get("image"), dict) else {}
    return verified.get("id") if verified.get("ref") == image and isinstance(verified.get("id"), str) else None
