"""The lab as its people share it: every host's devices and who holds or uses each, in one round-trip per host.

read (`look`): each host's lease directory and nvidia-smi, through mnft.onhost.leasehost's `lab` mode; plan (pure):
the rows of `mnft lab` (`rows`), how many devices a host has free (`free_count`), and which hosts a run asking
`--nodes N --gpus G` takes (`pick_nodes`). What a lease file says is anyone's writing: it is shown cut and
without control characters (mnft.hosts.leases.shown); who holds a lease is also told from /proc/locks (the
kernel's record of the flock's holder and that process's owner), which no user can forge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from mnft.core.errors import InputError
from mnft.hosts import leases
from mnft.onhost.health import health_problems
from mnft.onhost.leases import progress_numbers
from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Host, Inventory


def look(fleet: Fleet, hosts: Iterable[Host]) -> dict[str, dict]:
    """host -> its lab view (mnft.onhost.leases.lab), or {"error", "status"} for a host that did not answer."""
    return leases.lab(fleet, hosts)


def free_count(view: dict) -> int:
    """Devices nobody holds or uses on a host (a host without GPUs: its CPUs, one device)."""
    return sum(1 for d in view.get("devices") or [] if d.get("state") == "free")


def device_count(view: dict) -> int:
    return len(view.get("devices") or [])


OUT_OF_SERVICE = ("drained", "unhealthy")


def out_of_service(view: dict) -> list[dict]:
    """The host's devices never leased: drained by an admin, or whose health breaks runs."""
    return [d for d in view.get("devices") or [] if d.get("state") in OUT_OF_SERVICE]


def health_words(device: dict) -> str | None:
    """What `mnft lab` says of a GPU's health beside its lease: why it breaks runs, else its warnings; None when well."""
    found = health_problems(device)
    worst = [p for p in found if p["level"] == "broken"] or found
    return leases.shown("; ".join(p["what"] for p in worst), 300) if worst else None


def has_gpus(view: dict) -> bool:
    return any(d.get("index") is not None for d in view.get("devices") or [])


def lockers_users(device: dict) -> list[str]:
    """The users /proc/locks says hold a lease (each locker is "user pid N")."""
    return sorted({str(w).split(" pid ")[0] for w in device.get("lockers") or []})


def progress_of(holder: dict) -> dict | None:
    """The run's last step its lease names (anyone may write a lease file: numbers only, else nothing)."""
    return progress_numbers(holder.get("progress"))


def holder_user(device: dict) -> str | None:
    """Who holds a device: the owner of the process holding its lock (the kernel's word), else the login the lease
    file names."""
    users = lockers_users(device)
    return ", ".join(users) if users else leases.holder_login(device.get("holder"))


@dataclass(frozen=True)
class Row:
    """One line of `mnft lab`: a device of a host (or the host when it did not answer)."""

    host: str
    device: str  # "0", "1" … or "cpu" or "-"
    state: str  # free | held | outside | unreachable | failed | waiting
    user: str | None = None
    run: str | None = None
    command: str | None = None
    since: float | None = None
    memory: str | None = None  # "12034/81559 MiB"
    utilization: int | None = None
    detail: str | None = None  # the lease file's own words when /proc/locks disagrees; an error
    image: str | None = None  # the holder's container image (a run in an image)
    health: str | None = None  # what is wrong with the GPU (mnft.onhost.health.health_problems), beside its lease
    drain: str | None = None  # who drained it, when and why

    idle: float | None = None  # seconds its holder's GPUs have been idle (as the holder's keeper last sampled them)
    also: str | None = None  # a collision: "also used by bob pid 4242" (a process not of the holder's run on its GPU)
    progress: dict | None = None  # the holder's run's last step as its controller told the host: {"step", "loss", "at"}
    supervisor: str | None = None  # a detached run's supervisor on the lab: "h1 pid 4242" (its holder's controller and pid)
    why: str | None = None  # a waiting run: its position and who is ahead of it by which rule (why_waits)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def rows(inventory: Inventory, views: dict[str, dict]) -> list[Row]:
    """The table of `mnft lab`, hosts in inventory order, each device in index order, then the host's line."""
    out: list[Row] = []
    for host in inventory.hosts:
        view = views.get(host.name) or {"error": "no answer", "status": "failed"}
        if view.get("error") and not view.get("devices"):
            out.append(Row(host.name, "-", view.get("status") or "failed", detail=leases.shown(view["error"], 200)))
            continue
        if view.get("devices_error") and not view.get("devices"):  # the host answered, its GPUs did not (a stall named)
            out.append(Row(host.name, "-", "failed", detail="GPUs not read: " + (leases.shown(view["devices_error"], 300) or "")))
        for d in view.get("devices") or []:
            key = "gone" if d.get("index") is None and d.get("uuid") else "cpu" if d.get("index") is None else str(d.get("index"))
            total, used = d.get("memory_total_mib"), d.get("memory_used_mib")
            memory = f"{used}/{total} MiB" if isinstance(total, int) and isinstance(used, int) else None
            util = d.get("utilization") if isinstance(d.get("utilization"), int) else None
            state = d.get("state") or "free"
            health = health_words(d)
            drain = leases.drained_words(d.get("drain")) if d.get("drain") else None
            if state in OUT_OF_SERVICE:
                out.append(Row(host.name, key, state, memory=memory, utilization=util, health=health, drain=drain,
                               detail=drain if state == "drained" else "never leased: " + (leases.shown(d.get("broken"), 300) or "?")))
            elif state == "held":
                holder = d.get("holder") or {}
                claimed, proven = leases.holder_login(holder), lockers_users(d)
                detail = f"the lease file names {claimed}" if proven and claimed and claimed not in proven else None
                idle = idle_for(holder, view.get("now"))
                also = also_used(d)
                reserved = ("reserved: its run waits in line for its other hosts (it has not started here)"
                            if holder.get("wait") and d.get("run_started") is False else None)
                detail = "; ".join(w for w in (reserved, detail, also) if w) or None
                out.append(Row(host.name, key, "held", holder_user(d), leases.shown(holder.get("run_id")), held_command(holder),
                               _number(holder.get("taken") or holder.get("started")), memory, util, with_idle(detail, idle),
                               leases.shown(holder.get("image"), 80), health, drain, idle, also, progress_of(holder), supervisor_of(holder)))
            elif state == "outside":
                procs = d.get("processes") or []
                users = sorted({leases.shown(p.get("user")) or "?" for p in procs})
                pids = ", ".join(f"pid {leases.shown(p.get('pid'))}" for p in procs[:4])
                out.append(Row(host.name, key, "outside", ", ".join(users), None, None, None, memory, util, f"in use outside mnft: {pids}",
                               health=health, drain=drain))
            else:
                out.append(Row(host.name, key, "free", memory=memory, utilization=util, health=health, detail=reserved_for(view.get("line"))))
        line = [w for w in view.get("line") or [] if isinstance(w, dict)]
        for place, waiting in enumerate(line, 1):
            want = waiting.get("want")
            out.append(Row(host.name, f"#{place}", "waiting", leases.holder_login(waiting) or leases.shown(waiting.get("user")),
                           leases.shown(waiting.get("run_id")), leases.shown(waiting.get("command"), 20), _number(waiting.get("queued")),
                           detail=f"wants {'every device' if want is None else f'{want} GPU(s)'}", why=why_waits(line, place - 1, view.get("policy"))))
    return out


# ------------------------------------------------------------------------------------------------ the fair line
# Each host sends its line in its fair order (mnft.onhost.line: fewest GPUs held first between runs of one host,
# first come first served between runs over several; a user at the lab's max_gpus_while_others_wait behind the
# others), each ticket with what it was ordered by: "fair": {"over_limit", "held" (its key's: 0 for a run over
# several hosts), "holds" (the GPUs its user holds there)}.


def waiter(holder: dict) -> str:
    """Whose a ticket is: the login it names on the host, else its controller's user."""
    return leases.holder_login(holder) or leases.shown(holder.get("user")) or "?"


def _fair(holder: dict) -> tuple[int, int, int]:
    """(over_limit, held, holds) of a ticket (0 for what a host did not say)."""
    fair = holder.get("fair") if isinstance(holder.get("fair"), dict) else {}
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) else 0 for v in (fair.get("over_limit"), fair.get("held"), fair.get("holds")))


def spans_hosts(holder: dict) -> bool:
    """A run over several hosts (or a ticket that does not say: an older controller's)."""
    return holder.get("hosts") != 1


def over_limit_words(who: str, holds: int, limit) -> str:
    """"bob holds 4 GPU(s) here, the lab's max_gpus_while_others_wait is 2: their runs wait while others do"."""
    return f"{who} holds {holds} GPU(s) here, the lab's max_gpus_while_others_wait is {limit if limit is not None else '?'}: their runs wait while others do"


def ahead_rule(other: dict, me: dict, policy: dict | None = None) -> str:
    """Why one ticket of a host's line is before another, by the first rule that tells them apart."""
    (o_over, o_held, _), (m_over, m_held, m_holds) = _fair(other), _fair(me)
    if spans_hosts(other) and spans_hosts(me):
        return "first come, first served, as between all runs over several hosts"
    if o_over < m_over:
        return over_limit_words(waiter(me), m_holds, (policy or {}).get("max_gpus_while_others_wait"))
    if o_over > m_over or o_held > m_held:  # before an earlier run over several hosts, which this one stays behind
        return "before an earlier run over several hosts, which this one stays behind: those start in the order they came"
    if o_held < m_held:
        them = f"{waiter(other)}'s run spans several hosts and counts none" if spans_hosts(other) else f"{waiter(other)} holds {o_held}"
        return f"fewest GPUs held first: {them} here, {waiter(me)} {m_held}"
    return "first come, first served"


def run_label(holder: dict) -> str:
    """"alice's run R" (a ticket's run; its command when it names no run)."""
    run = leases.shown(holder.get("run_id"))
    return f"{waiter(holder)}'s {'run ' + run if run else leases.shown(holder.get('command'), 20) or 'run'}"


def why_waits(line: list[dict], at: int, policy: dict | None = None) -> str:
    """Why the run at `at` (0: the first) of a host's line (in its fair order) waits: its position, and the runs
    ahead of it grouped by the rule that puts them there ("position 3: behind alice's run R and bob's run S (fewest
    GPUs held first: …)")."""
    if at == 0:
        return "first in line: it starts once its devices are free"
    me, rules = line[at], {}
    for other in line[:at]:
        rules.setdefault(ahead_rule(other, me, policy), []).append(run_label(other))
    parts = []
    for rule, labels in rules.items():
        more = f" and {len(labels) - 3} more" if len(labels) > 3 else ""
        parts.append(f"{' and '.join(labels) if len(labels) == 2 else ', '.join(labels[:3]) + more} ({rule})")
    return f"position {at + 1}: behind {'; '.join(parts)}"


LIMITS = ("max_gpus_while_others_wait", "max_waiting")


def users(inventory: Inventory, views: dict[str, dict], table: Sequence[Row]) -> dict:
    """The lab per user, for `mnft lab` (and `--json`): {"users": [{"user", "gpus_held" (across the hosts looked at),
    "held_on": {host: GPUs}, "waiting" (runs in line: distinct run ids, else tickets), "at_limit_on": [hosts where
    they hold the lab's max_gpus_while_others_wait or more]}], "limits": lab_limits'}."""
    held: dict[str, dict[str, int]] = {}
    for row in table:
        if row.state == "held" and row.device.isdigit():
            on = held.setdefault(row.user or "?", {})
            on[row.host] = on.get(row.host, 0) + 1
    waiting: dict[str, set] = {}
    for host in inventory.hosts:
        for w in (views.get(host.name) or {}).get("line") or []:
            if isinstance(w, dict):
                waiting.setdefault(waiter(w), set()).add(leases.shown(w.get("run_id")) or ("ticket", host.name, leases.shown(w.get("ticket"))))
    out = []
    for user in sorted(set(held) | set(waiting)):
        on = held.get(user, {})
        at_limit = [h for h, n in on.items() if _limit_of(views.get(h), LIMITS[0]) is not None and n >= _limit_of(views.get(h), LIMITS[0])]
        out.append({"user": user, "gpus_held": sum(on.values()), "held_on": on, "waiting": len(waiting.get(user, ())), "at_limit_on": at_limit})
    return {"users": out, "limits": lab_limits(inventory, views)}


def _limit_of(view: dict | None, key: str) -> int | None:
    value = ((view or {}).get("policy") or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def lab_limits(inventory: Inventory, views: dict[str, dict]) -> dict:
    """The lab's per-user limits as the hosts that answered set them: {"max_gpus_while_others_wait", "max_waiting"
    (None: not set, or set differently on the hosts: then "differ" is True), "differ", "by_host": {host: {the
    limits, "path": the policy file}}}."""
    by_host = {}
    for host in inventory.hosts:
        view = views.get(host.name) or {}
        if view.get("error") and not view.get("devices"):
            continue
        found = {key: _limit_of(view, key) for key in LIMITS}
        by_host[host.name] = dict(found, path=leases.shown((view.get("policy") or {}).get("path"), 200))
    kinds = {tuple(v[k] for k in LIMITS) for v in by_host.values()}
    same = next(iter(kinds)) if len(kinds) == 1 else (None,) * len(LIMITS)
    return dict(zip(LIMITS, same), differ=len(kinds) > 1, by_host=by_host)


def limits_line(limits: dict) -> str:
    """The lab's limits in one line: "the lab's limits: max_gpus_while_others_wait 2, max_waiting 3 (/etc/mnft/lab.yaml)",
    host by host when the hosts differ, "none" when no host sets one."""
    def words(values: dict) -> str:
        said = [f"{k} {values[k]}" for k in LIMITS if values.get(k) is not None]
        return (", ".join(said) + (f" ({values['path']})" if values.get("path") else "")) if said else "none"

    if limits.get("differ"):
        return "the lab's limits differ by host: " + "; ".join(f"{h}: {words(v)}" for h, v in limits.get("by_host", {}).items())
    paths = sorted({v["path"] for v in limits.get("by_host", {}).values() if v.get("path")})
    return "the lab's limits: " + words(dict(limits, path=", ".join(paths)))


def reserved_for(line: list[dict] | None) -> str | None:
    """What a free device of a host with runs waiting in line is kept for: the first of the line (in its fair
    order), so a run that does not wait is refused it ("reserved for the line: alice's run R waits for 4 GPU(s)")."""
    first = next((w for w in line or [] if isinstance(w, dict)), None)
    if first is None:
        return None
    want = first.get("want")
    who = leases.holder_login(first) or leases.shown(first.get("user")) or "?"
    run = leases.shown(first.get("run_id"))
    return (f"reserved for the line: {who}'s {leases.shown(first.get('command'), 20) or 'run'}{' ' + run if run else ''} waits for "
            f"{'every device' if want is None else f'{want} GPU(s)'} (--wait to queue behind it)")


def also_used(device: dict) -> str | None:
    """A collision on a held device, in words: "also used by bob pid 4242, root pid 77" (the host's judgment,
    mnft.onhost.runs.collisions: processes not of the holder's run), None when there is none."""
    found = [p for p in device.get("collisions") or [] if isinstance(p, dict)]
    if not found:
        return None
    words = [f"{leases.shown(p.get('user')) or '?'} pid {leases.shown(p.get('pid'))}" for p in found[:4]]
    return "also used by " + ", ".join(words) + (f" and {len(found) - 4} more" if len(found) > 4 else "")


def collision_line(row: Row) -> str | None:
    """`GPU 3: held by alice's run R; also used by bob pid 4242` (None for a row without a collision)."""
    if not row.also:
        return None
    what = "session" if (row.command or "").startswith("shell") else "run"
    return f"{row.host} GPU {row.device}: held by {row.user or '?'}'s {what} {row.run or '?'}; {row.also}"


def supervisor_of(holder: dict) -> str | None:
    """"h1 pid 4242": where a detached run's supervisor holds the lease from (None: a terminal's run, a session)."""
    if holder.get("supervised") is not True:
        return None
    return f"{leases.shown(holder.get('controller'), 64) or '?'} pid {leases.shown(holder.get('pid'), 12) or '?'}"


def held_command(holder: dict) -> str | None:
    """What holds a device: "train", "sync", "shell", or a session's own command ("shell: jupyter lab …")."""
    command = leases.shown(holder.get("command"), 20)
    session = leases.shown(holder.get("session"), 40)
    return f"{command}: {session}" if command == "shell" and session else command


def idle_for(holder: dict, now) -> float | None:
    """How long the holder's GPUs have been idle (the keeper's `idle_since` in the lease), None when not idle."""
    began, now = _number(holder.get("idle_since")), _number(now)
    return max(0.0, now - began) if began is not None and now is not None else None


def with_idle(detail: str | None, idle: float | None) -> str | None:
    if idle is None:
        return detail
    from mnft.core.durations import shown

    return f"idle {shown(idle)}" + (f"; {detail}" if detail else "")


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1e11 else None


def since(value: float | None, now: float | None = None) -> str:
    """"12m" / "3h05m" / "2d" ago."""
    if value is None:
        return ""
    seconds = max(0, int((now or time.time()) - value))
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
    return f"{seconds // 86400}d"


# ------------------------------------------------------------------------------------------------ --nodes


@dataclass(frozen=True)
class Pick:
    """The hosts a run takes (inventory order) and, per host of the inventory, why it was or was not taken."""

    hosts: tuple[str, ...] | None  # None: not enough hosts
    why: tuple[tuple[str, str], ...]
    cut_off: tuple[tuple[str, str, str], ...] = ()  # (host, status, its whole error) for hosts not reached
    waiting_helps: bool = False  # enough hosts would have the devices once the runs holding them end


def pick_nodes(inventory: Inventory, views: dict[str, dict], nodes: int, gpus: int | None, wait: bool = False) -> Pick:
    """The first `nodes` training hosts of the inventory (its order: node_rank follows it) on which the run's
    devices are free now (`gpus` of them, or every one). With `wait`, hosts where they are not free now but could
    be (enough devices in all) make up the rest, those with the most free first."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise InputError(f"--nodes {nodes!r}: a whole number ≥ 1")
    training = [h for h in inventory.hosts if not h.spare]
    if nodes > len(training):
        raise InputError(f"--nodes {nodes}: {inventory.path or 'the inventory'} has {len(training)} training host(s)")
    why: dict[str, str] = {}
    ready, could, cut_off = [], [], []
    for host in training:
        view = views.get(host.name) or {}
        if view.get("error") and not view.get("devices"):
            why[host.name] = f"left out: {view.get('status') or 'failed'} ({leases.shown(view['error'], 120)})"
            cut_off.append((host.name, view.get("status") or "failed", leases.shown(view["error"], 1000)))
            continue
        if view.get("devices_error") and not view.get("devices"):
            why[host.name] = f"left out: GPUs not read ({leases.shown(view['devices_error'], 200)})"
            continue
        out = out_of_service(view)
        free, count = free_count(view), device_count(view) - len(out)
        needed = device_count(view) if gpus is None else gpus
        if gpus is not None and not has_gpus(view):
            why[host.name] = f"left out: no GPUs (no nvidia-smi) for --gpus {gpus}"
        elif out and count < needed:  # never to be had by waiting
            why[host.name] = f"left out: {len(out)} GPU(s) out of service, {count} of {device_count(view)} in service, {needed} needed (" + \
                "; ".join(leases.holders_of(out)) + ")"
        elif free >= needed and count:
            ready.append(host.name)
            why[host.name] = f"{free} of {device_count(view)} device(s) free" + (f" ({len(out)} out of service)" if out else "")
        elif count >= needed:
            could.append((free, host.name))
            why[host.name] = f"{free} of {device_count(view)} device(s) free" + (f" ({len(out)} out of service)" if out else "") + f", {needed} needed"
        else:
            why[host.name] = f"left out: {count} device(s), {needed} needed"
    chosen = ready[:nodes]
    if len(chosen) < nodes and wait:
        chosen += [name for _, name in sorted(could, key=lambda c: -c[0])][: nodes - len(chosen)]
    if len(chosen) < nodes:
        return Pick(None, tuple((h.name, why.get(h.name, "")) for h in training), tuple(cut_off), len(ready) + len(could) >= nodes)
    order = [h.name for h in training if h.name in chosen]
    for name in order:
        why[name] = "picked: " + why[name] + ("" if name in ready else " (waits in line)")
    return Pick(tuple(order), tuple((h.name, why.get(h.name, "")) for h in training))


def with_gpus(inventory: Inventory, gpus: int | None) -> Inventory:
    """The inventory as a run of `gpus` devices per host sees it: that many processes on each host (slots)."""
    from dataclasses import replace

    if gpus is None:
        return inventory
    return replace(inventory, hosts=tuple(replace(h, slots=gpus) for h in inventory.hosts))


def not_picked_line(pick: Pick, nodes: int, gpus: int | None) -> str:
    """Why --nodes found too few hosts: hosts that could not be reached first, each with its whole error (its fix:
    trust-hosts for a rejected key), then the devices; --wait is offered only where waiting can help."""
    asked = "every device" if gpus is None else f"{gpus} free GPU(s)"
    lines = [f"--nodes {nodes}: {host}: {status}: {error}" for host, status, error in pick.cut_off]
    cut = {host for host, _, _ in pick.cut_off}
    rest = "; ".join(f"{h}: {w}" for h, w in pick.why if h not in cut)
    tail = ("--wait to wait in line; `mnft lab` shows the lab" if pick.waiting_helps else
            "waiting would not help: too few hosts have that many devices" + (" or can be reached" if cut else "") + "; `mnft lab` shows the lab")
    lines.append(f"--nodes {nodes}: fewer than {nodes} host(s) have {asked}" + (f" (of those reached: {rest})" if rest and cut else f": {rest}" if rest else "")
                 + f" ({tail})")
    return "\n".join(lines)


def check_gpus(gpus: Sequence | int | None) -> int | None:
    """--gpus G (a job file's `gpus:`): a whole number of devices per host, ≥ 1 (None: every device)."""
    if gpus is None:
        return None
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 64:
        raise InputError(f"--gpus {gpus!r}: a whole number of GPUs per host from 1 to 64")
    return gpus


# ------------------------------------------------------------------------------------------------ drain


def drain_target(inventory: Inventory, target: str | None) -> tuple[Host, list[int] | None]:
    """`HOST` or `HOST:GPU,GPU…` -> (the inventory's host, the GPU indices or None for the whole host); InputError
    naming what is wrong."""
    if not target:
        raise InputError("drain/undrain: name HOST or HOST:GPU[,GPU…] (a host of the inventory)")
    name, sep, gpus = str(target).partition(":")
    host = next((h for h in inventory.hosts if h.name == name), None)
    if host is None:
        known = ", ".join(h.name for h in inventory.hosts)
        raise InputError(f"{target}: {name!r} is not a host of {inventory.path or 'the inventory'} (it has: {known})")
    if not sep:
        return host, None
    words = [w.strip() for w in gpus.split(",") if w.strip()]
    if not words or not all(w.isdigit() and int(w) < 64 for w in words):
        raise InputError(f"{target}: GPUs are indices as nvidia-smi numbers them, e.g. {name}:0,3")
    return host, sorted({int(w) for w in words})


def drain(fleet: Fleet, host: Host, gpus: list[int] | None, reason: str | None, undrain: bool = False) -> dict:
    """Mark the host (gpus None) or its GPUs out of service, or back in (mnft.onhost.drain.set_drain, as the login user of
    the host: root or the admin group the host names decide, never this controller): the host's marks, or
    {"refused"|"error": …}."""
    import getpass
    import socket

    request = {"gpus": gpus, "reason": reason or "", "by": f"{getpass.getuser()}@{socket.gethostname()}"}
    return leases.run_drain(fleet, host, request, undrain)
