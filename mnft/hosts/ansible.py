"""An Ansible inventory, read as Ansible reads it: groups (`all` and its children), host ranges such as
`node[01:16]`, `host:port`, group and host variables with Ansible's precedence (all < parent < child < host);
the variables mnft understands (`ansible_host`, `ansible_port`, `ansible_user`, `ansible_ssh_private_key_file`,
`ansible_python_interpreter`, `ansible_connection`, `ansible_become`, and every mnft key as `mnft_<key>`)
translated into mnft's host settings, Ansible's own other variables accepted and listed as ignored, and near
misses of either refused as typos.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.core.yamlfile import LineMap, line_of, suggest
from mnft.hosts.settings import DEFAULT_RENDEZVOUS_PORT, HOST_KEYS, Inventory, build, perf_thresholds

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


_RANGE = re.compile(r"\[([0-9a-z]*):([0-9a-z]*)(?::([0-9]*))?\]")


def expand_host_pattern(pattern: str, limit: int = limits.HOSTS) -> list[str]:
    """Expand Ansible host ranges: `node[01:03]` -> node01 node02 node03, `r[a:c]` -> ra rb rc, strides allowed.

    Bounded: the number of names is worked out from the ranges before any is made (node[1:1000000000] is refused
    at once), and kept under `limit` while expanding; a ValueError says why."""
    if len(pattern) > limits.HOST_PATTERN_CHARS:
        raise ValueError(f"a host pattern longer than {limits.HOST_PATTERN_CHARS} characters (a limit of mnft's input)")
    estimate = 1
    for match in _RANGE.finditer(pattern):
        estimate *= _range_size(match)
        if estimate > limit:
            raise ValueError(f"expands to more than {limit} hosts (a limit of mnft's input)")
    done: list[str] = []
    pending = [pattern]
    while pending:  # each pending name becomes one host at least (an empty range is an error)
        name = pending.pop()
        match = _RANGE.search(name)
        if not match:
            done.append(name)
            continue
        if _range_size(match) + len(pending) + len(done) > limit:
            raise ValueError(f"expands to more than {limit} hosts (a limit of mnft's input)")
        head, tail = name[: match.start()], name[match.end() :]
        pending.extend(reversed([head + item + tail for item in _range_items(match)]))
    return done


def _range_bounds(match: re.Match) -> tuple[str, str, int]:
    start, end, step_text = match.group(1) or "0", match.group(2), match.group(3)
    for part in (start, end, step_text or ""):
        if len(part) > limits.NUMBER_CHARS:
            raise ValueError(f"bad host range {match.group(0)[:40]}…: a bound longer than {limits.NUMBER_CHARS} characters")
    step = int(step_text) if step_text else 1
    if not end:
        raise ValueError(f"bad host range {match.group(0)}: no end")
    if step < 1:
        raise ValueError(f"bad host range {match.group(0)}: the step must be at least 1")
    if start.isdigit() and start.startswith("0") and len(start) > 1 and len(start) != len(end):
        raise ValueError(f"bad host range {match.group(0)}: a zero-padded range has bounds of equal length (as Ansible)")
    return start, end, step


def _range_size(match: re.Match) -> int:
    start, end, step = _range_bounds(match)
    if start.isdigit() and end.isdigit():
        first, last = int(start), int(end)
    elif len(start) == 1 and len(end) == 1 and start.isalpha() and end.isalpha():
        first, last = ord(start), ord(end)
    else:
        raise ValueError(f"bad host range [{start}:{end}]")
    if last < first:
        raise ValueError(f"empty host range [{start}:{end}]")
    return (last - first) // step + 1


def _range_items(match: re.Match) -> list[str]:
    start, end, step = _range_bounds(match)
    if start.isdigit() and end.isdigit():
        width = len(start) if start.startswith("0") and len(start) > 1 else 0
        return [str(i).zfill(width) for i in range(int(start), int(end) + 1, step)]
    return [chr(c) for c in range(ord(start), ord(end) + 1, step)]


def _split_host_port(pattern: str) -> tuple[str, int | None]:
    """`gpu01:2222` -> ('gpu01', 2222), as Ansible's YAML inventory reads a port after the name (a colon inside
    a range such as node[01:04] or an IPv6 address is not a port)."""
    match = re.fullmatch(r"(.+?):(\d+)", pattern)
    if match and ":" not in re.sub(r"\[[^\]]*\]", "", match.group(1)):
        digits = match.group(2)  # thousands of digits are not converted: a number no port is, refused as a port
        return match.group(1), int(digits) if len(digits) <= limits.NUMBER_CHARS else 10**limits.NUMBER_CHARS
    return pattern, None


def parse(doc: dict, path: Path | None, where: str, first_seen: dict[str, int] | None = None, fmt: str = "ansible",
          python: str | None = None) -> Inventory:
    """An Ansible inventory as a YAML document (or the same shape read from INI by mnft.hosts.ansible_ini)."""
    raw, all_vars = hostvars(doc, where, first_seen)
    settings = [(name, _from_ansible(merged), own) for name, merged, own in raw]
    ignored = {
        name: tuple(sorted(k for k in merged if not _ansible_key_known(k)))
        for name, merged, _ in raw
        if any(not _ansible_key_known(k) for k in merged)
    }
    inv = build(
        settings,
        path,
        where,
        fmt,
        master=all_vars.get("mnft_master"),
        known_hosts=all_vars.get("mnft_known_hosts"),
        rendezvous_port=all_vars.get("mnft_rendezvous_port", DEFAULT_RENDEZVOUS_PORT),
        python=python,
    )
    return replace(inv, ignored=ignored, perf=perf_thresholds(all_vars.get("mnft_perf"), where, "mnft_perf"))


def hostvars(doc: dict, where: str, first_seen: dict[str, int] | None = None) -> tuple[list[tuple[str, dict, Any]], dict]:
    """Every host's variables as Ansible merges them ([(host, merged vars, its own vars with lines)], all's vars).
    Hosts are in order of first appearance: depth first through the document, or, when `first_seen` is given
    (host -> the line of its first appearance), in that order."""
    # Top-level keys are groups; Ansible makes every top-level group a child of 'all'.
    order: list[str] = []  # hosts in order of first appearance (node_rank order)
    host_vars: dict[str, dict] = {}
    memberships: dict[str, list[tuple[int, str]]] = {}  # host -> [(depth, group)]
    group_vars: dict[str, dict] = {}
    group_depth: dict[str, int] = {}
    host_line: dict[str, int] = {}  # where each host first appears
    var_lines: dict[tuple[str, str], dict[str, int]] = {}  # ("group"|"host", name) -> {var: line}
    visits = [0]  # groups reached by many paths are walked once per path: bounded

    def walk(group: str, body: Any, depth: int, parents: tuple[str, ...], container: Any) -> None:
        if group in parents:
            raise InputError(f"{where}{line_of(container, group)}: group {group!r} contains itself")
        visits[0] += 1 + len(parents)
        if visits[0] > limits.GROUP_VISITS:
            raise InputError(f"{where}{line_of(container, group)}: group {group!r}: the groups are reached by more than "
                             f"{limits.GROUP_VISITS} paths (a limit of mnft's input, see docs/security.md)")
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
                raise InputError(f"{where}{line_of(hosts, pattern)}: host {limits.shown(pattern)}: {exc}") from None
            visits[0] += len(names) * (1 + len(parents))
            if visits[0] > limits.GROUP_VISITS:
                raise InputError(f"{where}{line_of(hosts, pattern)}: group {group!r}: its hosts are reached by more than "
                                 f"{limits.GROUP_VISITS} paths (a limit of mnft's input, see docs/security.md)")
            for name in names:
                if name not in host_vars:
                    if len(order) >= limits.HOSTS:
                        raise InputError(f"{where}{line_of(hosts, pattern)}: more than {limits.HOSTS} hosts "
                                         "(a limit of mnft's input, see docs/security.md)")
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
    if first_seen is not None:
        order.sort(key=lambda name: first_seen.get(name, 0))

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
    return raw, all_vars


MNFT_ANSIBLE_GLOBALS = ("mnft_master", "mnft_known_hosts", "mnft_rendezvous_port", "mnft_perf")


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
