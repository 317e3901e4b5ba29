"""The controller side of a Slurm run: `mnft train --slurm` (check the request, record the run, sync the code to the
shared workdir, write the sbatch script and submit it, or continue inside the current allocation), and `status`,
`stop` and `logs` of a run whose record says slurm.

Nothing is submitted before every input was checked: Slurm's client commands exist, the partition exists and
has the nodes asked for, the options are Slurm's formats, the job's entry point is in the tree; secrets are refused
(a job's environment and script are stored by slurmctld, readable by Slurm's administrators).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.text import Text

from mnft.core import limits
from mnft.core.errors import ExitCode, InputError, MnftError
from mnft.hosts.command import shell_line, shell_word
from mnft.hosts.settings import DEFAULT_RENDEZVOUS_PORT, Host, Inventory
from mnft.run import launch, records, recover
from mnft.run.job import Job, parse_overrides
from mnft.run.launch import LaunchOptions
from mnft.run.needs import job_needs
from mnft.run.rerun import previous_run, snapshot
from mnft.slurm import cluster, plan
from mnft.slurm.plan import SlurmOptions


@dataclass(frozen=True)
class SlurmTrain:
    """`mnft train --slurm …`: the job, the run's settings, and what is asked of Slurm."""

    job: Job
    slurm: SlurmOptions
    template: Host | None = None  # --hosts: its first host's python, slots, iface, workdir
    env: tuple[str, ...] = ()
    env_files: tuple[str, ...] = ()
    rdzv: str = "static"
    rdzv_timeout: int = 300
    port: int = 0
    src: Path | None = None
    sync: bool = True
    dry_run: bool = False
    resume_run: str | None = None
    resume: bool = False
    detach: bool = False  # return once sbatch accepted the job (default: follow it to its end)


def template_host(given: Host | None, slurm: SlurmOptions) -> Host:
    """What every node of the allocation runs with: --hosts' first host's settings, else this Python, one process
    per node (or --gpus-per-node), workdir ~/mnft on the shared filesystem."""
    base = given or Host(name="slurm", rank=0, address="slurm", python=sys.executable, workdir="~/mnft", venv=None)
    slots = slurm.gpus_per_node or (base.slots if given else 1)
    workdir = os.path.abspath(os.path.expanduser(base.workdir))
    data_dir = os.path.abspath(os.path.expanduser(base.data_dir))
    return replace(base, name="slurm", rank=0, address="slurm", slots=slots, workdir=workdir, data_dir=data_dir, connection="slurm",
                   shared_fs=True, spare=False)


def steps_text(python: str, nodes: int, workdir: str, image: str | None = None) -> list[str]:
    """The job steps as the script's comments show them."""
    if image:
        check = ["1. the host checks on every node (mnft's facts probe " + shell_line(plan.image_check_args(workdir)) + ": the node's",
                 f"   facts and the image's: runtime, {image} there, its id), then the probe inside the image on every node",
                 "   (Python, torch, CUDA, NCCL, the job's modules):",
                 "   " + shell_line(plan.node_step(python, nodes, "mnft-check")[:-2]) + " -c BOOTSTRAP   (mnft.onhost.slurmnode on stdin)",
                 "   " + shell_line(plan.node_step(python, nodes, "mnft-check-image")[:-2]) + " -c BOOTSTRAP   (each node's podman/docker/"
                 "apptainer command)"]
    else:
        check = ["1. the host checks on every node (mnft's facts probe " + shell_line(plan.check_args(workdir)) + ", the job's modules):",
                 "   " + shell_line(plan.node_step(python, nodes, "mnft-check")[:-2]) + " -c BOOTSTRAP   (mnft.onhost.slurmnode on stdin)"]
    return check + [
        "2. mnft's host agent on every node (node_rank = SLURM_NODEID; master = the first node of scontrol show",
        "   hostnames, by its IPv4 address)" + (f", torchrun inside {image}:" if image else ":"),
        "   " + shell_line(plan.node_step(python, nodes, "mnft-train")[:-2]) + " -c BOOTSTRAP   (mnft.onhost.slurmnode on stdin)",
    ]


def train(request: SlurmTrain, console: Console, environ: dict[str, str] | None = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    cluster.require_clients()
    job = request.job
    if job.recipe:
        parse_overrides(job.extra_args)
    inside = bool(environ.get("SLURM_JOB_ID")) and not request.dry_run
    if not inside:
        cluster.check_request(cluster.partitions(), request.slurm.partition, request.slurm.nodes)
    plain, secret = launch.split_env(request.env, environ, request.env_files)
    if secret:
        raise InputError(f"--slurm: {', '.join(sorted(secret))} would be stored by Slurm with the job (its environment is kept by "
                         "slurmctld, readable by its administrators): secrets are not passed to Slurm runs; give the job its "
                         "secrets from a file on the shared filesystem that only you can read")
    from mnft.run.train import source_for
    from mnft.sync.source import default_source

    template = template_host(request.template, request.slurm)
    tree = source_for(job, request.src) or default_source()
    needs = job_needs(job, tree, request.sync)
    port = request.port or DEFAULT_RENDEZVOUS_PORT
    previous = previous_run(request.resume_run) if (request.resume_run or request.resume) else None
    run_id = launch.new_run_id()
    job_id = previous.data.get("job_id", previous.run_id) if previous else run_id
    runs_root = str(records.runs_root().resolve())
    output = f"{runs_root}/{run_id}/slurm-%j.out"
    script = plan.batch_script(request.slurm, run_id=run_id, label=job.label, python=sys.executable, runs_root=runs_root,
                               workdir=f"{runs_root}/{run_id}", output=output, steps=steps_text(template.python, request.slurm.nodes, template.workdir, job.image))
    if request.dry_run:
        return dry_run(request, script, template, port, run_id, job_id, plain, console)
    record = records.RunRecord.create(
        run_id, job_id=job_id, job=job.to_record(), recipe=job.recipe, overrides=list(job.extra_args) if job.recipe else [],
        env_specs=list(request.env), env_files=list(request.env_files), rdzv=request.rdzv, resume=bool(previous),
        resumed_from=previous.run_id if previous else None, detach=True, hosts={}, attempts=[], state="submitting", launched=False,
        # a resumed run is judged in the image its previous run verified, by id (mnft.run.recover.resumed_image_id)
        image={"ref": job.image, "id": recover.resumed_image_id(previous.data, job.image)} if previous and job.image else None,
        inventory=snapshot(Inventory(None, "slurm", (template,), template.name, None, port)),
        slurm={"options": dataclasses.asdict(request.slurm), "template": template.settings(), "port": port, "env": plain,
               "needs": [dataclasses.asdict(n) for n in needs.modules], "rdzv_timeout": request.rdzv_timeout, "inside": inside},
    )
    if request.sync:
        sync_local(template, tree, job_id, record, console)
    (record.path / "slurm.sh").write_text(script)
    if inside:
        from mnft.slurm.allocation import Allocation

        record.update(state="starting", slurm_job_id=environ["SLURM_JOB_ID"])
        return Allocation(record, console, environ).run()
    try:
        job_number = cluster.parse_submitted(cluster.run(["sbatch", "--parsable", str(record.path / "slurm.sh")]).stdout)
    except MnftError as exc:
        record.update(state="refused", reason=str(exc))
        raise
    record.update(state="submitted", slurm_job_id=job_number, submitted=time.time(), launched=True, detach=request.detach)
    if request.detach:
        console.print(Text.assemble("run ", (run_id, "bold"), f": Slurm job {job_number} submitted ({job.label}, {request.slurm.nodes} node(s)); "
                                    f"follow with `mnft logs -f {run_id}`, stop with `mnft stop {run_id}`"), soft_wrap=True)
        print(run_id)
        return int(ExitCode.OK)
    console.print(Text.assemble("run ", (run_id, "bold"), f": Slurm job {job_number} submitted ({job.label}, {request.slurm.nodes} node(s)); "
                                "following it to its end (Ctrl-C cancels it; --detach returns at once)"), soft_wrap=True)
    return follow(record, console)


def follow(record: records.RunRecord, console: Console, poll: float = 1.0) -> int:
    """A submitted job followed to its end, as `mnft train` follows a run over SSH: its state while it waits, then
    what the allocation says as it says it (the batch output on the shared filesystem: the check, every node's
    lines, the failure named, the other nodes' teardown kept in their logs), then the job's state and exit code;
    exit 0 only when the job completed and the run succeeded. Ctrl-C or SIGTERM cancels the job (scancel: Slurm
    ends its steps on every node) and waits until Slurm says it ended."""
    number = job_number(record)
    batch = record.path / f"slurm-{number}.out"  # what the allocation says, as `mnft train` over SSH says it
    offset = 0
    said = None
    try:
        while True:
            offset = tail_file(batch, offset, console)
            state = cluster.show_job(number)
            if state.ended:
                tail_file(batch, offset, console)
                return outcome(records.load(record.run_id), state, console)
            if state.state != said:
                console.print(Text(f"Slurm job {number}: {state.state}" + (f" ({state.reason})" if state.reason and state.reason != "None" else "")
                                   + (f" on {', '.join(state.nodes)}" if state.nodes and state.state == "RUNNING" else ""), style="dim"), soft_wrap=True)
                said = state.state
            time.sleep(poll)
    except KeyboardInterrupt:
        console.print(Text(f"interrupted: cancelling Slurm job {number} (scancel)", style="yellow"), soft_wrap=True)
        cluster.run(["scancel", number])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not cluster.show_job(number).ended:
            time.sleep(0.5)
        records.load(record.run_id).update(state="interrupted", reason=f"interrupted: Slurm job {number} cancelled (scancel)", ended=time.time())
        raise


def outcome(record: records.RunRecord, state: "cluster.JobState", console: Console) -> int:
    """The followed job's end: the run's state and reason as the allocation recorded them, its last step and loss."""
    data = record.data
    summary = data.get("summary") or {}
    ok = state.state == "COMPLETED" and data.get("state") == "succeeded"
    where = f"; step {summary.get('last_step')}, loss {summary.get('last_loss')}" if summary.get("last_step") is not None else ""
    console.print(Text.assemble("run ", (record.run_id, "bold"), f": Slurm job {state.job_id} ", (state.state, "green" if ok else "red"),
                                f" (exit {state.exit_code})" if state.exit_code else "", f"; run {data.get('state')}{where}"), soft_wrap=True)
    console.print(Text(f"logs in {record.path} (batch output: {record.path}/slurm-*.out; `mnft logs {record.run_id}`)"), soft_wrap=True)
    return int(ExitCode.OK if ok else ExitCode.FAILED)


def tail_file(path: Path, offset: int, console: Console, prefix: str = "") -> int:
    """Print the complete lines a file gained since `offset` (read at most TAIL_CHUNK a poll); the new offset."""
    if not path.is_file():
        return offset
    with open(path, "rb") as fh:
        fh.seek(offset)
        chunk = fh.read(TAIL_CHUNK)
    used, lines = whole_lines(chunk)
    for line in lines:
        console.print(Text(prefix + line), soft_wrap=True, highlight=False)
    return offset + used


TAIL_CHUNK = 1 << 20  # read at most this much of a followed file per poll
SHOWN_CHARS = 4096  # of a line longer than a whole chunk, what is printed


def whole_lines(chunk: bytes) -> tuple[int, list[str]]:
    """(bytes used, lines) of a chunk read from a growing file: its complete lines; a full chunk with no line end
    (one line longer than TAIL_CHUNK) is used whole and shown cut, so the tail moves on instead of reading it again
    forever."""
    if b"\n" not in chunk and len(chunk) >= TAIL_CHUNK:
        return len(chunk), [chunk[:SHOWN_CHARS].decode("utf-8", "replace") + " … [line cut: longer than 1 MiB]"]
    complete = chunk[: chunk.rfind(b"\n") + 1]
    return len(complete), complete.decode("utf-8", "replace").splitlines()


def tail_nodes(data: dict, offsets: dict[Path, int], console: Console) -> None:
    """New complete lines of every node's output.log (on the shared filesystem) since the offsets, as `node | line`."""
    for name, info in (data.get("hosts") or {}).items():
        if info.get("run_dir"):
            path = Path(os.path.expanduser(info["run_dir"])) / "output.log"
            offsets[path] = tail_file(path, offsets.get(path, 0), console, prefix=f"{name} | ")


def sync_local(template: Host, tree: Path, job_id: str, record: records.RunRecord, console: Console) -> None:
    """The code, fixed now (mnft.sync.snapshot), into its snapshot and the job's working directory in the workdir every
    node sees (a shared filesystem: one local copy, verified by its hash); the job's files are never removed or
    replaced there (a conflict refuses the submission)."""
    from mnft.sync import snapshot as code

    local = replace(template, name="shared", connection="local")
    fixed = code.fix(tree)
    try:
        from mnft.hosts.fleet import Fleet

        inventory = Inventory(None, "slurm", (local,), local.name)
        with Fleet(inventory) as fleet:
            placed = code.place(inventory, fixed.tree, job_id, fleet=fleet)
    finally:
        fixed.release()
    bad = next((r for r in placed.reports if not r.ok), None)
    if bad is not None:
        record.update(state="sync-failed", reason=bad.summary())
        raise MnftError(f"sync to {template.workdir} failed: {bad.summary()}")
    record.update(code_hash=fixed.tree.digest, sync={"ok": True, "src": str(fixed.source), "hash": fixed.tree.digest, "workdir": template.workdir},
                  code={"src": str(fixed.source), "hash": fixed.tree.digest, "files": len(fixed.tree.files),
                        "job_dir": code.job_dir(template, job_id)})
    console.print(Text(f"code {fixed.tree.digest[:12]} from {fixed.source} ({len(fixed.tree.files)} files) in {code.job_dir(template, job_id)}"))


def dry_run(request: SlurmTrain, script: str, template: Host, port: int, run_id: str, job_id: str, env: dict[str, str], console: Console) -> int:
    """The sbatch script, and what each node would run (its node_rank is its SLURM_NODEID; the master's address
    is known only in the allocation). Nothing is written or submitted."""
    console.print(Text("# the sbatch script (runs/<id>/slurm.sh)", style="bold"))
    console.print(Text(script), soft_wrap=True, highlight=False)
    names = [f"node{i}" for i in range(request.slurm.nodes)]
    image = request.job.image
    # a job in an image: each node's container command line is built on the node, from the runtime, user and image id
    # its check step finds there; shown here is the command that runs inside it, with the image's Python
    inventory = plan.allocation_inventory(names, replace(template, python=launch.IMAGE_PYTHON) if image else template, port)
    env = {**env, "MNFT_SAVE_SIGNAL": request.slurm.signal_name}
    job = replace(request.job, image=None) if image else request.job
    lopts = LaunchOptions(job=job, rdzv=request.rdzv, resume=bool(request.resume or request.resume_run), rdzv_timeout=request.rdzv_timeout)
    plans = launch.plan(inventory, master_addr="MASTER_IPV4", port=port, run_id=run_id, job_id=job_id, options=lopts, ifaces={}, env=env,
                        secret_names=())
    console.print(Text("# in the allocation, each node's launch (nodeI = the I-th of scontrol show hostnames = SLURM_NODEID I; "
                       "MASTER_IPV4 = node0's IPv4 address from the check step)", style="bold"), soft_wrap=True)
    if image:
        setting = template.container_runtime or "the first of podman, docker, apptainer, singularity found on the node"
        console.print(Text(f"# in the image {image}: each node runs this command inside a container of its runtime ({setting}), "
                           f"named mnft-{run_id}-NODE; that command line (`podman run --rm --name … --network host --ipc host --pull never "
                           "--user UID:GID … -v WORKDIR:WORKDIR … IMAGE_ID …`, docs/containers.md) is built on the node from what its "
                           "check step finds there (runtime, user, CDI, the image's id): it is not known here", style="bold"), soft_wrap=True)
    for p in plans:
        shown = p.display()
        console.print(Text.assemble((p.host, "bold"), f" (node_rank {p.node_rank}, cwd {shown['cwd']})"))
        console.print(Text("  env: " + " ".join(shell_word(f"{k}={v}") for k, v in shown["env"].items())), soft_wrap=True)
        console.print(Text("  " + shown["command"]), soft_wrap=True)
    return int(ExitCode.OK)


# ------------------------------------------------------------------------------------------------ status, stop, logs


def is_slurm(record: records.RunRecord) -> bool:
    return bool(record.data.get("slurm"))


def job_number(record: records.RunRecord) -> str:
    number = record.data.get("slurm_job_id")
    if not number:
        raise InputError(f"{record.path}: run {record.run_id} was never submitted to Slurm ({record.data.get('state')}: {record.data.get('reason')})")
    return str(number)


def status(record: records.RunRecord, as_json: bool, console: Console) -> int:
    """The job as Slurm tells it (scontrol: state, reason, nodes, restarts) beside the run's own record."""
    import json

    state = cluster.show_job(job_number(record))
    data = record.data
    summary = data.get("summary") or {}
    out = {"run_id": record.run_id, "slurm_job": state.job_id, "slurm_state": state.state, "reason": state.reason, "nodes": list(state.nodes),
           "restarts": state.restarts, "exit_code": state.exit_code, "run_time": state.run_time, "time_limit": state.time_limit,
           "run_state": data.get("state"), "run_reason": data.get("reason"), "attempt": data.get("attempt"),
           "last_step": summary.get("last_step"), "last_loss": summary.get("last_loss")}
    healthy = state.state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "COMPLETED") and data.get("state") not in ("failed", "refused")
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        console.print(Text.assemble(("run ", ""), (record.run_id, "bold"), f"  Slurm job {state.job_id}: ", (state.state, "green" if healthy else "red"),
                                    f" ({state.reason})" if state.reason else "", f" on {', '.join(state.nodes)}" if state.nodes else "",
                                    f", restarts {state.restarts}" if state.restarts else "", f", time {state.run_time}/{state.time_limit}" if state.run_time else ""),
                      soft_wrap=True)
        console.print(Text(f"  run: {data.get('state')}" + (f" (attempt {data.get('attempt')})" if data.get("attempt") else "")
                           + (f": {data.get('reason')}" if data.get("reason") else "")
                           + (f"; step {summary.get('last_step')}, loss {summary.get('last_loss')}" if summary.get("last_step") is not None else "")),
                      soft_wrap=True)
    return int(ExitCode.OK if healthy else ExitCode.FAILED)


def stop(record: records.RunRecord, as_json: bool, console: Console, timeout: float = 60.0) -> int:
    """scancel the job (Slurm ends every step's processes on every node), then wait until Slurm says it ended."""
    import json

    number = job_number(record)
    before = cluster.show_job(number)
    if before.ended:
        message = f"run {record.run_id} (Slurm job {number}) already ended ({before.state}): nothing to stop"
        print(json.dumps({"run_id": record.run_id, "slurm_job": number, "state": before.state, "ended": True})) if as_json else console.print(message, highlight=False)
        return int(ExitCode.OK)
    cluster.run(["scancel", number])
    deadline = time.monotonic() + timeout
    state = before
    while time.monotonic() < deadline:
        state = cluster.show_job(number)
        if state.ended:
            break
        time.sleep(0.5)
    record.update(state="stopped", reason=f"stopped by mnft stop (scancel {number})", ended=time.time())
    if as_json:
        print(json.dumps({"run_id": record.run_id, "slurm_job": number, "state": state.state, "ended": state.ended}))
    else:
        console.print(f"run {record.run_id}: Slurm job {number} " + (f"ended ({state.state})" if state.ended else f"still {state.state} after {timeout:g}s"),
                      highlight=False)
    return int(ExitCode.OK if state.ended else ExitCode.FAILED)


def logs(record: records.RunRecord, lines: int, follow: bool, console: Console) -> int:
    """Each node's output read in place (the shared filesystem), metrics and loss.png from it; with follow, new
    lines as they come until Slurm says the job ended."""
    from mnft.slurm.allocation import collect_run

    hosts = record.data.get("hosts") or {}
    if not follow:
        collect_run(record, lambda text, style=None: None)
        for name, info in hosts.items():
            path = Path(os.path.expanduser(info["run_dir"])) / "output.log"
            text = (limits.last_lines(path, lines) if lines else limits.lines(path)) if path.is_file() else []
            for line in text:
                console.print(Text(f"{name} | {line}"), soft_wrap=True, highlight=False)
        console.print(f"logs of run {record.run_id} in {record.path} (batch output: {record.path}/slurm-*.out)", highlight=False)
        return int(ExitCode.OK)
    number = job_number(record)
    offsets: dict[Path, int] = {}
    while True:
        tail_nodes(records.load(record.run_id).data, offsets, console)
        state = cluster.show_job(number)
        if state.ended:
            console.print(f"Slurm job {number} ended: {state.state} (exit {state.exit_code})", highlight=False)
            return int(ExitCode.OK if state.state == "COMPLETED" else ExitCode.FAILED)
        time.sleep(1.0)
