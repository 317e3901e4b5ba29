"""What Slurm says: its client binaries, partitions and their nodes, a job's state, the allocation's nodes.

Each question is one client command (sinfo, squeue, scontrol) run with a timeout and an argument list (never a
shell), and a pure parser of its output, tested with data. A missing binary or a controller that does not answer
is one line naming the command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from mnft.core.errors import ExitCode, InputError, MnftError

CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
TIMEOUT = 30.0
# A job state that will not change again (squeue no longer lists the job; scontrol keeps it for MinJobAge)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")
PROBLEM_NODE_STATES = ("down", "drain", "drained", "draining", "fail", "failing", "future", "unknown", "not_responding", "maint")


class SlurmError(MnftError):
    exit_code = ExitCode.FAILED


def missing_clients(which=shutil.which) -> list[str]:
    return [name for name in CLIENTS if which(name) is None]


def require_clients(which=shutil.which) -> None:
    missing = missing_clients(which)
    if missing:
        raise InputError(f"--slurm: Slurm's client commands are not installed here ({', '.join(missing)} missing): "
                         "run mnft on a login node of the cluster (or install slurm-client and point SLURM_CONF at its slurm.conf)")


def run(argv: list[str], *, timeout: float = TIMEOUT, input: str | None = None) -> subprocess.CompletedProcess:
    """A Slurm client command; a controller that does not answer or a failed command is a SlurmError naming it."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise InputError(f"{argv[0]}: not installed here (Slurm's client commands are needed for --slurm)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]}: no answer from Slurm within {timeout:g}s") from None
    if done.returncode != 0:
        message = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
        raise SlurmError(f"{' '.join(argv[:2])}: {message}")
    return done


# ------------------------------------------------------------------------------------------------ partitions


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    available: str  # up / down / drain / inact
    nodes: tuple[str, ...]  # every node of the partition
    usable: tuple[str, ...]  # nodes in a state that can run a job (idle, mixed, allocated, completing)
    max_nodes: int | None = None  # the partition's MaxNodes, None when unlimited


def parse_sinfo(text: str) -> dict[str, Partition]:
    """`sinfo -h -N -o '%P|%a|%N|%T'` (one line per node and partition; the default partition marked *)."""
    nodes: dict[str, list[str]] = {}
    usable: dict[str, list[str]] = {}
    info: dict[str, tuple[bool, str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        part, avail, node, state = parts
        default = part.endswith("*")
        name = part.rstrip("*")
        info[name] = (default or info.get(name, (False, ""))[0], avail)
        nodes.setdefault(name, [])
        usable.setdefault(name, [])
        if node not in nodes[name]:
            nodes[name].append(node)
        plain = state.lower().rstrip("*~#!%$@^-+")
        if node not in usable[name] and not any(plain.startswith(p) for p in PROBLEM_NODE_STATES) and not state.endswith("*"):
            usable[name].append(node)
    return {n: Partition(n, info[n][0], info[n][1], tuple(nodes[n]), tuple(usable[n])) for n in nodes}


def partitions() -> dict[str, Partition]:
    return parse_sinfo(run(["sinfo", "-h", "-N", "-o", "%P|%a|%N|%T"]).stdout)


def check_request(parts: dict[str, Partition], partition: str | None, nodes: int) -> Partition:
    """The partition the job goes to; an unknown one, or more nodes than it has, is bad input (nothing submitted)."""
    if not parts:
        raise InputError("--slurm: sinfo lists no partition: this Slurm has no nodes configured")
    if partition is None:
        chosen = next((p for p in parts.values() if p.default), None)
        if chosen is None:
            raise InputError(f"--slurm: this Slurm has no default partition: choose one with --partition ({', '.join(sorted(parts))})")
    elif partition not in parts:
        raise InputError(f"--partition {partition}: no such partition (this Slurm has: {', '.join(sorted(parts))})")
    else:
        chosen = parts[partition]
    if nodes > len(chosen.nodes):
        raise InputError(f"--nodes {nodes}: partition {chosen.name} has {len(chosen.nodes)} node(s) ({', '.join(chosen.nodes)})")
    return chosen


# ------------------------------------------------------------------------------------------------ a job


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED, … ; "UNKNOWN" when Slurm no longer knows the job
    reason: str | None = None
    nodes: tuple[str, ...] = ()
    node_list: str | None = None
    restarts: int = 0
    exit_code: str | None = None  # "0:0" (code:signal)
    run_time: str | None = None
    time_limit: str | None = None

    @property
    def ended(self) -> bool:
        return self.state in ENDED or self.state == "UNKNOWN"


def parse_scontrol_job(text: str) -> dict[str, str]:
    """`scontrol show job -o ID`: one line of Key=Value pairs (a value may hold spaces only in the last keys:
    Command=, WorkDir=, … — read the keys mnft needs, which hold none)."""
    out: dict[str, str] = {}
    for word in text.strip().split(" "):
        key, sep, value = word.partition("=")
        if sep and key and key not in out:
            out[key] = value
    return out


def job_state(fields: dict[str, str], job_id: str, expand=None) -> JobState:
    if not fields:
        return JobState(job_id, "UNKNOWN")
    node_list = fields.get("NodeList") or None
    nodes = tuple(expand(node_list)) if expand and node_list and node_list != "(null)" else ()
    reason = fields.get("Reason")
    try:
        restarts = int(fields.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    return JobState(job_id, fields.get("JobState", "UNKNOWN"), None if reason in (None, "None") else reason, nodes,
                    node_list if node_list != "(null)" else None, restarts, fields.get("ExitCode"), fields.get("RunTime"),
                    fields.get("TimeLimit"))


def show_job(job_id: str) -> JobState:
    """A job's state from scontrol (which keeps an ended job for MinJobAge); UNKNOWN when Slurm forgot it."""
    try:
        text = run(["scontrol", "show", "job", "-o", job_id]).stdout
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return JobState(job_id, "UNKNOWN", reason="Slurm no longer knows the job (older than MinJobAge)")
        raise
    return job_state(parse_scontrol_job(text), job_id, hostnames)


def parse_hostnames(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def hostnames(node_list: str) -> list[str]:
    """`scontrol show hostnames LIST`: a Slurm node list (h[1-3]) as names, in Slurm's order."""
    return parse_hostnames(run(["scontrol", "show", "hostnames", node_list]).stdout)


def allocation(environ: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """Inside an allocation: its job id and its nodes in `scontrol show hostnames` order (= SLURM_NODEID order)."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    node_list = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not node_list:
        raise InputError("not inside a Slurm allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST are not set)")
    return job_id, hostnames(node_list)


def parse_submitted(text: str) -> str:
    """`sbatch --parsable`'s answer: "1234" or "1234;cluster"."""
    job_id = text.strip().splitlines()[-1].split(";")[0] if text.strip() else ""
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {text.strip()!r}, not a job id")
    return job_id
