"""`mnft uninstall`: take mnft off the hosts and this machine. Read state -> plan -> apply -> report.

* read: every host, in one round-trip (mnft.onhost.uninstallhost on the host's base Python: the environment
  may be what goes), says what of mnft's is there and its size; this machine its wheelhouse, code snapshot store,
  tree-hash caches and provision record;
* plan (pure, mnft.uninstall.plan): per host and here, each item to remove or to keep, and why;
* apply (not in a dry run): the whole host's lease taken first, as setup and provision take it (a run, a sync or
  a provision under way refuses the whole command before anything changes); each host removes its items, judging
  each again; one outcome per host: ok / failed / unreachable / host-key-rejected. This machine's items go last; a
  host's provision record goes only once its environment is gone.

setup's changes (the SSH mesh, /etc/hosts, the firewall) are setup's to undo: `mnft setup --undo`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from mnft.core.errors import ExitCode
from mnft.env.record import base_python, host_key, load_state, save_state, state_path
from mnft.hosts import leases, pyrun
from mnft.hosts.command import Command
from mnft.hosts.connection import Timeouts
from mnft.hosts.fleet import Fleet, Status
from mnft.hosts.hostkeys import mnft_home
from mnft.hosts.settings import Host, Inventory
from mnft.sync import snapshot
from mnft.onhost import uninstallhost
from mnft.uninstall.plan import CONTROLLER, Item, freed, plan_items, settle, still_used, to_remove

LOOK_TIMEOUT = 300.0  # a look hashes the files sync placed (a large data_dir is read once)
REMOVE_TIMEOUT = 3600.0


@dataclass
class HostOutcome:
    host: str
    status: str  # ok | would-remove | nothing | failed | unreachable | host-key-rejected
    items: list[Item] = field(default_factory=list)
    error: str = ""

    def to_json(self) -> dict:
        return {"status": self.status, "error": self.error or None, "bytes": freed(self.items), "items": [i.to_json() for i in self.items]}


@dataclass
class UninstallReport:
    hosts: dict[str, HostOutcome]
    controller: list[Item]
    dry_run: bool
    include_outputs: bool
    seconds: float = 0.0

    def exit_code(self) -> ExitCode:
        statuses = [o.status for o in self.hosts.values()]
        if any(s in ("unreachable", "host-key-rejected") for s in statuses):
            return ExitCode.UNREACHABLE
        if any(s == "failed" for s in statuses) or any(i.outcome == "failed" for i in self.controller):
            return ExitCode.FAILED
        return ExitCode.OK

    def to_json(self) -> dict:
        return {"dry_run": self.dry_run, "include_outputs": self.include_outputs, "seconds": self.seconds,
                "bytes": sum(freed(o.items) for o in self.hosts.values()) + freed(self.controller), "exit_code": int(self.exit_code()),
                "hosts": {name: o.to_json() for name, o in self.hosts.items()},
                "controller": {"home": str(mnft_home()), "bytes": freed(self.controller), "items": [i.to_json() for i in self.controller]}}


# ------------------------------------------------------------------------------------------------ the hosts


def spec(host: Host, remove: list[str] | None = None) -> str:
    return json.dumps({"venv": host.venv, "workdir": host.workdir, "data_dir": host.data_dir, **({"remove": remove} if remove is not None else {})})


def host_command(host: Host, action: str, remove: list[str] | None = None) -> Command:
    """The host script on the host's base Python (never the environment's: it may be what is removed)."""
    return pyrun.command(host, action, spec(host, remove), python=base_python(host), site=False)


def look_hosts(fleet: Fleet, hosts: list[Host], include_outputs: bool) -> dict[str, HostOutcome]:
    results = fleet.run(lambda h: host_command(h, "look"), stdin=pyrun.payload("uninstallhost"), hosts=hosts, timeout=LOOK_TIMEOUT)
    outcomes = {}
    for result in results:
        data = pyrun.reply(result, "the uninstall script")
        if data is None or not isinstance(data.get("found"), dict):
            outcomes[result.host] = HostOutcome(result.host, result.status.value if result.status is not Status.OK else "failed",
                                                error=result.error or "the uninstall script gave no answer")
            continue
        items = plan_items(data["found"], include_outputs=include_outputs)
        outcomes[result.host] = HostOutcome(result.host, "ok", items)
    return outcomes


def remove_on_hosts(fleet: Fleet, hosts: list[Host], outcomes: dict[str, HostOutcome]) -> None:
    todo = [h for h in hosts if outcomes[h.name].status == "ok" and to_remove(outcomes[h.name].items)]
    if not todo:
        return
    results = fleet.run(lambda h: host_command(h, "remove", to_remove(outcomes[h.name].items)), stdin=pyrun.payload("uninstallhost"),
                        hosts=todo, timeout=REMOVE_TIMEOUT)
    for result in results:
        outcome = outcomes[result.host]
        data = pyrun.reply(result, "the uninstall script")
        if data is None:
            outcome.status, outcome.error = (result.status.value if result.status is not Status.OK else "failed"), result.error or "no answer"
            continue
        settle(outcome.items, data)
        if any(i.outcome == "failed" for i in outcome.items):
            outcome.status, outcome.error = "failed", "; ".join(f"{i.key}: {i.why}" for i in outcome.items if i.outcome == "failed")


# ------------------------------------------------------------------------------------------------ this machine


def look_controller(hosts: list[Host], outcomes: dict[str, HostOutcome]) -> dict[str, dict]:
    """This machine's facts, as a host's look gives them."""
    home = mnft_home()
    found = {"wheelhouse": uninstallhost.look_tree(str(home / "wheelhouse")),
             "code_store": uninstallhost.look_tree(str(snapshot.store())),
             "hash_cache": uninstallhost.look_tree(str(home / "cache")),
             "supervisor_bundles": uninstallhost.look_tree(str(home / "supervisor"))}
    recorded = [host_key(h) for h in hosts if host_key(h) in load_state() and env_gone(outcomes.get(h.name))]
    found["provision_record"] = {"path": str(state_path()), "kind": "file" if recorded else "missing", "files": len(recorded), "ours": True, "keys": recorded}
    return found


def env_gone(outcome: HostOutcome | None) -> bool:
    """The host answered, and its environment is gone or is to go (its provision record then names nothing)."""
    if outcome is None or outcome.status not in ("ok", "would-remove", "nothing"):
        return False
    return all(i.action != "keep" for i in outcome.items if i.key in ("env", "env_store"))


def remove_here(items: list[Item], found: dict[str, dict], hosts: list[Host], outcomes: dict[str, HostOutcome]) -> None:
    for item in items:
        if item.action == "keep":
            item.outcome = "kept"
            continue
        try:
            if item.key == "code_store":
                store = Path(item.path)
                snapshot.prune(store, keep=0)  # those a run holds (a flock) and those marked <name>.keep stay
                for leftover in store.iterdir():
                    if leftover.is_file() and not leftover.name.endswith(".keep") and not (store / leftover.name.split(".")[0]).is_dir():
                        leftover.unlink()
                left = sorted(p.name for p in store.iterdir())
                if left:
                    item.outcome, item.why = "left", f"{len(left)} kept: held by a run or marked .keep"
                    continue
                store.rmdir()
            elif item.key == "provision_record":
                gone = [host_key(h) for h in hosts if host_key(h) in found["provision_record"]["keys"] and env_gone(outcomes.get(h.name))
                        and outcomes[h.name].status == "ok"]
                save_state({key: None for key in gone})
            else:
                errors = uninstallhost._rmtree(item.path)
                if errors:
                    raise OSError("; ".join(f"{k}: {v}" for k, v in sorted(errors.items())[:3]))
            item.outcome = "removed"
        except OSError as exc:
            item.outcome, item.why = "failed", f"{exc.__class__.__name__}: {exc.strerror or exc}"


# ------------------------------------------------------------------------------------------------ the whole


@dataclass(frozen=True)
class UninstallOptions:
    dry_run: bool = False
    include_outputs: bool = False


def uninstall(inventory: Inventory, options: UninstallOptions, timeouts: Timeouts | None = None) -> UninstallReport:
    started = time.monotonic()
    hosts = list(inventory.hosts)
    with Fleet(inventory, timeouts) as fleet, leases.hold(fleet, hosts, "uninstall", skip=options.dry_run, python=base_python):
        outcomes = look_hosts(fleet, hosts, options.include_outputs)
        if options.dry_run:
            for o in outcomes.values():
                if o.status == "ok":
                    o.status = "would-remove" if to_remove(o.items) else "nothing"
        else:
            remove_on_hosts(fleet, hosts, outcomes)
    found = look_controller(hosts, outcomes)
    mine = {host_key(h) for h in hosts}
    here = still_used(plan_items(found, CONTROLLER), sorted(k for k in load_state() if k not in mine))
    if not options.dry_run:
        remove_here(here, found, hosts, outcomes)
    return UninstallReport(outcomes, here, options.dry_run, options.include_outputs, round(time.monotonic() - started, 3))
