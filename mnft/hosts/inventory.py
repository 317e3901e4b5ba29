"""The inventory: which hosts take part in a job, in node_rank order, and how to reach each.

Four formats are read, detected from the content:

* mnft's own YAML: top-level `hosts` (a mapping name -> settings, in node_rank order), optional `vars`
  (defaults for every host), `master`, `known_hosts`, `rendezvous_port`, `supervisor` (where detached runs are supervised);
* an Ansible YAML inventory (`all:` -> `hosts` / `vars` / `children`, host ranges such as `node[01:16]`,
  `ansible_host`, `ansible_port`, `ansible_user`, `ansible_ssh_private_key_file`,
  `ansible_python_interpreter`, `ansible_connection`; precedence all < parent < child < host);
* an Ansible INI inventory (Ansible's default, `/etc/ansible/hosts`: `[group]`, `[group:vars]`,
  `[group:children]`, `host ansible_host=… ansible_user=…`), read by `ansible_ini` into the YAML form's shape;
* a DeepSpeed hostfile: one `hostname slots=N` per line, `#` comments.

Every file is read within the limits of mnft.core.limits (size, line length, YAML nesting and aliases, integer
length, hosts after ranges): past one, one line naming the file and the limit.

Parsing is strict: an unknown key (with a suggestion), a duplicate host, a bad port, non-positive slots or an
unknown connection type is an `InputError` naming the file, line, host and key. Nothing here touches a host.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from mnft.core import limits, yamlfile
from mnft.core.errors import InputError
from mnft.core.yamlfile import LineMap, line_of, suggest
from mnft.hosts import ansible, ansible_ini
from mnft.hosts.settings import DEFAULT_RENDEZVOUS_PORT, HOST_KEYS, Inventory, build, perf_thresholds

TOP_KEYS = ("hosts", "vars", "master", "known_hosts", "rendezvous_port", "perf", "supervisor")


# --------------------------------------------------------------------------------------------------- loading


def load(path: str | os.PathLike[str], *, python: str | None = None) -> Inventory:
    """Read and validate an inventory file of any of the four formats. `python`: the interpreter of every host
    that names none (default: `python3` on the host's PATH; the embedded local inventory's is the one running mnft)."""
    path = Path(path)
    return parse(yamlfile.read_text(path, "inventory file", "--hosts", limits.INVENTORY_BYTES), path, python=python)


def parse(text: str, path: Path | None = None, *, python: str | None = None) -> Inventory:
    where = str(path) if path else "<inventory>"
    limits.check_lines(text, where)
    if ansible_ini.looks_like_ini(text):
        return ansible_ini.parse(text, path, where, python=python)
    if _looks_like_hostfile(text) or _looks_like_a_broken_hostfile(text):
        return _parse_hostfile(text, path, where, python)
    doc = yamlfile.load(text, where)
    if doc is None or doc == {}:
        raise InputError(f"{where}: inventory is empty: list at least one host")
    if not isinstance(doc, dict):
        raise InputError(f"{where}: an inventory is a mapping (mnft or Ansible YAML) or a hostfile, got a {type(doc).__name__}")
    if _looks_like_ansible(doc):
        return ansible.parse(doc, path, where, python=python)
    return _parse_mnft(doc, path, where, python)


def _looks_like_ansible(doc: dict) -> bool:
    """Ansible: an `all` group, or only top-level groups whose bodies use hosts/vars/children."""
    if "all" in doc:
        return True
    if any(key in TOP_KEYS for key in doc):
        return False
    return all(isinstance(body, dict) and body and set(body) <= set(ansible.GROUP_KEYS) for body in doc.values())


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


def _parse_mnft(doc: dict, path: Path | None, where: str, python: str | None) -> Inventory:
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
    inv = build(
        raw,
        path,
        where,
        "mnft",
        master=doc.get("master"),
        known_hosts=doc.get("known_hosts"),
        rendezvous_port=doc.get("rendezvous_port", DEFAULT_RENDEZVOUS_PORT),
        python=python,
        supervisor=_supervisor_with_vars(doc.get("supervisor"), common),
    )
    return replace(inv, perf=perf_thresholds(doc.get("perf"), f"{where}{line_of(doc, 'perf') if 'perf' in doc else ''}", "perf"))


def _check_keys(settings: dict, where: str, what: str) -> None:
    for key in settings:
        if key not in HOST_KEYS:
            hint = suggest(str(key), HOST_KEYS)
            if not hint and str(key).startswith("ansible_"):
                hint = " (this file is read as mnft YAML; an Ansible inventory starts with 'all:')"
            raise InputError(f"{where}{line_of(settings, key)}: {what}: unknown key {key!r}{hint}")


# --------------------------------------------------------------------------------------------------- hostfile


def _parse_hostfile(text: str, path: Path | None, where: str, python: str | None) -> Inventory:
    raw = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        if name in seen:
            raise InputError(f"{where}:{number}: host {limits.shown(name)}: duplicate host (first on line {seen[name]})")
        seen[name] = number
        if len(seen) > limits.HOSTS:
            raise InputError(f"{where}:{number}: more than {limits.HOSTS} hosts (a limit of mnft's input, see docs/security.md)")
        settings = LineMap()
        settings.line, settings.key_lines = number, {"slots": number}
        if any("=" in option for option in options) and not all(re.fullmatch(r"[^=]+=[^=]+", o) for o in options):
            raise InputError(f"{where}:{number}: host {name!r}: write 'slots=N' with no spaces around '=' (a hostfile line is 'hostname slots=N')")
        for option in options:
            key, _, value = option.partition("=")
            if key != "slots":
                raise InputError(f"{where}:{number}: host {name!r}: unknown key {key!r}{suggest(key, ['slots'])} (a hostfile line is 'hostname slots=N')")
            limits.integer_text(value, f"{where}:{number}: host {limits.shown(name)}: key 'slots'")
            try:
                settings["slots"] = int(value)
            except ValueError:
                raise InputError(f"{where}:{number}: host {limits.shown(name)}: key 'slots': {limits.shown(value)} is not a whole number") from None
        raw.append((name, settings, settings))
    if not raw:
        raise InputError(f"{where}: inventory is empty: the hostfile lists no host")
    return build(raw, path, where, "hostfile", master=None, known_hosts=None, rendezvous_port=DEFAULT_RENDEZVOUS_PORT, python=python)


def _supervisor_with_vars(value, common: dict):
    """A `supervisor:` host of its own takes the inventory's `vars` for what it does not say (its user, port,
    identity, python): a lab's login node is reached as its other hosts are."""
    if not isinstance(value, dict):
        return value
    return {**{k: common[k] for k in ("user", "port", "identity", "python") if k in common}, **value}

