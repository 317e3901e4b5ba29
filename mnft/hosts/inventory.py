"""The inventory: which hosts take part in a job, in node_rank order, and how to reach each.

Three formats are read, detected from the content:

* mnft's own YAML: top-level `hosts` (a mapping name -> settings, in node_rank order), optional `vars`
  (defaults for every host), `master`, `known_hosts`, `rendezvous_port`;
* an Ansible YAML inventory (`all:` -> `hosts` / `vars` / `children`, host ranges such as `node[01:16]`,
  `ansible_host`, `ansible_port`, `ansible_user`, `ansible_ssh_private_key_file`,
  `ansible_python_interpreter`, `ansible_connection`; precedence all < parent < child < host);
* a DeepSpeed hostfile: one `hostname slots=N` per line, `#` comments.

Parsing is strict: an unknown key (with a suggestion), a duplicate host, a bad port, non-positive slots or an
unknown connection type is an `InputError` naming the file, line, host and key. Nothing here touches a host.
"""

from __future__ import annotations

import difflib
import getpass
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable


from mnft.core import yamlfile
from mnft.core.errors import InputError
from mnft.core.yamlfile import LineMap, line_of, suggest

DEFAULT_RENDEZVOUS_PORT = 29500
CONNECTIONS = ("ssh", "local")

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
}
HOST_KEYS = tuple(HOST_DEFAULTS)
TOP_KEYS = ("hosts", "vars", "master", "known_hosts", "rendezvous_port", "perf")
# `perf:` (mnft YAML) / `mnft_perf` (Ansible all vars): thresholds and absolute floors of `invoke check --perf`
PERF_KEYS = ("link_ratio", "compute_ratio", "rtt_ratio", "busbw_ratio", "min_link_gbps", "min_busbw_gbps", "min_tflops", "max_rtt_ms")
ANSIBLE_KEYS = {
    "ansible_host": "address",
    "ansible_ssh_host": "address",
    "ansible_port": "port",
    "ansible_ssh_port": "port",
    "ansible_user": "user",
    "ansible_ssh_user": "user",
    "ansible_ssh_private_key_file": "identity",
    "ansible_private_key_file": "identity",
    "ansible_python_interpreter": "python",
    "ansible_connection": "connection",
    "ansible_become": "become",
}
ANSIBLE_CONNECTIONS = {"ssh": "ssh", "smart": "ssh", "paramiko": "ssh", "paramiko_ssh": "ssh", "local": "local"}
# Ansible's documented connection, privilege-escalation and shell variables that mnft reads no value from: an
# existing inventory carries them, so they are accepted and listed as ignored (`invoke inventory`), never a typo.
# mnft connects with keys (~/.ssh/config, agent, identity) and its `become` is `sudo` to root, asking for the
# password itself: passwords, become_user/method and ssh argument strings are Ansible's business.
ANSIBLE_IGNORED = frozenset({
    "ansible_password", "ansible_ssh_pass", "ansible_ssh_password",
    "ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_sftp_extra_args", "ansible_scp_extra_args",
    "ansible_ssh_args", "ansible_ssh_executable", "ansible_ssh_pipelining", "ansible_pipelining",
    "ansible_ssh_transfer_method", "ansible_scp_if_ssh", "ansible_sftp_batch_mode", "ansible_ssh_retries",
    "ansible_ssh_timeout", "ansible_timeout", "ansible_connection_timeout", "ansible_command_timeout",
    "ansible_host_key_checking", "ansible_ssh_host_key_checking", "ansible_control_path", "ansible_control_path_dir",
    "ansible_ssh_use_tty", "ansible_ssh_verbosity", "ansible_ssh_host_key_algorithms",
    "ansible_become_method", "ansible_become_user", "ansible_become_pass", "ansible_become_password",
    "ansible_become_exe", "ansible_become_flags",
    "ansible_sudo", "ansible_sudo_user", "ansible_sudo_pass", "ansible_sudo_password", "ansible_sudo_exe", "ansible_sudo_flags",
    "ansible_su", "ansible_su_user", "ansible_su_pass", "ansible_su_password", "ansible_su_exe", "ansible_su_flags",
    "ansible_shell_type", "ansible_shell_executable", "ansible_remote_tmp", "ansible_async_dir",
    "ansible_module_compression", "ansible_network_os", "ansible_hostname", "ansible_distribution",
    "ansible_user_dir", "ansible_python", "ansible_facts", "ansible_play_hosts",
})
# Variables of other connection plugins (WinRM, PSRP, paramiko, network devices, containers).
ANSIBLE_IGNORED_PREFIXES = (
    "ansible_winrm_", "ansible_psrp_", "ansible_paramiko_", "ansible_libssh_", "ansible_netconf_",
    "ansible_httpapi_", "ansible_network_", "ansible_docker_", "ansible_podman_", "ansible_kubectl_",
    "ansible_lxd_", "ansible_chroot_", "ansible_jail_", "ansible_local_",
)
GROUP_KEYS = ("hosts", "vars", "children")


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

    @property
    def is_local(self) -> bool:
        return self.connection == "local"

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Inventory:
    path: Path | None
    format: str  # "mnft" | "ansible" | "hostfile"
    hosts: tuple[Host, ...]
    master_name: str
    known_hosts: Path | None = None
    rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT
    ignored: dict[str, tuple[str, ...]] = field(default_factory=dict)  # host -> user vars mnft does not use
    perf: dict[str, float] = field(default_factory=dict)  # check --perf thresholds and floors (PERF_KEYS)

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
        wanted = set(names)
        return replace(self, hosts=tuple(h for h in self.hosts if h.name in wanted))

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


# --------------------------------------------------------------------------------------------------- loading


def load(path: str | os.PathLike[str]) -> Inventory:
    """Read and validate an inventory file of any of the three formats."""
    path = Path(path)
    return parse(yamlfile.read_text(path, "inventory file", "--hosts"), path)


def parse(text: str, path: Path | None = None) -> Inventory:
    where = str(path) if path else "<inventory>"
    if _looks_like_hostfile(text) or _looks_like_a_broken_hostfile(text):
        return _parse_hostfile(text, path, where)
    doc = yamlfile.load(text, where)
    if doc is None or doc == {}:
        raise InputError(f"{where}: inventory is empty: list at least one host")
    if not isinstance(doc, dict):
        raise InputError(f"{where}: an inventory is a mapping (mnft or Ansible YAML) or a hostfile, got a {type(doc).__name__}")
    if _looks_like_ansible(doc):
        return _parse_ansible(doc, path, where)
    return _parse_mnft(doc, path, where)


def _looks_like_ansible(doc: dict) -> bool:
    """Ansible: an `all` group, or only top-level groups whose bodies use hosts/vars/children."""
    if "all" in doc:
        return True
    if any(key in TOP_KEYS for key in doc):
        return False
    return all(isinstance(body, dict) and body and set(body) <= set(GROUP_KEYS) for body in doc.values())


_HOSTFILE_LINE = re.compile(r"^\s*[A-Za-z0-9_.\-\[\]]+(\s+\S+=\S+)*\s*$")


def _looks_like_hostfile(text: str) -> bool:
    lines = [ln.split("#", 1)[0] for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    return bool(lines) and all(_HOSTFILE_LINE.match(ln) for ln in lines)


def _looks_like_a_broken_hostfile(text: str) -> bool:
    """`n1 slots = 8`: no YAML mapping or list anywhere, and a `slots` word: parse it as a hostfile so the
    error names the line instead of "an inventory is a mapping"."""
    lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    return bool(lines) and not any(":" in ln or ln[0] in "-{[" for ln in lines) and any("slots" in ln for ln in lines)


# --------------------------------------------------------------------------------------------------- mnft


def _parse_mnft(doc: dict, path: Path | None, where: str) -> Inventory:
    for key in doc:
        if key not in TOP_KEYS:
            raise InputError(f"{where}{line_of(doc, key)}: unknown top-level key {key!r}{suggest(str(key), TOP_KEYS)}")
    common = doc.get("vars") or {}
    if not isinstance(common, dict):
        raise InputError(f"{where}{line_of(doc, 'vars')}: 'vars' must be a mapping of host settings")
    _check_keys(common, where, "vars")
    hosts_doc = doc.get("hosts")
    if not hosts_doc:
        raise InputError(f"{where}: inventory is empty: 'hosts' lists no host")
    if isinstance(hosts_doc, list):
        raise InputError(f"{where}{line_of(doc, 'hosts')}: 'hosts' must be a mapping name -> settings, not a list")
    if not isinstance(hosts_doc, dict):
        raise InputError(f"{where}{line_of(doc, 'hosts')}: 'hosts' must be a mapping name -> settings")
    raw = []
    for name, settings in hosts_doc.items():
        settings = settings if settings is not None else {}
        if not isinstance(settings, dict):
            raise InputError(f"{where}{line_of(hosts_doc, name)}: host {name!r}: settings must be a mapping, got {settings!r}")
        _check_keys(settings, where, f"host {name!r}")
        raw.append((str(name), {**common, **settings}, settings))
    inv = _build(
        raw,
        path,
        where,
        "mnft",
        master=doc.get("master"),
        known_hosts=doc.get("known_hosts"),
        rendezvous_port=doc.get("rendezvous_port", DEFAULT_RENDEZVOUS_PORT),
    )
    return replace(inv, perf=_perf(doc.get("perf"), f"{where}{line_of(doc, 'perf') if 'perf' in doc else ''}", "perf"))


def _check_keys(settings: dict, where: str, what: str) -> None:
    for key in settings:
        if key not in HOST_KEYS:
            hint = suggest(str(key), HOST_KEYS)
            if not hint and str(key).startswith("ansible_"):
                hint = " (this file is read as mnft YAML; an Ansible inventory starts with 'all:')"
            raise InputError(f"{where}{line_of(settings, key)}: {what}: unknown key {key!r}{hint}")


# --------------------------------------------------------------------------------------------------- ansible


_RANGE = re.compile(r"\[([0-9a-z]+):([0-9a-z]+)(?::([0-9]+))?\]")


def expand_host_pattern(pattern: str) -> list[str]:
    """Expand Ansible host ranges: `node[01:03]` -> node01 node02 node03, `r[a:c]` -> ra rb rc, strides allowed."""
    match = _RANGE.search(pattern)
    if not match:
        return [pattern]
    start, end, step = match.group(1), match.group(2), int(match.group(3) or 1)
    head, tail = pattern[: match.start()], pattern[match.end() :]
    if start.isdigit() and end.isdigit():
        width = len(start) if start.startswith("0") and len(start) > 1 else 0
        items = [str(i).zfill(width) for i in range(int(start), int(end) + 1, step)]
    elif len(start) == 1 and len(end) == 1 and start.isalpha() and end.isalpha():
        items = [chr(c) for c in range(ord(start), ord(end) + 1, step)]
    else:
        raise ValueError(f"bad host range [{start}:{end}]")
    if not items:
        raise ValueError(f"empty host range [{start}:{end}]")
    return [name for item in items for name in expand_host_pattern(head + item + tail)]


def _split_host_port(pattern: str) -> tuple[str, int | None]:
    """`gpu01:2222` -> ('gpu01', 2222), as Ansible's YAML inventory reads a port after the name (a colon inside
    a range such as node[01:04] or an IPv6 address is not a port)."""
    match = re.fullmatch(r"(.+?):(\d+)", pattern)
    if match and ":" not in re.sub(r"\[[^\]]*\]", "", match.group(1)):
        return match.group(1), int(match.group(2))
    return pattern, None


def _parse_ansible(doc: dict, path: Path | None, where: str) -> Inventory:
    # Top-level keys are groups; Ansible makes every top-level group a child of 'all'.
    order: list[str] = []  # hosts in order of first appearance (node_rank order)
    host_vars: dict[str, dict] = {}
    memberships: dict[str, list[tuple[int, str]]] = {}  # host -> [(depth, group)]
    group_vars: dict[str, dict] = {}
    group_depth: dict[str, int] = {}
    host_line: dict[str, int] = {}  # where each host first appears
    var_lines: dict[tuple[str, str], dict[str, int]] = {}  # ("group"|"host", name) -> {var: line}

    def walk(group: str, body: Any, depth: int, parents: tuple[str, ...], container: Any) -> None:
        if group in parents:
            raise InputError(f"{where}{line_of(container, group)}: group {group!r} contains itself")
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InputError(f"{where}{line_of(container, group)}: group {group!r} must be a mapping of hosts/vars/children")
        for key in body:
            if key not in GROUP_KEYS:
                raise InputError(f"{where}{line_of(body, key)}: group {group!r}: unknown key {key!r}{suggest(str(key), GROUP_KEYS)}")
        group_depth[group] = max(group_depth.get(group, 0), depth)
        gvars = body.get("vars") or {}
        if not isinstance(gvars, dict):
            raise InputError(f"{where}{line_of(body, 'vars')}: group {group!r}: 'vars' must be a mapping")
        group_vars.setdefault(group, {}).update(gvars)
        var_lines.setdefault(("group", group), {}).update(getattr(gvars, "key_lines", {}))
        _check_ansible_vars(gvars, where, f"group {group!r}")
        hosts = body.get("hosts") or {}
        if not isinstance(hosts, dict):
            raise InputError(f"{where}{line_of(body, 'hosts')}: group {group!r}: 'hosts' must be a mapping name -> vars")
        for pattern, hvars in hosts.items():
            hvars = hvars if hvars is not None else {}
            if not isinstance(hvars, dict):
                raise InputError(f"{where}{line_of(hosts, pattern)}: host {pattern!r}: vars must be a mapping, got {hvars!r}")
            _check_ansible_vars(hvars, where, f"host {pattern!r}")
            bare, port = _split_host_port(str(pattern))
            if port is not None and not any(k in hvars for k in ("ansible_port", "ansible_ssh_port", "port", "mnft_port")):
                lines = getattr(hvars, "key_lines", None)
                hvars = LineMap({**hvars, "ansible_port": port})  # `host:2222`, as Ansible reads it
                hvars.line, hvars.key_lines = getattr(hosts, "key_lines", {}).get(pattern, 0), dict(lines or {})
                hvars.key_lines["ansible_port"] = hvars.line
            try:
                names = expand_host_pattern(bare)
            except ValueError as exc:
                raise InputError(f"{where}{line_of(hosts, pattern)}: host {pattern!r}: {exc}") from None
            for name in names:
                if name not in host_vars:
                    order.append(name)
                    host_vars[name] = {}
                    host_line[name] = getattr(hosts, "key_lines", {}).get(pattern, 0)
                host_vars[name].update(hvars)
                var_lines.setdefault(("host", name), {}).update(getattr(hvars, "key_lines", {}))
                memberships.setdefault(name, []).extend((group_depth[p], p) for p in (*parents, group))
        children = body.get("children") or {}
        if not isinstance(children, dict):
            raise InputError(f"{where}{line_of(body, 'children')}: group {group!r}: 'children' must be a mapping of groups")
        for child, child_body in children.items():
            walk(str(child), child_body, depth + 1, (*parents, group), children)

    if "all" in doc:
        walk("all", doc["all"], 0, (), doc)
    for group, body in doc.items():
        if group != "all":
            group_depth.setdefault("all", 0)
            walk(str(group), body, 1, ("all",), doc)
    if not order:
        raise InputError(f"{where}: inventory is empty: no group lists a host")

    raw = []
    all_vars = group_vars.get("all", {})
    for name in order:
        merged: dict[str, Any] = {}
        lines: dict[str, int] = {}
        groups = sorted(set(memberships[name]), key=lambda dg: (group_depth[dg[1]], dg[1]))
        for _, group in groups:
            merged.update(group_vars.get(group, {}))
            lines.update(var_lines.get(("group", group), {}))
        merged.update(host_vars[name])
        lines.update(var_lines.get(("host", name), {}))
        own = LineMap(host_vars[name])
        own.line = host_line.get(name, 0)
        own.key_lines = {_mnft_key(var): line for var, line in lines.items() if _mnft_key(var)}
        if not own.line:
            own = host_vars[name]
        raw.append((name, merged, own))
    settings = [(name, _from_ansible(merged), own) for name, merged, own in raw]
    ignored = {
        name: tuple(sorted(k for k in merged if not _ansible_key_known(k)))
        for name, merged, _ in raw
        if any(not _ansible_key_known(k) for k in merged)
    }
    inv = _build(
        settings,
        path,
        where,
        "ansible",
        master=all_vars.get("mnft_master"),
        known_hosts=all_vars.get("mnft_known_hosts"),
        rendezvous_port=all_vars.get("mnft_rendezvous_port", DEFAULT_RENDEZVOUS_PORT),
    )
    return replace(inv, ignored=ignored, perf=_perf(all_vars.get("mnft_perf"), where, "mnft_perf"))


MNFT_ANSIBLE_GLOBALS = ("mnft_master", "mnft_known_hosts", "mnft_rendezvous_port", "mnft_perf")


def _perf(value: Any, where: str, key: str) -> dict[str, float]:
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


def _ansible_key_known(key: str) -> bool:
    return key in ANSIBLE_KEYS or key in HOST_KEYS or key.removeprefix("mnft_") in HOST_KEYS or key in MNFT_ANSIBLE_GLOBALS


def _ansible_own(key: str) -> bool:
    """One of Ansible's documented variables that mnft does not use."""
    return key in ANSIBLE_IGNORED or key.startswith(ANSIBLE_IGNORED_PREFIXES) or (key.startswith("ansible_") and key.endswith("_interpreter"))


def _check_ansible_vars(variables: dict, where: str, what: str) -> None:
    """Ansible inventories carry vars for other tools, so unknown names are kept aside, except near-misses of
    mnft's own keys (`slot`, `mnft_iface_name`) and of the ansible_* names mnft reads (`ansible_prot`): those
    are typos that would silently change a job. Ansible's own documented variables are never suspects."""
    mnft_names = [*HOST_KEYS, *(f"mnft_{k}" for k in HOST_KEYS), *MNFT_ANSIBLE_GLOBALS]
    for key in variables:
        key = str(key)
        if _ansible_key_known(key) or _ansible_own(key):
            continue
        if key.startswith("mnft_"):
            raise InputError(f"{where}{line_of(variables, key)}: {what}: unknown key {key!r}{suggest(key, mnft_names)}")
        if key.startswith("ansible_"):
            close = difflib.get_close_matches(key, list(ANSIBLE_KEYS), n=1, cutoff=0.9)
        else:
            close = difflib.get_close_matches(key, mnft_names, n=1, cutoff=0.8)
        if close:
            raise InputError(f"{where}{line_of(variables, key)}: {what}: unknown key {key!r} (did you mean {close[0]!r}?)")


def _mnft_key(var: str) -> str | None:
    """The mnft setting an Ansible variable sets, if any."""
    if var in ANSIBLE_KEYS:
        return ANSIBLE_KEYS[var]
    bare = str(var).removeprefix("mnft_")
    return bare if bare in HOST_KEYS else None


def _from_ansible(merged: dict) -> dict:
    out: dict[str, Any] = {}
    for key, value in merged.items():
        if key in ANSIBLE_KEYS:
            target = ANSIBLE_KEYS[key]
            if target == "connection" and isinstance(value, str):
                value = ANSIBLE_CONNECTIONS.get(value, value)
            out[target] = value
    for key, value in merged.items():  # mnft's own names win over ansible_* ones
        bare = key.removeprefix("mnft_")
        if bare in HOST_KEYS:
            out[bare] = value
    return out


# --------------------------------------------------------------------------------------------------- hostfile


def _parse_hostfile(text: str, path: Path | None, where: str) -> Inventory:
    raw = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        if name in seen:
            raise InputError(f"{where}:{number}: host {name!r}: duplicate host (first on line {seen[name]})")
        seen[name] = number
        settings = LineMap()
        settings.line, settings.key_lines = number, {"slots": number}
        if any("=" in option for option in options) and not all(re.match(r"^[^=]+=[^=]+$", o) for o in options):
            raise InputError(f"{where}:{number}: host {name!r}: write 'slots=N' with no spaces around '=' (a hostfile line is 'hostname slots=N')")
        for option in options:
            key, _, value = option.partition("=")
            if key != "slots":
                raise InputError(f"{where}:{number}: host {name!r}: unknown key {key!r}{suggest(key, ['slots'])} (a hostfile line is 'hostname slots=N')")
            try:
                settings["slots"] = int(value)
            except ValueError:
                raise InputError(f"{where}:{number}: host {name!r}: key 'slots': {value!r} is not a whole number") from None
        raw.append((name, settings, settings))
    if not raw:
        raise InputError(f"{where}: inventory is empty: the hostfile lists no host")
    return _build(raw, path, where, "hostfile", master=None, known_hosts=None, rendezvous_port=DEFAULT_RENDEZVOUS_PORT)


# --------------------------------------------------------------------------------------------------- validation


def _build(
    raw: list[tuple[str, dict, dict]],
    path: Path | None,
    where: str,
    fmt: str,
    *,
    master: Any,
    known_hosts: Any,
    rendezvous_port: Any,
) -> Inventory:
    hosts = []
    seen_names: set[str] = set()
    seen_targets: dict[tuple, str] = {}
    for rank, (name, settings, own) in enumerate(raw):
        if name in seen_names:
            raise InputError(f"{where}: host {name!r}: duplicate host")
        seen_names.add(name)
        host = _validate_host(name, rank, settings, own, where)
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
    port = _port(rendezvous_port, where, "inventory", "rendezvous_port")
    kh = None
    if known_hosts is not None:
        if not isinstance(known_hosts, str) or not known_hosts:
            raise InputError(f"{where}: key 'known_hosts': expected a file path, got {known_hosts!r}")
        kh = Path(known_hosts).expanduser()
        if not kh.is_absolute() and path is not None:
            kh = path.parent / kh
    return Inventory(path, fmt, tuple(hosts), master_name, kh, port)


def _port(value: Any, where: str, what: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"{where}: {what}: key {key!r}: {value!r} is not a port number (1-65535)")
    try:
        port = int(value)
    except ValueError:
        raise InputError(f"{where}: {what}: key {key!r}: {value!r} is not a port number (1-65535)") from None
    if not 1 <= port <= 65535:
        raise InputError(f"{where}: {what}: key {key!r}: {value!r} is not a port number (1-65535)")
    return port


# A host name is a label, but it also becomes a `Host` line of ssh_config and a name in /etc/hosts: a DNS name
# or alias, nothing ssh_config reads as a pattern (`*`, `?`, `!`), no white space or quotes, no leading '-'.
HOST_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$")
# An address is a host name or an IPv4/IPv6 address (an IPv6 zone such as fe80::1%eth0 included).
ADDRESS = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:%-]{0,252}$")
# Processes per node: GPUs per server (8, 16) or CPU processes; beyond this a value is a typo, not a machine.
MAX_SLOTS = 1024
# A Linux interface name (IFNAMSIZ: at most 15 characters): it is written into nftables rules loaded as root.
IFACE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


def _validate_host(name: str, rank: int, settings: dict, own: dict, where: str) -> Host:
    what = f"host {name!r}"
    line = line_of(own)
    loc = f"{where}{line}"
    if not HOST_NAME.match(name):
        raise InputError(
            f"{loc}: {what}: not a valid host name (letters, digits, '.', '_', '-', not starting with '-'; "
            f"no white space, quotes, shell or ssh_config pattern characters)"
        )
    values = {**HOST_DEFAULTS, **{k: v for k, v in settings.items() if v is not None}}

    def at(key: str) -> str:  # file:line where the key's value was set, else of the host
        return f"{where}{line_of(own, key) if key in getattr(own, 'key_lines', {}) else line}"

    def text(key: str, allow_none: bool = True) -> str | None:
        value = values[key]
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
            raise InputError(f"{loc}: {what}: key {key!r}: expected text, got {value!r}")
        if "\n" in str(value) or "\x00" in str(value):
            raise InputError(f"{loc}: {what}: key {key!r}: must be a single line")
        return str(value)

    def flag(key: str) -> bool:
        value = values[key]
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("yes", "true", "no", "false"):
            return value.lower() in ("yes", "true")
        raise InputError(f"{loc}: {what}: key {key!r}: expected true or false, got {value!r}")

    connection = values["connection"]
    if connection not in CONNECTIONS:
        raise InputError(f"{at('connection')}: {what}: key 'connection': unknown connection type {connection!r} (use one of: {', '.join(CONNECTIONS)})")
    slots = values["slots"]
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise InputError(f"{at('slots')}: {what}: key 'slots': {slots!r} must be a whole number from 1 to {MAX_SLOTS} (processes on this node)")
    port = None if values["port"] is None else _port(values["port"], at("port"), what, "port")
    address = text("address") or name
    if address.startswith("-"):
        raise InputError(f"{at('address')}: {what}: key 'address': {address!r} must not start with '-'")
    if not ADDRESS.match(address):
        raise InputError(f"{at('address')}: {what}: key 'address': {address!r} is not a host name or IP address")
    iface = text("iface")
    if iface is not None and not IFACE.match(iface):
        raise InputError(f"{at('iface')}: {what}: key 'iface': {iface!r} is not a network interface name (at most 15 of A-Z a-z 0-9 _ . : @ -)")
    user = text("user")
    venv = values["venv"]
    if venv is False or (isinstance(venv, str) and venv.strip().lower() in ("none", "false", "no")):
        venv = None
    else:
        venv = text("venv", allow_none=False)
        if not (venv.startswith("/") or venv.startswith("~/")) or venv.rstrip("/") in ("", "~"):
            raise InputError(f"{at('venv')}: {what}: key 'venv': {venv!r} must be an absolute path or start with '~/' (or be none)")
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
    )
