"""Why a run ended badly, as one cause line and one fix line a person can act on. Pure: what the supervisor saw
(the failed rank's traceback, every host's last output lines, torchrun's exit summary, the kernel's OOM note, what
the check and the straggler watch measured) in, a `Diagnosis` out.

Recognised, in this order (the first that matches names the run's end):
  module-not-found   a rank could not import a module (host, module, the Python it ran in)
  cuda-oom           CUDA out of memory (rank, host, the figures torch printed)
  disk-full          no space left on a device (host, the path where torch says)
  address-in-use     the rendezvous port was taken on the master (port, and the process holding it where seen)
  rendezvous-timeout not every host joined the rendezvous in time (which did not, and whether the check saw it
                     reach the master)
  collective-timeout a collective timed out (the ranks that waited, the ones that never came, the straggler)
  host-oom           host memory ran out: the kernel's OOM killer killed a worker, or torch could not allocate
  non-finite         the loss or gradients were not finite (the step)
  host-lost          a host stopped answering
  gpu-xid            a GPU the attempt ran on logged an Xid since it started (checked before every other cause
                     but host-lost: an illegal memory access or a NCCL error is what a broken GPU makes a job say)
  killed             a worker, or a host's torchrun or container (no traceback: `podman kill`, exit code 137), was killed by a signal
  startup            the job failed before its first step
  failed             anything else: the exit code and the traceback's last line
An abort while the interpreter exits, after every rank's work was done, is not a failure: `after_work` names it
as the warning of a finished run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mnft.run.recover import Cause, worker_exits

MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
CUDA_OOM = re.compile(r"(?:torch\.)?(?:cuda\.)?OutOfMemoryError: CUDA out of memory\.?(.*)")
OOM_FIGURES = re.compile(r"Tried to allocate ([\d.]+ \w+)\.? GPU (\d+) has a total capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free")
# plain writes say errno 28; torch.save on a full disk says only that its stream failed
DISK_FULL = re.compile(r"\[Errno 28\] No space left on device(?:: '([^']*)')?|No space left on device|file write failed"
                       r"|inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+|basic_ios::clear: iostream error")
ADDRESS_IN_USE = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
PORT = re.compile(r"port: (\d+)|port (\d+)|:(\d+)\)?$")
CLIENTS = re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")
CLIENT_TIMEOUT = re.compile(r"client socket has timed out after (\d+)(ms|s) while trying to connect to \(([^,]+), (\d+)\)")
PG_JOIN = re.compile(r"wait timeout after (\d+)ms, keys: (/default_pg/\S*)")  # the key's last part: the rank that never came
CPU_OOM = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")
RDZV_TIMEOUT = re.compile(r"RendezvousTimeoutError|rendezvous.*timed out|waiting for clients", re.I)
COLLECTIVE = re.compile(r"Timed out waiting (\d+)ms for (recv|send) operation|Watchdog caught collective operation timeout"
                        r"|collective operation timeout|ran for (\d+) milliseconds before timing out")
HOST_OOM_FIX = ("use less host memory per node: fewer processes (slots) or dataloader workers, a smaller batch, "
                "or a host with more RAM; then `mnft train --resume`")
AT_EXIT_FIX = ("call torch.distributed.destroy_process_group() at the end of the script: a process group still open "
               "when the interpreter exits can abort it")


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    cause: str  # one line: what happened, where
    fix: str  # one line: what to do

    def to_json(self) -> dict:
        return {"kind": self.kind, "cause": self.cause, "fix": self.fix}


@dataclass(frozen=True)
class Evidence:
    """What the supervisor saw of a failed attempt (mnft.run.train gathers it)."""

    cause: Cause  # mnft.run.recover's classification (drives the retry decision)
    rank: int | None = None  # the rank that failed first (torchrun's root cause), where known
    trace: tuple[str, ...] = ()  # that rank's traceback (without one: its last lines, to its error line)
    tail: tuple[str, ...] = ()  # the failed host's last output lines
    tails: dict[str, tuple[tuple[int | None, str], ...]] = field(default_factory=dict)  # every host's (rank, line)
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # host -> its global ranks (static rendezvous)
    python: dict[str, str] = field(default_factory=dict)  # host -> the Python that ran the job
    reached: dict[str, bool] = field(default_factory=dict)  # host -> whether it reached the master's port in the check
    port: int | None = None
    master: str | None = None
    straggler: str | None = None  # what the straggler watch said, if it named one
    holder: str | None = None  # the process holding the rendezvous port, where seen ("pid 123 python3")


def _who(e: Evidence) -> str:
    host = e.cause.host or "?"
    return f"{host} rank {e.rank}" if e.rank is not None else host


def _first(pattern: re.Pattern, lines) -> re.Match | None:
    for line in reversed(list(lines)):
        match = pattern.search(line)
        if match:
            return match
    return None


def diagnose(e: Evidence) -> Diagnosis:
    lines = [*e.trace, *e.tail[-60:]]
    who, host, kind = _who(e), e.cause.host or "?", e.cause.kind
    if kind == "host-lost":
        return Diagnosis("host-lost", e.cause.detail, f"bring {host} back (power, network), or add a `spare: true` host and "
                         "run with --max-restarts so mnft continues without it; then `mnft train --resume`")
    if kind == "gpu-xid":
        return Diagnosis("gpu-xid", e.cause.detail, xid_fix(e.cause))
    if match := _first(MODULE, lines):
        module = match.group(1)
        python = e.python.get(host, "the host's Python")
        return Diagnosis("module-not-found", f"{who}: no module named {module!r} in {python}",
                         f"add {module.split('.')[0]} to the lock and run `mnft provision` (or install it into that Python); "
                         "`mnft check -- <your entry point>` finds this before a launch")
    if match := _first(CUDA_OOM, lines):
        figures = OOM_FIGURES.search(match.group(0))
        said = (f"tried to allocate {figures.group(1)} on GPU {figures.group(2)} ({figures.group(3)} in all, "
                f"{figures.group(4)} free)") if figures else match.group(1).strip()[:160]
        return Diagnosis("cuda-oom", f"{who}: CUDA out of memory" + (f": {said}" if said else ""),
                         "lower the per-device batch size (raise gradient accumulation to keep the global batch), train LoRA "
                         "adapters instead of every weight, or turn on activation (gradient) checkpointing")
    if match := _first(DISK_FULL, lines):
        where = match.group(1)
        return Diagnosis("disk-full", f"{who}: no space left on the device" + (f" writing {where}" if where else ""),
                         f"free disk space on {host} (`df -h`), or point the job's output and checkpoints at a larger disk; "
                         "then `mnft train --resume`")
    if _first(ADDRESS_IN_USE, lines):
        port = e.port
        if port is None and (found := _first(PORT, [ln for ln in lines if ADDRESS_IN_USE.search(ln)])):
            port = int(next(g for g in found.groups() if g))
        held = f" (held by {e.holder})" if e.holder else ""
        return Diagnosis("address-in-use", f"{host}: the rendezvous port {port or '?'} is already in use{held}",
                         "stop what holds it (`ss -ltnp` on the master) or choose another port (rendezvous_port / --port)")
    clients, client, pg = _first(CLIENTS, lines), _first(CLIENT_TIMEOUT, lines), _first(PG_JOIN, lines)
    if clients or client or pg or _first(RDZV_TIMEOUT, lines):
        missing = [h for h in e.ranks if h != e.master and not _spoke(e.tails.get(h, ()))] or [
            h for h in e.ranks if h != e.master]
        blocked = [h for h in missing if e.reached.get(h) is False]
        if clients:
            what = f"the rendezvous timed out after {clients.group(1)}s: {clients.group(2)} of {clients.group(3)} hosts joined"
        elif client:
            seconds = int(client.group(1)) / (1000 if client.group(2) == "ms" else 1)
            what = f"{host} could not reach the rendezvous at {client.group(3)}:{client.group(4)} within {seconds:g}s"
            missing = [host]
        elif pg:
            late = pg.group(2).rstrip(".,").rsplit("/", 1)[-1]
            hosts = [h for h, ranks in e.ranks.items() if late.isdigit() and int(late) in ranks]
            what = (f"{who} waited {int(pg.group(1)) / 1000:g}s for the other ranks to join the process group"
                    + (f"; rank {late}" + (f" on {hosts[0]}" if hosts else "") + " never came" if late.isdigit() else ""))
        else:
            what = "the rendezvous timed out"
        never = f"; never joined: {', '.join(missing)}" if missing and clients else ""
        if blocked:
            fix = (f"{', '.join(blocked)} could not reach the master's port in the check: open it in the firewall for the peers "
                   "(`mnft setup`) or set 'iface' to the cluster network")
        else:
            fix = ("see why those hosts' torchrun did not start or connect (`mnft logs`): a wrong master address or interface "
                   "('iface'), a firewall (`mnft check`), or a host that started late")
        return Diagnosis("rendezvous-timeout", what + never, fix)
    if _first(COLLECTIVE, lines) or any(_first(COLLECTIVE, [t for _, t in tail]) for tail in e.tails.values()):
        waited = sorted({r for tail in e.tails.values() for r, t in tail if r is not None and COLLECTIVE.search(t)})
        every = sorted({r for ranks in e.ranks.values() for r in ranks})
        absent = [r for r in every if r not in waited] if waited else []
        hosts = [h for h, ranks in e.ranks.items() if any(r in absent for r in ranks)]
        what = "a collective timed out" + (f": rank(s) {_ranks(waited)} waited" if waited else "") + (
            f", rank(s) {_ranks(absent)} on {', '.join(hosts)} never arrived" if absent else "")
        if e.straggler:
            what += f" ({e.straggler})"
        return Diagnosis("collective-timeout", what,
                         (f"see what {', '.join(hosts)} was doing (`mnft logs`: a hang, a long save or evaluation on one rank); "
                          if hosts else "find the rank that stopped (`mnft logs`); ")
                         + "a slow host or link shows in `mnft check --perf`; a job that pauses on purpose needs a longer "
                         "process-group timeout")
    if match := _first(CPU_OOM, lines):
        return Diagnosis("host-oom", f"{who}: out of host memory: could not allocate {int(match.group(1)) / 1024**3:.1f} GiB", HOST_OOM_FIX)
    if kind == "signal" and "OOM killer" in e.cause.detail:
        return Diagnosis("host-oom", f"{who} was killed by the kernel's OOM killer: {host} ran out of memory", HOST_OOM_FIX)
    if kind == "non-finite":
        return Diagnosis("non-finite", e.cause.detail, "lower the learning rate or clip gradients, look at the data around "
                         "that step, then resume from the last checkpoint before it (`mnft train --resume`)")
    if kind == "signal" and "SIGABRT" in e.cause.detail and _traceback(e.trace) and not e.trace[-1].startswith(" "):
        # a Python exception first; the abort came while the interpreter exited (gloo's teardown), not the cause
        return Diagnosis("failed", f"{who} failed: {e.trace[-1].strip()} (and then aborted while exiting)", read_traceback(who, host))
    if kind == "signal":
        return Diagnosis("killed", e.cause.detail, f"find what killed it on {host} (`journalctl -k`, the scheduler, a person); "
                         "then `mnft train --resume`")
    if kind == "startup":
        return Diagnosis("startup", e.cause.detail, f"fix the script, its arguments or its environment ({who}'s traceback in {host}'s "
                         "output; all of it: `mnft logs`); it failed before the first step, so a restart would fail again")
    if kind == "resume-exit":
        return Diagnosis("resume-exit", e.cause.detail, "run `mnft train --resume` (or --max-restarts N to let mnft do it)")
    if not e.trace:  # no traceback was printed: nothing to read one from
        return Diagnosis("failed", e.cause.detail, f"read {host}'s last lines and its whole log (`mnft logs`): the job printed no traceback")
    if not _traceback(e.trace):  # the rank's own last words, ending at its error line (mnft.run.gang.failure_excerpt)
        return Diagnosis("failed", e.cause.detail, f"read {who}'s last lines in {host}'s output (all of it: `mnft logs`): "
                         "the job said why it stopped, with no traceback")
    return Diagnosis("failed", e.cause.detail, read_traceback(who, host))


def _traceback(trace: tuple[str, ...]) -> bool:
    """Whether the failed rank's excerpt is a Python traceback (else its own last lines, ending at its error line)."""
    return any("Traceback (most recent call last)" in line for line in trace)


def read_traceback(who: str, host: str) -> str:
    """Where the failing rank's traceback is, in words that hold wherever a fix is shown (after the lines at the end
    of `train`, in `status`, above the hosts' lines on the board): by its host's output, never "above" or "below"."""
    return f"read {who}'s traceback in {host}'s output (all of it: `mnft logs`)"


def xid_fix(cause: Cause) -> str:
    """What to do about the Xids of a failed attempt: a reset kind's GPU drained and reset; an application kind's
    (13, 31, 43: a bad address, an illegal instruction) looked at in the job first."""
    from mnft.onhost.health import RESET_XIDS

    gpus: dict[str, list[str]] = {}
    for x in cause.xids:
        if x.gpu is not None and str(x.gpu) not in gpus.setdefault(x.host, []):
            gpus[x.host].append(str(x.gpu))
    where = "; ".join(f"{h}:{','.join(g)}" if g else h for h, g in gpus.items()) or "HOST:GPU"
    reset = sorted({x.xid for x in cause.xids if x.xid in RESET_XIDS})
    spare = "mnft restarts a run (--max-restarts) on a spare or fewer hosts, never on that host again"
    if reset:
        return (f"Xid {', '.join(map(str, reset))} needs the GPU reset: drain it (`mnft drain HOST:GPU --reason …` for {where}), "
                f"then `nvidia-smi -r -i GPU` with nothing on it, or reboot the host; {spare}")
    return (f"an Xid of this kind is usually the job's own fault (a bad address, an illegal instruction): read the traceback and "
            f"`dmesg` on {', '.join(sorted({x.host for x in cause.xids}))}; drain the GPU if it recurs elsewhere; {spare}")


def _spoke(tail: tuple[tuple[int | None, str], ...]) -> bool:
    """Whether any rank of a host printed anything (a host whose torchrun never connected prints none)."""
    return any(rank is not None for rank, _ in tail)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" … ({len(ranks)} in all)" if len(ranks) > 8 else "")


def after_work(host: str, tail: list[str]) -> Diagnosis:
    """A host's torchrun failed after every one of its ranks had returned from the job's entry point."""
    exits = worker_exits(tail)
    first = exits[-1] if exits else None
    how = f"rank {first.rank} was killed by {first.signal}" if first is not None and first.signal else (
        f"rank {first.rank} exited with code {first.code}" if first is not None else "a rank failed")
    return Diagnosis("abort-at-exit", f"{host}: {how} while the interpreter exited, after its work was done", AT_EXIT_FIX)
