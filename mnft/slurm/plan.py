"""The sbatch script and the srun command lines of a Slurm run, pure: options and the launch plan in, text out.

The script holds the allocation's options as #SBATCH lines (nodes, one task per node, partition, time, account,
GPUs, per-job output appended across requeues, requeue, the warning signal to the batch) and one command: mnft
continuing the run inside the allocation (mnft.slurm.allocation), which runs two kinds of job step, both
`srun --ntasks-per-node=1 --kill-on-bad-exit=1` on every node: the host checks (mnft's facts probe) and mnft's
host agent (through mnft.onhost.slurmnode). The nodes of the allocation become an inventory in `scontrol show
hostnames` order, so the launch plan of the SSH path gives node_rank = SLURM_NODEID and the master's IPv4.

Every value that reaches the script is validated here (a partition is a name, a time is Slurm's time format);
words of the command line are quoted for the shell once.
"""

from __future__ import annotations

import base64
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from mnft.core.errors import InputError
from mnft.hosts.pyrun import BOOTSTRAP, payload
from mnft.hosts.settings import Host, Inventory

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a partition or account name
# Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
TIME = re.compile(r"(\d+)|(\d+):(\d{1,2})|(\d+):(\d{1,2}):(\d{1,2})|(\d+)-(\d+)|(\d+)-(\d+):(\d{1,2})|(\d+)-(\d+):(\d{1,2}):(\d{1,2})")
SIGNALS = ("USR1", "USR2", "HUP", "URG")  # a warning signal a job may handle (TERM/KILL are Slurm's own end)
SIGNAL = re.compile(r"(?:SIG)?([A-Z0-9]+)@(\d+)")
# sbatch options mnft writes itself: given again with --sbatch-arg they would contradict the run's
OWN_OPTIONS = (
    "--nodes", "-N", "--ntasks-per-node", "--ntasks", "-n", "--output", "-o", "--error", "-e", "--open-mode", "--signal",
    "--requeue", "--no-requeue", "--job-name", "-J", "--chdir", "-D", "--partition", "-p", "--time", "-t", "--account",
    "-A", "--gpus-per-node", "--parsable", "--wrap", "--export", "--array", "-a", "--input", "-i",
)
SBATCH_ARG = re.compile(r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_.,:@%/+=-]+)?")
SAFE_PATH = re.compile(r"/[A-Za-z0-9_.,+@%/-]*")  # a path written into #SBATCH lines (sbatch splits them on spaces)
STEP_WAIT = 60  # srun --wait: once one task ended, the others get this long before the step is ended


@dataclass(frozen=True)
class SlurmOptions:
    """What `mnft train --slurm` asks of Slurm."""

    nodes: int = 1
    partition: str | None = None
    time: str | None = None  # Slurm's time format
    account: str | None = None
    gpus_per_node: int | None = None
    requeue: bool = False  # Slurm requeues the job after a node failure; the batch requeues it after a save on the signal
    signal: str = "USR2@90"  # the warning before the time limit: SIGNAL@SECONDS, to the batch, which tells the job
    max_requeues: int = 3  # requeues the batch asks for itself (SLURM_RESTART_COUNT below this)
    sbatch_args: tuple[str, ...] = ()  # more sbatch options, --name[=value]

    def __post_init__(self) -> None:
        """Bad options are bad input (exit 2), refused before anything is submitted."""
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise InputError(f"--nodes {self.nodes!r}: a whole number ≥ 1")
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not NAME.fullmatch(value):
                raise InputError(f"{flag} {value!r}: not a Slurm name (letters, digits, _ . -)")
        if self.time is not None and minutes(self.time) is None:
            raise InputError(f"--time {self.time!r}: use Slurm's format (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)")
        if self.gpus_per_node is not None and (isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int)
                                               or self.gpus_per_node < 1):
            raise InputError(f"--gpus-per-node {self.gpus_per_node!r}: a whole number ≥ 1")
        _, seconds = parse_signal(self.signal)
        limit = minutes(self.time) if self.time else None
        if limit is not None and seconds >= limit * 60:
            raise InputError(f"--signal {self.signal}: {seconds} s before a time limit of {self.time} is before the job starts")
        if isinstance(self.max_requeues, bool) or not isinstance(self.max_requeues, int) or self.max_requeues < 0:
            raise InputError(f"--max-restarts {self.max_requeues!r}: a whole number ≥ 0")
        for arg in self.sbatch_args:
            if not SBATCH_ARG.fullmatch(arg):
                raise InputError(f"--sbatch-arg {arg!r}: one sbatch option as --name or --name=value (no spaces or quotes)")
            if arg.split("=", 1)[0] in OWN_OPTIONS:
                raise InputError(f"--sbatch-arg {arg}: mnft sets {arg.split('=', 1)[0]} itself (use mnft's own option)")

    @property
    def signal_name(self) -> str:
        return parse_signal(self.signal)[0]

    @property
    def signal_seconds(self) -> int:
        return parse_signal(self.signal)[1]


def parse_signal(text: str) -> tuple[str, int]:
    """USR2@90 -> ("USR2", 90); a signal a job could not handle, or a time outside 1..65535 s, is bad input."""
    match = SIGNAL.fullmatch(str(text))
    if not match or match.group(1) not in SIGNALS or not 1 <= int(match.group(2)) <= 65535:
        raise InputError(f"--signal {text!r}: use SIGNAL@SECONDS with one of {', '.join(SIGNALS)} (e.g. USR2@90)")
    return match.group(1), int(match.group(2))


def minutes(text: str) -> float | None:
    """Slurm's time format as minutes, None when it is not one."""
    match = TIME.fullmatch(text.strip()) if isinstance(text, str) else None
    if not match:
        return None
    g = [int(x) if x is not None else None for x in match.groups()]
    if g[0] is not None:
        return float(g[0])
    if g[1] is not None:
        return g[1] + g[2] / 60
    if g[3] is not None:
        return g[3] * 60 + g[4] + g[5] / 60
    if g[6] is not None:
        return g[6] * 1440 + g[7] * 60
    if g[8] is not None:
        return g[8] * 1440 + g[9] * 60 + g[10]
    return g[11] * 1440 + g[12] * 60 + g[13] + g[14] / 60


def _safe_path(path: str, what: str) -> str:
    if not SAFE_PATH.fullmatch(path):
        raise InputError(f"{what} {path!r}: a Slurm run's paths go into #SBATCH lines: use a path without spaces or quotes")
    return path


def sbatch_options(options: SlurmOptions, *, job_name: str, output: str, chdir: str) -> list[str]:
    """The #SBATCH options of the run, in the order the script lists them."""
    out = [f"--job-name={job_name}", f"--nodes={options.nodes}", "--ntasks-per-node=1"]
    if options.partition:
        out.append(f"--partition={options.partition}")
    if options.account:
        out.append(f"--account={options.account}")
    if options.time:
        out.append(f"--time={options.time}")
    if options.gpus_per_node:
        out.append(f"--gpus-per-node={options.gpus_per_node}")
    out += [f"--output={_safe_path(output, 'the batch output')}", "--open-mode=append", f"--chdir={_safe_path(chdir, 'the workdir')}"]
    out.append("--requeue" if options.requeue else "--no-requeue")
    if options.requeue:  # to the batch (B:): it tells the job to save, then requeues itself
        out.append(f"--signal=B:{options.signal_name}@{options.signal_seconds}")
    out += list(options.sbatch_args)
    return out


def batch_script(options: SlurmOptions, *, run_id: str, label: str, python: str, runs_root: str, workdir: str,
                 output: str, steps: Iterable[str] = ()) -> str:
    """The sbatch script: #SBATCH lines, what mnft runs in the allocation (as comments), and the one command that
    continues the run there. workdir: where the batch starts (the run's own directory: a synced tree holding an
    `mnft` directory there would shadow the installed mnft on `python -m`)."""
    header = [
        "#!/bin/bash",
        f"# mnft run {run_id}: {label}. Rendered by mnft train --slurm (mnft.slurm.plan); submitted with sbatch --parsable.",
    ]
    header += [f"#SBATCH {o}" for o in sbatch_options(options, job_name=f"mnft-{run_id}", output=output, chdir=workdir)]
    body = [
        "#",
        "# In the allocation mnft runs these job steps (attempt = SLURM_RESTART_COUNT + 1; a requeued job resumes from",
        "# the latest complete checkpoint):",
        *(f"#   {line}" for line in steps),
        "set -eu",
        f"export MNFT_RUNS_DIR={shlex.quote(runs_root)}",
        "exec " + shlex.join([python, "-m", "mnft.slurm.allocation", run_id]),
        "",
    ]
    return "\n".join(header + body)


def srun_argv(nodes: int, *, label: bool = True, input_all: bool = True, output: str | None = None, job_name: str | None = None) -> list[str]:
    """One task per node of the allocation, the step ended as soon as one task fails (--kill-on-bad-exit), the
    same stdin to every task (--input=all: the script, then the plan and the heartbeats), each line labelled
    with its task number (= SLURM_NODEID: one task per node)."""
    argv = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", f"--wait={STEP_WAIT}"]
    if input_all:
        argv.append("--input=all")
    if label:
        argv.append("--label")
    if output:
        argv.append(f"--output={output}")
    if job_name:
        argv.append(f"--job-name={job_name}")
    return argv


def node_step(python: str, nodes: int, name: str) -> list[str]:
    """mnft.onhost.slurmnode on every node (its payload, then one JSON line, on the step's stdin)."""
    return srun_argv(nodes, job_name=name) + [python, "-c", BOOTSTRAP]


def check_args(workdir: str, modules: Iterable[str] = ()) -> list[str]:
    """The facts probe's arguments for the check step: the workdir's disk, the job's modules."""
    wanted = sorted(set(modules))
    return ["facts", "--workdir", workdir] + (["--modules", ",".join(wanted)] if wanted else [])


def image_check_args(workdir: str) -> list[str]:
    """The facts probe's arguments for the check step of a job in an image: the host's facts and the image's
    (imagehost's, from the probe's payload; its runtime setting and image on the probe's stdin: `script_line`'s input)."""
    return ["image-facts", "--workdir", workdir]


def script_line(entry: str, args: list[str], input: str | None = None) -> dict:
    """The JSON line that makes mnft.onhost.slurmnode run another host entry (mnft.onhost.<entry>) with its arguments
    on every node; input: what the entry reads on its stdin after its payload (then its stdin ends)."""
    line = {"mode": "script", "payload": payload64(entry), "args": list(args)}
    if input is not None:
        line["input"] = input
    return line


def payload64(entry: str) -> str:
    """A host entry's payload as a JSON line carries it (base64)."""
    return base64.b64encode(payload(entry)).decode()


def command_line(commands: list[list[str] | None], input: str, timeout: float, entry: str | None = None) -> dict:
    """The JSON line that makes mnft.onhost.slurmnode run on each node the command at its SLURM_NODEID (None: nothing
    there), `input` on its stdin, for at most `timeout` seconds: srun runs one command on every node, so each node's
    own comes in one list, as its launch does (the probe inside the image: its command line is the node's own)."""
    line = {"mode": "command", "commands": [list(c) if c is not None else None for c in commands], "input": input, "timeout": float(timeout)}
    return dict(line, payload=payload64(entry)) if entry else line


LINE_KEPT = 1 << 20  # characters of one task's line put back together (a line without end costs no more)


class Pieces:
    """Lines of an srun --label stream put back together: mnft.onhost.slurmnode sends each line in pieces ("+…" goes
    on, "|…" ends it). Returns (task, line) for each whole line; srun's own lines (no label) and a task's lines
    without a marker (a traceback on its stderr) come through as they are."""

    def __init__(self) -> None:
        self.partial: dict[int, list[str]] = {}

    def feed(self, raw: str) -> tuple[int | None, str] | None:
        task, text = split_label(raw)
        if task is None:
            return None, raw
        if text.startswith("+"):
            pieces = self.partial.setdefault(task, [])
            if sum(len(p) for p in pieces) < LINE_KEPT:  # past it, the rest of the line is dropped: a line is shown cut
                pieces.append(text[1:])
            return None
        if text.startswith("|"):
            whole = "".join(self.partial.pop(task, [])) + text[1:]
            return task, whole if len(whole) <= LINE_KEPT else whole[:LINE_KEPT] + " … [line cut]"
        return task, text


def allocation_inventory(nodes: list[str], template: Host, rendezvous_port: int) -> Inventory:
    """The allocation's nodes as an inventory, in `scontrol show hostnames` order (node i has node_rank i, which is
    its SLURM_NODEID), each with the run's Python, slots, interface, workdir and container runtime setting. The
    first is the master."""
    if not nodes:
        raise InputError("the allocation has no nodes (SLURM_JOB_NODELIST is empty)")
    hosts = tuple(Host(name=n, rank=i, address=n, python=template.python, slots=template.slots, iface=template.iface,
                       workdir=template.workdir, data_dir=template.data_dir, connection="slurm", shared_fs=True, venv=None,
                       container_runtime=template.container_runtime)
                  for i, n in enumerate(nodes))
    return Inventory(None, "slurm", hosts, nodes[0], None, rendezvous_port)


def split_label(line: str) -> tuple[int | None, str]:
    """srun --label's "3: text" -> (3, "text"); a line without a label (srun's own) -> (None, line)."""
    match = re.fullmatch(r"\s*(\d+): ?(.*)", line, re.DOTALL)
    if not match:
        return None, line
    return int(match.group(1)), match.group(2)
