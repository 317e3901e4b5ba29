"""Plan a run: one torchrun command per host, pure (inventory and facts in, commands and env out).

Every host gets: nnodes, nproc_per_node = its slots, node_rank = its inventory position, the master's cluster
address (never 127.x for a multi-node job), the rendezvous port, NCCL/GLOO_SOCKET_IFNAME from the inventory's
`iface` or the interface that reached the master during the check, the environment allowlist, and the recipe's
overrides. Secrets (names containing TOKEN/KEY/SECRET/PASSWORD) never enter a command line: they travel to the
host inside the agent's stdin and land in a 0600 file the run's keeper reads and deletes.
"""

from __future__ import annotations

import os
import secrets as _secrets
import shlex
import time
from dataclasses import dataclass, field

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.hosts.command import ENV_NAME, REDACTED, check_env_name, is_secret_name, shell_line
from mnft.hosts.settings import Host, Inventory
from mnft.image import runtime as containers_
from mnft.run import torchrunargs
from mnft.hosts import payload
from mnft.run.job import Job, fill, parse_overrides, recipe_job

# torchrun labels each worker's line with the global rank torch gave it (with c10d not the inventory order)
RANK_TEMPLATE = "[rank${rank}]:"
# Passed through from the controller's environment when set there (secret ones as secrets).
TIMINGS = "timings-rank*.jsonl"  # each rank's step timings, in the recipes' output_dir on its own host
PASSTHROUGH = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "WANDB_PROJECT", "NCCL_DEBUG", "TORCH_DISTRIBUTED_DEBUG")

ENTRY = "entry.py"  # mnft.onhost.entry, written into each run directory by the agent
ENTRY_SOURCE = payload.standalone("entry")


def new_run_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now or time.time()))
    return f"{stamp}-{_secrets.token_hex(2)}"


def attempt_id(run_id: str, attempt: int) -> str:
    """What names attempt k of a run on the hosts (its run directory, its processes' tag): the run id for the
    first, `<run id>-a<k>` after a restart (mnft.run.recover), so each attempt keeps its own logs."""
    return run_id if attempt <= 1 else f"{run_id}-a{attempt}"


@dataclass(frozen=True)
class LaunchOptions:
    job: Job = field(default_factory=lambda: recipe_job("lora"))
    rdzv: str = "static"  # static | c10d
    env: tuple[str, ...] = ()  # NAME or NAME=VALUE, from --env (NAME=VALUE refused for secret names)
    env_files: tuple[str, ...] = ()  # --env-file: NAME=VALUE lines, the file 0600
    detach: bool = False
    resume: bool = False
    deadman: float = 15.0  # a host's agent tears its run down after this long without the controller
    grace: float = 10.0  # SIGTERM -> SIGKILL
    rdzv_timeout: int = 300  # seconds the rendezvous waits for every host to join (torch's own default: 600)
    in_workdir: bool = False  # --no-sync on a new job: run the code `sync` left in the workdir, there (not a job's directory)
    idle_stop: float | None = None  # --idle-stop: its keepers end the run once its GPUs have all been idle this long (seconds)


@dataclass(frozen=True)
class HostLaunch:
    host: str
    node_rank: int
    rank_offset: int  # global rank of this host's local rank 0 (static rendezvous; c10d decides at run time)
    slots: int
    argv: tuple[str, ...]
    env: dict[str, str]
    secret_names: tuple[str, ...]
    cwd: str
    run_dir: str
    output_dir: str
    metrics: str | None  # rank 0's metrics file its agent follows (static: the master only; c10d: wherever rank 0 lands)
    collect: tuple[str, ...] = ()  # files / directories / globs `invoke logs` brings back besides the run directory
    checkpoints: str | None = None  # the job's checkpoints directory on this host
    timings: str | None = None  # the per-rank step timings this host's ranks write (mnft's recipes), a glob
    devices: tuple[int, ...] = ()  # the GPUs this host's ranks see (CUDA_VISIBLE_DEVICES), when the run took some
    leases: tuple[str, ...] = ()  # the lease files the run holds on this host: its keeper holds them to its end
    container: dict | None = None  # the run's container on this host (job.image): runtime, path, name, image, mounts

    def spec(self, run_id: str, secrets: dict[str, str], options: LaunchOptions) -> dict:
        """What the host agent receives on stdin (the only place secret values travel)."""
        return {
            "run_id": run_id,
            "tag": f"{run_id}@{self.host}",
            "run_dir": self.run_dir,
            "argv": list(self.argv),
            "cwd": self.cwd,
            "env": self.env,
            "secrets": {name: secrets[name] for name in self.secret_names},
            "metrics": self.metrics,
            "timings": self.timings,
            "detach": options.detach,
            "deadman": options.deadman,
            "grace": options.grace,
            "entry": ENTRY_SOURCE,  # the launch wrapper's source: the agent writes it as <run_dir>/entry.py
            "leases": list(self.leases),
            "container": self.container,
            "idle_stop": options.idle_stop,  # lowered on the host to the lab's idle_stop (mnft.onhost.watches.idle_limit)
        }

    def display(self) -> dict:
        """The command and environment as a person or a run record may see them (secrets redacted)."""
        env = dict(self.env)
        env.update({name: REDACTED for name in self.secret_names})
        return {"command": shell_line(self.argv), "env": env, "cwd": self.cwd, "run_dir": self.run_dir}


def split_env(specs: tuple[str, ...], environ: dict[str, str], files: tuple[str, ...] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """--env NAME (value from this environment) or NAME=VALUE, --env-file FILE, plus the passthrough list: (plain, secret).

    A secret name (TOKEN/KEY/SECRET/PASSWORD) given as NAME=VALUE is refused: the value would sit on this machine's
    command line (/proc/<pid>/cmdline, readable by every local user) -- and with inventory/local.yaml this machine
    is a training host.
    """
    plain: dict[str, str] = {}
    secret: dict[str, str] = {}
    chosen: dict[str, str] = {name: environ[name] for name in PASSTHROUGH if name in environ}
    from_files: set[str] = set()
    for path in files:
        values = read_env_file(path)
        chosen.update(values)
        from_files |= set(values)
    for spec in specs:
        name, sep, value = spec.partition("=")
        check_env_name(name)
        if sep and is_secret_name(name):
            raise InputError(
                f"--env {name}=…: {name} is a secret and would be visible on this machine's command line; "
                f"use --env {name} (value from this environment) or --env-file FILE (mode 0600)"
            )
        if not sep:
            if name not in environ:
                hint = "--env-file FILE" if is_secret_name(name) else f"--env {name}=VALUE"
                raise InputError(f"--env {name}: not set in this environment (set it, or use {hint})")
            value = environ[name]
        chosen[name] = value
        from_files.discard(name)
    for name in chosen:  # torchrun reads PET_NNODES as --nnodes when the option is not given: mnft's options stay its own
        if torchrunargs.owned_env(name):
            raise InputError(f"--env {name}: sets a torchrun option mnft owns (torchrun reads {name} as "
                             f"--{name[4:].lower().replace('_', '-')}): leave it out")
    for name, value in chosen.items():  # a file's values are secrets, whatever their names: never printed or recorded
        (secret if is_secret_name(name) or name in from_files else plain)[name] = value
    return plain, secret


ENV_FILE_MAX = limits.ENV_FILE_BYTES


def read_env_file(path: str) -> dict[str, str]:
    """NAME=VALUE lines (blank lines and # comments skipped); the file must be readable by its owner only."""
    try:  # the checks are made on the file opened, not on a name that could be swapped in between
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            data = f.read(ENV_FILE_MAX + 1)
    except OSError as exc:
        raise InputError(f"--env-file {path}: {exc.strerror or exc}") from None
    if info.st_mode & 0o077:
        raise InputError(f"--env-file {path}: mode {info.st_mode & 0o777:04o} lets others read it: chmod 600 {shlex.quote(path)}")
    if info.st_uid != os.getuid():
        raise InputError(f"--env-file {path}: owned by uid {info.st_uid}, not by you (uid {os.getuid()}): its values are not yours to trust")
    if len(data) > ENV_FILE_MAX:
        raise InputError(f"--env-file {path}: larger than {ENV_FILE_MAX // 1024} KiB: an env file holds NAME=VALUE lines")
    text = limits.text_of(data, f"--env-file {path}", "env file")  # UTF-8, lines at most LINE_CHARS
    out = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.removeprefix("export ").partition("=")
        name = name.strip()
        if not sep or not ENV_NAME.fullmatch(name):  # the whole name (a trailing newline or space is not a name)
            raise InputError(f"--env-file {path}:{number}: expected NAME=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if "\x00" in value:  # no process can be given it (execve ends a value at NUL)
            raise InputError(f"--env-file {path}:{number}: {name}: the value holds a NUL character")
        out[name] = value
    return out


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def host_path(host: Host, path: str, job_id: str, in_workdir: bool = False) -> str:
    """A job's path on a host: absolute or ~/… as given, else relative to the job's working directory (its code
    and what it writes: job_dir; the workdir for a run of `sync`'s code there: in_workdir), as a script's own relative
    paths are."""
    return path if path.startswith(("/", "~")) else _join(host.workdir if in_workdir else job_dir(host, job_id), path)


def job_dir(host: Host, job_id: str) -> str:
    """A job's working directory on a host (mnft.sync.snapshot.job_dir): the code it was started with, as hard links
    to its snapshot, and everything it writes there; the ranks start in it; the same across restarts and resumes.
    It is also the job's output directory ({output_dir})."""
    return _join(host.workdir, "outputs", job_id)


def output_dir(host: Host, job_id: str) -> str:
    return job_dir(host, job_id)


def placeholders(inventory: Inventory, host: Host, *, master_addr: str, port: int, run_id: str, job_id: str,
                 latest_checkpoint: str | None = None, in_workdir: bool = False) -> dict[str, str]:
    """What a job's placeholders mean on one host (mnft.run.job.PLACEHOLDERS)."""
    values = {
        "output_dir": output_dir(host, job_id), "run_id": run_id, "job_id": job_id, "nnodes": str(len(inventory.hosts)),
        "nproc_per_node": str(host.slots), "world_size": str(inventory.world_size), "node_rank": str(host.rank),
        "master_addr": master_addr, "master_port": str(port), "workdir": host.workdir if in_workdir else job_dir(host, job_id),
        "data_dir": host.data_dir,
    }
    if latest_checkpoint is not None:
        values["latest_checkpoint"] = latest_checkpoint
    return values


def collected(fmt: str, path: str) -> tuple[str, ...]:
    """What `invoke logs` brings back of a metrics path: a TensorBoard directory's event files, HF's
    trainer_state.json files (not the checkpoints beside them), else the file (or glob) itself."""
    if fmt == "tensorboard":
        return (_join(path, "**", "events.out.tfevents.*"),)
    if fmt == "hf":
        return (_join(path, "trainer_state.json"), _join(path, "checkpoint-*", "trainer_state.json"))
    return (path,)


def resume_args(job: Job, resuming: bool, latest_checkpoint: str | None) -> bool:
    """Whether a run passes the job's resume arguments: on resume, when the job's layout needs no checkpoint found
    by mnft (none, mnft: the job finds its own) or one was found. Never without one: HF's
    resume_from_checkpoint=True and GR00T's --resume raise when there is none."""
    if not resuming:
        return False
    return job.resume.layout in ("none", "mnft") or latest_checkpoint is not None


def plan(
    inventory: Inventory,
    *,
    master_addr: str,
    port: int,
    run_id: str,
    job_id: str,
    options: LaunchOptions,
    ifaces: dict[str, str | None],
    env: dict[str, str],
    secret_names: tuple[str, ...],
    latest_checkpoint: str | None = None,
    attempt: int = 1,
    visible: dict[str, tuple[int, ...]] | None = None,
    held: dict[str, tuple[str, ...]] | None = None,
    runtimes: dict[str, containers_.Runtime] | None = None,
) -> list[HostLaunch]:
    """One torchrun command per host for the job: `python -m torch.distributed.run <mnft's flags> <the job's torchrun
    options> <entry point> <job args> <command-line args> [<resume args>]`, with its environment.

    latest_checkpoint: on resume, the checkpoint mnft found (relative to the job's checkpoints directory), the
    value of {latest_checkpoint}. attempt: the attempt number after automatic restarts (its own run directory,
    MNFT_ATTEMPT in the job's environment). visible: host -> the GPUs the run took there (--gpus), which its ranks
    see as CUDA_VISIBLE_DEVICES, numbered as nvidia-smi numbers them (CUDA_DEVICE_ORDER=PCI_BUS_ID). held: host ->
    the lease files the run holds there, handed to its keeper. runtimes: host -> its container runtime, as the
    check found it, for a job with an image (`in_image` wraps each host's command).
    """
    job = options.job
    if options.rdzv not in ("static", "c10d"):
        raise InputError(f"--rdzv {options.rdzv!r}: use static or c10d")
    if isinstance(options.rdzv_timeout, bool) or not isinstance(options.rdzv_timeout, int) or options.rdzv_timeout < 1:
        raise InputError(f"--rdzv-timeout {options.rdzv_timeout!r}: a whole number of seconds ≥ 1")
    hosts = inventory.hosts
    if options.rdzv == "static" and len({h.slots for h in hosts}) > 1:
        raise InputError(
            f"{inventory.path}: hosts have different slots ({', '.join(f'{h.name}={h.slots}' for h in hosts)}): "
            "static rendezvous needs the same slots everywhere; use --rdzv c10d"
        )
    if len(hosts) > 1 and master_addr.startswith("127."):
        raise InputError(f"the master's address {master_addr} is a loopback address peers cannot reach: set 'iface' for the master")
    if job.recipe:
        parse_overrides(job.extra_args)
    with_resume = resume_args(job, options.resume, latest_checkpoint)
    launches = []
    offset = 0
    for host in hosts:
        # per host, under the host's own name: hosts sharing a home (NFS) never share a spec, pgid, log or agent
        run_dir = _join(host.workdir, "runs", attempt_id(run_id, attempt), host.name)
        values = placeholders(inventory, host, master_addr=master_addr, port=port, run_id=run_id, job_id=job_id, in_workdir=options.in_workdir)
        if latest_checkpoint is not None:
            values["latest_checkpoint"] = _join(host_path(host, fill(job.resume.checkpoints, values), job_id, options.in_workdir), latest_checkpoint)
            values["latest_checkpoint_name"] = latest_checkpoint
        argv = [
            host.python, "-m", "torch.distributed.run",
            "--nnodes", str(len(hosts)),
            "--nproc-per-node", str(host.slots),
        ]
        if options.rdzv == "static":
            argv += ["--node-rank", str(host.rank), "--master-addr", master_addr, "--master-port", str(port),
                     "--rdzv-conf", f"timeout={options.rdzv_timeout}"]
        else:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master_addr}:{port}", "--rdzv-id", job_id,
                     "--rdzv-conf", f"join_timeout={options.rdzv_timeout}"]
        argv += [*job.torchrun, "--max-restarts", "0", "--tee", "3", "--log-dir", _join(run_dir, "torchrun")]
        # the entry point runs under mnft's wrapper (mnft.onhost.entry), which records each rank that finished its work
        argv += [_join(run_dir, ENTRY), *job.entry, *(fill(a, values) for a in job.args), *job.extra_args]
        if with_resume:
            argv += [fill(a, values) for a in job.resume.args]
        cwd = host.workdir if options.in_workdir else job_dir(host, job_id)
        host_env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": cwd, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_TEMPLATE,
                    "MNFT_OUTPUT_DIR": values["output_dir"], "MNFT_JOB_ID": job_id, "MNFT_ATTEMPT": str(attempt)}
        host_env.update({name: fill(value, values) for name, value in job.env})
        host_env.update(env)
        devices = tuple((visible or {}).get(host.name) or ())
        if devices:
            host_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
            host_env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        iface = host.iface or ifaces.get(host.name)
        if iface:
            host_env["NCCL_SOCKET_IFNAME"] = iface
            host_env["GLOO_SOCKET_IFNAME"] = iface
        checkpoints = host_path(host, fill(job.resume.checkpoints, values), job_id, options.in_workdir)
        container = None
        if job.image:
            rt = (runtimes or {}).get(host.name)
            if rt is None:
                raise InputError(f"{host.name}: the job runs in the image {job.image} but no container runtime was found there "
                                 "(install podman, docker or apptainer, or set container_runtime: in the inventory)")
            name = containers_.container_name(attempt_id(run_id, attempt), host.name)
            argv, container = in_image(rt, job.image, name, argv, host_env, secret_names, devices,
                                       mounts=(host.workdir, host.data_dir, checkpoints, run_dir), run_dir=run_dir, cwd=cwd,
                                       labels=(("mnft.run", run_id), ("mnft.host", host.name)))
        source = job.metrics
        # static: the master is node 0, so rank 0's files are there; c10d: torch picks the ranks, so every host's
        # agent watches the path and only rank 0's host has it
        rank0_here = options.rdzv == "c10d" or host.name == inventory.master_name
        metrics_path = host_path(host, fill(source.path, values), job_id, options.in_workdir) if source.path else None
        timings = _join(values["output_dir"], TIMINGS) if job.recipe else None  # mnft/recipes/timing.py writes them
        launches.append(
            HostLaunch(
                host=host.name,
                node_rank=host.rank,
                rank_offset=offset,
                slots=host.slots,
                argv=tuple(argv),
                env=host_env,
                secret_names=secret_names,
                cwd=cwd,
                run_dir=run_dir,
                output_dir=values["output_dir"],
                metrics=metrics_path if rank0_here and source.format not in ("hf", "tensorboard", "none") else None,
                collect=(collected(source.format, metrics_path) if metrics_path and rank0_here else ()) + ((timings,) if timings else ()),
                checkpoints=checkpoints,
                timings=timings,
                devices=devices,
                leases=tuple((held or {}).get(host.name) or ()),
                container=container,
            )
        )
        offset += host.slots
    return launches


IMAGE_PYTHON = "python3"  # the image's Python: on PATH in every image mnft supports (NGC's, python:*, a Dockerfile's)
# set by the keeper in the run's environment (mnft.onhost.agent): passed into the container by name with the rest. Not
# HOME: the host's home is not mounted (only the run's directories are); inside, HOME is the image's for the user
# (podman: the workdir for a uid the image does not know), so a cache written there is writable
KEEPER_ENV = ("MNFT_RUN_ID", "MNFT_RUN_TAG")


def in_image(rt: containers_.Runtime, image: str, name: str, argv: list[str], env: dict[str, str], secret_names: tuple[str, ...],
             devices: tuple[int, ...], *, mounts: tuple[str, ...], run_dir: str, cwd: str,
             labels: tuple[tuple[str, str], ...] = ()) -> tuple[list[str], dict]:
    """One host's torchrun command inside the image: the same command, with the image's Python, under the runtime's
    `run` (mnft.image.runtime). The environment goes in by name; the GPUs the run holds are the container's (and
    CUDA_VISIBLE_DEVICES renumbered as the container sees them); secrets go through the 0600 file the agent writes
    in the run directory, read and deleted inside by the launch wrapper (`entry.py --secrets`). Changes env in place.
    Returns the argv and the container's record (what the host's teardown, `status` and the run record read)."""
    inside = [IMAGE_PYTHON, *argv[1:]]
    run_dir_abs = containers_.expand(run_dir, rt.home)
    if secret_names:
        inside = [IMAGE_PYTHON, _join(run_dir_abs, ENTRY), "--secrets", _join(run_dir_abs, "secrets.json"), *inside]
    inside_env = containers_.container_env(rt, env, devices)
    env.clear()
    env.update(inside_env)
    env_names = tuple(sorted(set(env) | set(KEEPER_ENV)))
    spec = containers_.Container(image=rt.runs(image), name=name, mounts=mounts, devices=devices or None,
                                 env_names=env_names, workdir=cwd, labels=labels)
    wrapped = containers_.run_argv(rt, spec, inside)
    record = {"runtime": rt.kind, "path": rt.path, "name": name, "image": image, "image_id": rt.image_id,
              "mounts": list(containers_.mounts(mounts, rt.home)), "secrets_file": bool(secret_names),
              "teardown": containers_.teardown_argv(rt.kind, rt.path, name)}
    return wrapped, record


def environ() -> dict[str, str]:
    return dict(os.environ)
