"""The controller's record of the environments it provisioned (`$MNFT_HOME/provision/hosts.json`), and what
it implies: `effective()` makes a provisioned host's environment Python the one check, sync and train use."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.core.output import command
from mnft.hosts.hostkeys import mnft_home
from mnft.hosts.settings import Host, Inventory


def state_path() -> Path:
    return mnft_home() / "provision" / "hosts.json"


def host_key(host: Host) -> str:
    """Whose record: the SSH target (user@address:port), or local:<name> for a local host."""
    if host.is_local:
        return f"local:{host.name}"
    return f"{host.user or ''}@{host.address}:{host.port or 22}"


def load_state() -> dict[str, dict]:
    """The record, read within limits.STATE_BYTES; unreadable, damaged or too large is one line."""
    try:
        data = limits.read_json(state_path(), limits.STATE_BYTES, "provision record", "STATE_BYTES", missing={})
    except limits.TooLarge:
        raise
    except InputError as exc:
        raise InputError(f"{exc}: delete it and run {command('provision')} again") from None
    return data if isinstance(data, dict) else {}


def save_state(updates: Mapping[str, dict | None]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = load_state()
    for key, value in updates.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def host_root(venv: str) -> str:
    """mnft's directory beside the environment link, as the host spells it (`~/mnft-env` -> `~/mnft-env.d`)."""
    return venv.rstrip("/") + ".d"


def env_python(venv: str) -> str:
    return venv.rstrip("/") + "/bin/python"


def effective(inventory: Inventory, state: Mapping[str, dict] | None = None) -> Inventory:
    """The inventory with each provisioned host's `python` set to its environment's interpreter (the host's
    own `python` kept as `base_python`, the one environments are built from). A host whose `venv` changed since,
    or is none, keeps its `python`."""
    state = load_state() if state is None else state
    hosts = []
    for host in inventory.hosts:
        record = state.get(host_key(host))
        if host.venv is not None and host.base_python is None and record and record.get("venv") == host.venv:
            host = replace(host, python=env_python(host.venv), base_python=host.python)
        hosts.append(host)
    return replace(inventory, hosts=tuple(hosts))


def base_python(host: Host) -> str:
    return host.base_python or host.python
