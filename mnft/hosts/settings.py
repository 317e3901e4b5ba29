"""One host's settings: the keys, their defaults and how each value is validated; the `Host` and `Inventory`
values every other module reads. Validation is whole: a value that reaches a command, ~/.ssh/config or
/etc/hosts (a name, an address, an interface) is checked here, with the file and line it came from.
"""

from __future__ import annotations

import getpass
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.core.yamlfile import line_of, suggest

DEFAULT_RENDEZVOUS_PORT = 29500
CONNECTIONS = ("ssh", "local")
DEVICES = ("gpu", "cpu")  # a host's `device:` (None: what it has)
CONTAINER_RUNTIMES = ("podman", "docker", "apptainer", "singularity")  # mnft.image.runtime.RUNTIMES

# Per-host settings, their defaults, and how a value is checked. `None` means "not set": ssh config or the
# runtime decides (user -> ~/.ssh/config or the current user, iface -> detected from the route to the master).
HOST_DEFAULTS: dict[str, Any] = {
    "address": None,
    "user": None,
    "port": None,
    "identity": None,
    "python": "python3",
    "slots": 1,
    "iface": None,
    "workdir": "~/mnft",
    "data_dir": "~/mnft-data",
    "connection": "ssh",
    "shared_fs": False,
    "become": False,
    "venv": "~/mnft-env",  # where `invoke provision` keeps the environment (a link); "none": never provisioned
    "spare": False,  # checked and synced with the others, but trains only when `train --max-restarts` replaces a lost host
    "container_runtime": None,  # an image's runtime: podman | docker | apptainer | singularity | an absolute path; None: found on the host
    "device": None,  # what torch trains on: None (its GPUs where nvidia-smi lists any, else its CPUs) | cpu (meant to train on its CPUs)
}
HOST_KEYS = tuple(HOST_DEFAULTS)
# `perf:` (mnft YAML) / `mnft_perf` (Ansible all vars): thresholds and absolute floors of `invoke check --perf`
PERF_KEYS = ("link_ratio", "compute_ratio", "rtt_ratio", "busbw_ratio", "min_link_gbps", "min_busbw_gbps", "min_tflops", "max_rtt_ms")


@dataclass(frozen=True)
class Host:
    """One host of the job, as the inventory says it (values not given are None or the default)."""

    name: str
    rank: int
    address: str
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    python: str = "python3"
    slots: int = 1
    iface: str | None = None
    workdir: str = "~/mnft"
    data_dir: str = "~/mnft-data"
    connection: str = "ssh"
    shared_fs: bool = False
    become: bool = False
    venv: str | None = "~/mnft-env"
    base_python: str | None = None  # set when `python` is the provisioned environment's: the inventory's own python
    spare: bool = False
    container_runtime: str | None = None  # None: the first of CONTAINER_RUNTIMES the host has (mnft.onhost.imagehost)
    device: str | None = None  # "cpu": jobs here train on the CPUs, a CPU-only torch beside GPUs is meant (check's rule)

    @property
    def is_local(self) -> bool:
        return self.connection == "local"

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Inventory:
    path: Path | None
    format: str  # "mnft" | "ansible" | "ansible-ini" | "hostfile"
    hosts: tuple[Host, ...]
    master_name: str
    known_hosts: Path | None = None
    rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT
    ignored: dict[str, tuple[str, ...]] = field(default_factory=dict)  # host -> user vars mnft does not use
    perf: dict[str, float] = field(default_factory=dict)  # check --perf thresholds and floors (PERF_KEYS)
    supervisor: Host | None = None  # `supervisor:` where a detached run's supervisor lives (None: the master; mnft.run.supervisor)

    @property
    def master(self) -> Host:
        return self.host(self.master_name)

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.hosts)

    def only(self, names: Iterable[str]) -> "Inventory":
        """The inventory cut to these hosts (its own order kept); the master stays when it is one of them, else
        the first of them takes its place (a `--nodes` pick that leaves the master out runs on a master it has)."""
        wanted = set(names)
        hosts = tuple(h for h in self.hosts if h.name in wanted)
        master = self.master_name if self.master_name in wanted or not hosts else hosts[0].name
        return replace(self, hosts=hosts, master_name=master)

    @property
    def spares(self) -> tuple[Host, ...]:
        return tuple(h for h in self.hosts if h.spare)

    def gang(self, names: Iterable[str] | None = None) -> "Inventory":
        """The hosts that train, in this order (default: every host but the spares), each ranked by its position
        here; the master stays when it is one of them, else the first takes its place."""
        order = list(names) if names is not None else [h.name for h in self.hosts if not h.spare]
        hosts = tuple(replace(self.host(n), rank=i) for i, n in enumerate(order))
        master = self.master_name if self.master_name in order else order[0]
        return replace(self, hosts=hosts, master_name=master)


def build(
    raw: list[tuple[str, dict, dict]],
    path: Path | None,
    where: str,
    fmt: str,
    *,
    master: Any,
    known_hosts: Any,
    rendezvous_port: Any,
    python: str | None = None,
    supervisor: Any = None,
) -> Inventory:
    """The inventory from each host's merged and own settings. `python`: the interpreter of a host that names none
    (default: HOST_DEFAULTS' python3)."""
    if len(raw) > limits.HOSTS:
        raise InputError(f"{where}: more than {limits.HOSTS} hosts (a limit of mnft's input, see docs/security.md)")
    hosts = []
    seen_names: set[str] = set()
    seen_targets: dict[tuple, str] = {}
    for rank, (name, settings, own) in enumerate(raw):
        if name in seen_names:
            raise InputError(f"{where}: host {name!r}: duplicate host")
        seen_names.add(name)
        host = validate_host(name, rank, settings, own, where, python=python)
        target = (host.address, host.port or 22, host.user) if not host.is_local else ("local", host.name)
        if target in seen_targets:
            raise InputError(
                f"{where}: host {name!r}: duplicate host: same address, port and user as {seen_targets[target]!r}"
            )
        seen_targets[target] = name
        hosts.append(host)
    if master is None:
        master_name = next((h.name for h in hosts if not h.spare), hosts[0].name)
    elif str(master) in seen_names:
        master_name = str(master)
    else:
        raise InputError(f"{where}: key 'master': {master!r} is not a host of this inventory{suggest(str(master), seen_names)}")
    if all(h.spare for h in hosts):
        raise InputError(f"{where}: every host is a spare (spare: true): at least one must train")
    if next(h for h in hosts if h.name == master_name).spare:
        raise InputError(f"{where}: key 'master': {master_name!r} is a spare; the master trains from the start (set spare: false, or choose another master)")
    port = port_number(rendezvous_port, where, "inventory", "rendezvous_port")
    kh = None
    if known_hosts is not None:
        if not isinstance(known_hosts, str) or not known_hosts:
            raise InputError(f"{where}: key 'known_hosts': expected a file path, got {known_hosts!r}")
        kh = Path(known_hosts).expanduser()
        if not kh.is_absolute() and path is not None:
            kh = path.parent / kh
    return Inventory(path, fmt, tuple(hosts), master_name, kh, port, supervisor=supervisor_host(supervisor, hosts, where, python))


def supervisor_host(value: Any, hosts: list[Host], where: str, python: str | None) -> Host | None:
    """`supervisor:` a host of the inventory by name, or a host of its own (a login or head node that does not
    train: address, user, port, identity, python), where detached runs' supervisors live."""
    if value is None:
        return None
    if isinstance(value, str):
        for host in hosts:
            if host.name == value:
                return host
        raise InputError(f"{where}: key 'supervisor': {value!r} is not a host of this inventory{suggest(value, [h.name for h in hosts])} "
                         "(or give a host of its own: supervisor: {name: login, address: …})")
    if not isinstance(value, dict):
        raise InputError(f"{where}: key 'supervisor': expected a host's name or a mapping (name, address, user, port, identity, python)")
    allowed = ("name", "address", "user", "port", "identity", "python")
    for key in value:
        if key not in allowed:
            raise InputError(f"{where}: key 'supervisor': unknown key {key!r}{suggest(str(key), allowed)}")
    settings = {k: v for k, v in value.items() if k != "name"}
    return validate_host(str(value.get("name") or "supervisor"), -1, settings, value, f"{where}: supervisor", python=python)


def port_number(value: Any, where: str, what: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"{where}: {what}: key {key!r}: {limits.shown(value)} is not a port number (1-65535)")
    try:
        port = int(value) if len(str(value)) <= limits.NUMBER_CHARS else 0
    except ValueError:
        raise InputError(f"{where}: {what}: key {key!r}: {limits.shown(value)} is not a port number (1-65535)") from None
    if not 1 <= port <= 65535:
        raise InputError(f"{where}: {what}: key {key!r}: {limits.shown(value)} is not a port number (1-65535)")
    return port


# A host name is a label, but it also becomes a `Host` line of ssh_config and a name in /etc/hosts: a DNS name
# or alias, nothing ssh_config reads as a pattern (`*`, `?`, `!`), no white space or quotes, no leading '-'.
HOST_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$")

# An address is a host name or an IPv4/IPv6 address (an IPv6 zone such as fe80::1%eth0 included).
ADDRESS = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:%-]{0,252}$")

# A login name: it becomes `User` in ~/.ssh/config and the user part of user@host. POSIX names and the usual lab
# extensions (dots, '@' of a domain account, a trailing '$'); no white space, quotes, '#' or leading '-'.
USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,127}\$?")

# Processes per node: GPUs per server (8, 16) or CPU processes; beyond this a value is a typo, not a machine.
MAX_SLOTS = 1024

# A Linux interface name (IFNAMSIZ: at most 15 characters): it is written into nftables rules loaded as root.
IFACE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


def validate_host(name: str, rank: int, settings: dict, own: dict, where: str, python: str | None = None) -> Host:
    what = f"host {name!r}"
    line = line_of(own)
    loc = f"{where}{line}"
    if not isinstance(name, str) or not HOST_NAME.fullmatch(name):
        what = f"host {limits.shown(name)}"
        raise InputError(
            f"{loc}: {what}: not a valid host name (letters, digits, '.', '_', '-', not starting with '-'; "
            f"no white space, quotes, shell or ssh_config pattern characters)"
        )
    values = {**HOST_DEFAULTS, **({"python": python} if python else {}), **{k: v for k, v in settings.items() if v is not None}}

    def at(key: str) -> str:  # file:line where the key's value was set, else of the host
        return f"{where}{line_of(own, key) if key in getattr(own, 'key_lines', {}) else line}"

    def text(key: str, allow_none: bool = True) -> str | None:
        value = values[key]
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
            raise InputError(f"{at(key)}: {what}: key {key!r}: expected text, got {limits.shown(value)}")
        if any(ord(c) < 32 or ord(c) == 127 for c in str(value)):  # a newline, NUL, escape…: it would reach a file or a command
            raise InputError(f"{at(key)}: {what}: key {key!r}: {limits.shown(str(value))} must be a single line without control characters")
        return str(value)

    def flag(key: str) -> bool:
        value = values[key]
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("yes", "true", "no", "false"):
            return value.lower() in ("yes", "true")
        raise InputError(f"{at(key)}: {what}: key {key!r}: expected true or false, got {limits.shown(value)}")

    connection = values["connection"]
    if connection not in CONNECTIONS:
        raise InputError(f"{at('connection')}: {what}: key 'connection': unknown connection type {limits.shown(connection)} (use one of: {', '.join(CONNECTIONS)})")
    slots = values["slots"]
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise InputError(f"{at('slots')}: {what}: key 'slots': {limits.shown(slots)} must be a whole number from 1 to {MAX_SLOTS} (processes on this node)")
    port = None if values["port"] is None else port_number(values["port"], at("port"), what, "port")
    address = text("address") or name
    if address.startswith("-"):
        raise InputError(f"{at('address')}: {what}: key 'address': {limits.shown(address)} must not start with '-'")
    if not ADDRESS.fullmatch(address):
        raise InputError(f"{at('address')}: {what}: key 'address': {limits.shown(address)} is not a host name or IP address")
    iface = text("iface")
    if iface is not None and not IFACE.fullmatch(iface):
        raise InputError(f"{at('iface')}: {what}: key 'iface': {limits.shown(iface)} is not a network interface name (at most 15 of A-Z a-z 0-9 _ . : @ -)")
    user = text("user")
    if user is not None and not USER.fullmatch(user):
        hint = (" (a comment after a value in a [group:vars] section is part of the value, as Ansible reads it: put"
                " the comment on its own line)" if " #" in user or " ;" in user else "")
        raise InputError(f"{at('user')}: {what}: key 'user': {limits.shown(user)} is not a login name (letters, digits, "
                         f"'.', '_', '-', '@', not starting with '-'){hint}")
    venv = values["venv"]
    if venv is False or (isinstance(venv, str) and venv.strip().lower() in ("none", "false", "no")):
        venv = None
    else:
        venv = text("venv", allow_none=False)
        if not (venv.startswith("/") or venv.startswith("~/")) or venv.rstrip("/") in ("", "~"):
            raise InputError(f"{at('venv')}: {what}: key 'venv': {venv!r} must be an absolute path or start with '~/' (or be none)")
    runtime = text("container_runtime")
    if runtime is not None and runtime not in CONTAINER_RUNTIMES and not (runtime.startswith("/") and len(runtime) > 1):
        raise InputError(f"{at('container_runtime')}: {what}: key 'container_runtime': {limits.shown(runtime)} is not a container runtime "
                         f"(use one of {', '.join(CONTAINER_RUNTIMES)}, or the absolute path of one)")
    device = text("device")
    if device is not None and device not in DEVICES:
        raise InputError(f"{at('device')}: {what}: key 'device': {limits.shown(device)} is not a device (use one of: {', '.join(DEVICES)}; "
                         "leave it out for what the host has)")
    if connection == "local":
        address = "localhost" if values["address"] is None else address
        user = user or getpass.getuser()
    return Host(
        name=name,
        rank=rank,
        address=address,
        user=user,
        port=port,
        identity=text("identity"),
        python=text("python", allow_none=False) or "python3",
        slots=slots,
        iface=iface,
        workdir=text("workdir", allow_none=False) or "~/mnft",
        data_dir=text("data_dir", allow_none=False) or "~/mnft-data",
        connection=connection,
        shared_fs=flag("shared_fs"),
        become=flag("become"),
        venv=venv,
        spare=flag("spare"),
        container_runtime=runtime,
        device=device,
    )


def perf_thresholds(value: Any, where: str, key: str) -> dict[str, float]:
    """The perf check's thresholds: a mapping of PERF_KEYS to numbers > 0 (None: the defaults)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: key {key!r}: expected a mapping of {', '.join(PERF_KEYS)}")
    out = {}
    for name, number in value.items():
        if name not in PERF_KEYS:
            raise InputError(f"{where}: key {key!r}: unknown key {name!r}{suggest(str(name), PERF_KEYS)} (known: {', '.join(PERF_KEYS)})")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or number != number or number <= 0:
            raise InputError(f"{where}: key {key}.{name}: {number!r} must be a number > 0")
        out[str(name)] = float(number)
    return out
