"""Plan a run: one torchrun command per host, pure (inventory and facts in, commands and env out).

Every host gets: nnodes, nproc_per_node = its slots, node_rank = its inventory position, the master's cluster
address (never 127.x for a multi-node job), the rendezvous port, NCCL/GLOO_SOCKET_IFNAME from the inventory's
`iface` or the interface that reached the master during the check, the environment allowlist, and the recipe's
overrides. Secrets (names containing TOKEN/KEY/SECRET/PASSWORD) never enter a command line: they travel to the
host inside the agent's stdin and land in a 0600 file the run's keeper reads and deletes.
"""

from __future__ import annotations

import os
import re
import secrets as _secrets
import shlex
import time
from dataclasses import dataclass

from mnft.command import REDACTED, check_env_name, is_secret_name
from mnft.errors import InputError
from mnft.inventory import Inventory

RECIPES = ("lora", "full")
RESERVED_KEYS = ("output_dir", "resume")
# torchrun labels each worker's line with the global rank torch gave it (with c10d not the inventory order)
RANK_TEMPLATE = "[rank${rank}]:"
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)=(.*)$", re.S)
# Passed through from the controller's environment when set there (secret ones as secrets).
PASSTHROUGH = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "WANDB_PROJECT", "NCCL_DEBUG", "TORCH_DISTRIBUTED_DEBUG")


def new_run_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now or time.time()))
    return f"{stamp}-{_secrets.token_hex(2)}"


@dataclass(frozen=True)
class LaunchOptions:
    recipe: str = "lora"
    overrides: tuple[str, ...] = ()
    rdzv: str = "static"  # static | c10d
    env: tuple[str, ...] = ()  # NAME or NAME=VALUE, from --env (NAME=VALUE refused for secret names)
    env_files: tuple[str, ...] = ()  # --env-file: NAME=VALUE lines, the file 0600
    detach: bool = False
    resume: bool = False
    deadman: float = 15.0  # a host's agent tears its run down after this long without the controller
    grace: float = 10.0  # SIGTERM -> SIGKILL


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
    metrics: str | None  # rank 0's metrics file (static: the master only; c10d: wherever rank 0 lands)

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
            "detach": options.detach,
            "deadman": options.deadman,
            "grace": options.grace,
        }

    def display(self) -> dict:
        """The command and environment as a person or a run record may see them (secrets redacted)."""
        env = dict(self.env)
        env.update({name: REDACTED for name in self.secret_names})
        return {"command": shlex.join(self.argv), "env": env, "cwd": self.cwd, "run_dir": self.run_dir}


def parse_overrides(overrides: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    out = []
    for item in overrides:
        match = OVERRIDE.match(item)
        if not match:
            raise InputError(f"recipe override {item!r}: expected key=value")
        if match.group(1) in RESERVED_KEYS:
            raise InputError(f"recipe override {item!r}: {match.group(1)} is set by mnft (use --resume to continue a run)")
        out.append(item)
    return tuple(out)


def split_env(specs: tuple[str, ...], environ: dict[str, str], files: tuple[str, ...] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """--env NAME (value from this environment) or NAME=VALUE, --env-file FILE, plus the passthrough list: (plain, secret).

    A secret name (TOKEN/KEY/SECRET/PASSWORD) given as NAME=VALUE is refused: the value would sit on this machine's
    command line (/proc/<pid>/cmdline, readable by every local user) -- and with inventory/local.yaml this machine
    is a training host.
    """
    plain: dict[str, str] = {}
    secret: dict[str, str] = {}
    chosen: dict[str, str] = {name: environ[name] for name in PASSTHROUGH if name in environ}
    for path in files:
        chosen.update(read_env_file(path))
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
    for name, value in chosen.items():
        (secret if is_secret_name(name) else plain)[name] = value
    return plain, secret


def read_env_file(path: str) -> dict[str, str]:
    """NAME=VALUE lines (blank lines and # comments skipped); the file must be readable by its owner only."""
    try:
        mode = os.stat(path).st_mode
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise InputError(f"--env-file {path}: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise InputError(f"--env-file {path}: mode {mode & 0o777:04o} lets others read it: chmod 600 {shlex.quote(path)}")
    out = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.removeprefix("export ").partition("=")
        name = name.strip()
        if not sep or not ENV_NAME_RE.match(name):
            raise InputError(f"--env-file {path}:{number}: expected NAME=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[name] = value
    return out


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


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
) -> list[HostLaunch]:
    if options.recipe not in RECIPES:
        raise InputError(f"--recipe {options.recipe!r}: unknown recipe (choose from: {', '.join(RECIPES)})")
    if options.rdzv not in ("static", "c10d"):
        raise InputError(f"--rdzv {options.rdzv!r}: use static or c10d")
    hosts = inventory.hosts
    if options.rdzv == "static" and len({h.slots for h in hosts}) > 1:
        raise InputError(
            f"{inventory.path}: hosts have different slots ({', '.join(f'{h.name}={h.slots}' for h in hosts)}): "
            "static rendezvous needs the same slots everywhere; use --rdzv c10d"
        )
    if len(hosts) > 1 and master_addr.startswith("127."):
        raise InputError(f"the master's address {master_addr} is a loopback address peers cannot reach: set 'iface' for the master")
    overrides = parse_overrides(options.overrides)
    launches = []
    offset = 0
    for host in hosts:
        run_dir = _join(host.workdir, "runs", run_id)
        output_dir = _join(host.workdir, "outputs", job_id)
        argv = [
            host.python, "-m", "torch.distributed.run",
            "--nnodes", str(len(hosts)),
            "--nproc-per-node", str(host.slots),
        ]
        if options.rdzv == "static":
            argv += ["--node-rank", str(host.rank), "--master-addr", master_addr, "--master-port", str(port)]
        else:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master_addr}:{port}", "--rdzv-id", job_id]
        argv += [
            "--max-restarts", "0",
            "--tee", "3",
            "--log-dir", _join(run_dir, "torchrun"),
            "-m", f"mnft.recipes.{options.recipe}",
            f"output_dir={output_dir}",
        ]
        if options.resume:
            argv.append("resume=latest")
        argv += overrides
        host_env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": host.workdir, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": RANK_TEMPLATE, **env}
        iface = host.iface or ifaces.get(host.name)
        if iface:
            host_env["NCCL_SOCKET_IFNAME"] = iface
            host_env["GLOO_SOCKET_IFNAME"] = iface
        launches.append(
            HostLaunch(
                host=host.name,
                node_rank=host.rank,
                rank_offset=offset,
                slots=host.slots,
                argv=tuple(argv),
                env=host_env,
                secret_names=secret_names,
                cwd=host.workdir,
                run_dir=run_dir,
                output_dir=output_dir,
                # static: the master is node 0, so rank 0 writes there; c10d: torch picks the ranks, so every host's
                # agent watches the file and only rank 0's host has one
                metrics=_join(output_dir, "metrics.jsonl") if options.rdzv == "c10d" or host.name == inventory.master_name else None,
            )
        )
        offset += host.slots
    return launches


def environ() -> dict[str, str]:
    return dict(os.environ)
