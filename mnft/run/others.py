"""Another user's run, as the lab shows it: `mnft status RUN` and `mnft stop RUN` for a run this controller did not
start (no runs/RUN here) but whose leases are held on the inventory's hosts.

Status is shown to anyone: where the run holds devices, whose it is (the owner of the process holding each lease's
lock, from /proc/locks: what no user can forge), its command and since when. Stop is refused unless you are the
run's holder on every host or root there: only its holder, or root, may stop a run. Root stops it as `mnft stop`
stops its own: each host's agent ends the run's process group (recorded pgid, its leader verified), found from the
keeper that holds the run's leases (its working directory is the run directory).
"""

from __future__ import annotations

import getpass

from rich.console import Console
from rich.table import Table

from mnft.core.errors import ExitCode, InputError, MnftError
from mnft.core.output import plain, print_json
from mnft.hosts import leases, pyrun
from mnft.hosts.fleet import Fleet
from mnft.hosts.lab import holder_user, look, since
from mnft.hosts.settings import Inventory
from mnft.run.gang import agent_command, agent_payload


class NotYours(MnftError):
    """A stop of another user's run: only its holder, or root, may stop it (nothing was changed)."""


def held_by_run(views: dict[str, dict], run_id: str) -> dict[str, list[dict]]:
    """host -> the devices (and workdirs) whose lease names the run (any attempt of it) and is held now."""
    def ours(holder) -> bool:
        named = (holder or {}).get("run_id")
        return isinstance(named, str) and (named == run_id or run_id.startswith(named + "-a"))

    out: dict[str, list[dict]] = {}
    for host, view in views.items():
        found = [d for d in view.get("devices") or [] if d.get("state") == "held" and ours(d.get("holder"))]
        found += [dict(index="workdir", holder=w, lockers=w.get("lockers"), workdir=w.get("workdir")) for w in view.get("workdirs") or []
                  if ours(w)]
        if found:
            out[host] = found
    return out


def find(inventory: Inventory, run_id: str) -> dict[str, list[dict]]:
    with Fleet(inventory) as fleet:
        held = held_by_run(look(fleet, inventory.hosts), run_id)
    if not held:
        raise InputError(f"run {run_id}: not recorded here and holds nothing on the hosts of {inventory.path or 'the inventory'} "
                         "(`mnft lab` shows the runs there)")
    return held


def print_status(run_id: str, held: dict[str, list[dict]], as_json: bool, console: Console) -> int:
    if as_json:
        print_json({"run_id": run_id, "hosts": {h: [{"device": d.get("index"), "user": holder_user(d), "holder": d.get("holder"),
                                                      "lockers": d.get("lockers")} for d in found] for h, found in held.items()}})
        return ExitCode.OK
    table = Table(title=plain(f"run {run_id} (not started from here: as its leases on the hosts show it)"))
    for column in ("host", "holds", "user", "command", "controller", "since"):
        table.add_column(column)
    for host, found in held.items():
        holder = found[0].get("holder") or {}
        devices = ", ".join(leases.directory_label(d.get("workdir")) if d.get("index") == "workdir"
                            else "cpu" if d.get("index") is None else f"GPU {d.get('index')}" for d in found)
        table.add_row(plain(host), plain(devices), plain(holder_user(found[0]) or "?"), plain(leases.shown(holder.get("command"), 20) or ""),
                      plain(leases.shown(holder.get("controller")) or ""), plain(since(holder.get("taken") or holder.get("started"))))
    console.print(table)
    return ExitCode.OK


def login_on(inventory: Inventory, host: str) -> str:
    """The user this inventory logs in as on a host (the controller's own for a local host or an unnamed user)."""
    return inventory.host(host).user if inventory.host(host).user and not inventory.host(host).is_local else getpass.getuser()


def refuse_stop(run_id: str, held: dict[str, list[dict]], inventory: Inventory) -> None:
    """NotYours unless the login on every host holds the run there, or is root: the kernel's word, not the file's."""
    theirs = {}
    for host, found in held.items():
        me = login_on(inventory, host)
        owners = {holder_user(d) or "?" for d in found} - {me}
        if owners and me != "root":
            theirs[host] = owners
    if theirs:
        where = "; ".join(f"{h}: {', '.join(leases.holders_of(held[h]) or ['?'])}" for h in theirs)
        owners = sorted(set().union(*theirs.values()))
        raise NotYours(f"run {run_id} is not yours ({where}): only {', '.join(owners)} or root may stop it; nothing was changed")


def stop(inventory: Inventory, run_id: str, held: dict[str, list[dict]], grace: float) -> dict[str, dict]:
    """Root's stop of another user's run: each host's run directories, from the keepers holding the run's leases,
    stopped by the run's agent there (the recorded process group, its leader verified)."""
    out: dict[str, dict] = {}
    with Fleet(inventory.only(held)) as fleet:
        found = fleet.run(lambda h: pyrun.command(h, "rundirs", run_id, site=False), stdin=pyrun.payload("leasehost"), timeout=30)
        dirs = {r.host: (pyrun.reply(r, "the lease script") or {}).get("run_dirs") or [] for r in found}
        for host, run_dirs in dirs.items():
            for run_dir in run_dirs:
                results = fleet.run(lambda h, d=run_dir: agent_command(fleet, h.name, "stop", d, str(grace)), stdin=agent_payload(),
                                    hosts=[inventory.host(host)])
                for r in results:
                    out[host] = pyrun.reply(r, "the agent") or {"error": r.error}
            if not run_dirs:
                out[host] = {"error": "no keeper of the run holds its leases here"}
    return out


def print_stop(run_id: str, result: dict[str, dict], as_json: bool, console: Console) -> int:
    """Per host: what was killed and what remains; exit 0 only when nothing of the run remains anywhere."""
    ok = bool(result) and all(isinstance(r.get("remaining"), list) and not r["remaining"] for r in result.values())
    if as_json:
        print_json({"run_id": run_id, "hosts": result, "stopped": ok})
    else:
        for host, r in result.items():
            if r.get("error"):
                console.print(plain(f"{host}: {r['error']}", "red"))
            else:
                left = r.get("remaining") or []
                console.print(plain(f"{host}: run {run_id}: killed {len(r.get('killed') or [])} process(es)"
                                    + (f", {len(left)} remain" if left else ", nothing left"), "yellow" if left else "green"))
    return ExitCode.OK if ok else ExitCode.FAILED
