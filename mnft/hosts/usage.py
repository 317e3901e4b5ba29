"""`mnft lab --usage`: what the hosts' usage logs say (mnft.onhost.usageread `usage`: one line per lease that ended,
counted for the user who owns the log it is in, and one per GPU lease still held, to now, counted for the user the
kernel says holds it), summed over the inventory: GPU-hours per user and per host (leases of GPUs only: setup,
provision and syncs hold none), the share of them the GPUs were idle, and the longest waits in line. `summarise` is
pure: lines in, totals out."""

from __future__ import annotations

from typing import Iterable

from mnft.hosts import leases, pyrun

from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Host

LONGEST_WAITS = 5


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def gpu_seconds(line: dict, since: float) -> tuple[float, float]:
    """(GPU-seconds, idle GPU-seconds) of one lease within the window from `since` on."""
    start, end = _number(line.get("start")), _number(line.get("end"))
    devices = [d for d in line.get("devices") or [] if isinstance(d, int) and not isinstance(d, bool)]
    if start is None or end is None or end < start or not devices:
        return 0.0, 0.0
    held = end - max(start, since)
    if held <= 0:
        return 0.0, 0.0
    idle = min(max(0.0, _number(line.get("idle_s")) or 0.0), held)
    return held * len(devices), idle * len(devices)


def summarise(lines_by_host: dict[str, list[dict]], since: float) -> dict:
    """Per user and per host: GPU-hours and the idle share; the longest waits in line (queued → taken)."""
    users: dict[str, list[float]] = {}
    hosts: dict[str, list[float]] = {}
    waits = []
    for host, lines in lines_by_host.items():
        for line in lines:
            if not any(isinstance(d, int) and not isinstance(d, bool) for d in line.get("devices") or []):
                continue  # no GPU held: setup, provision, a sync, a CPU host's run are no GPU usage
            used, idle = gpu_seconds(line, since)
            user = leases.shown(line.get("login")) or "?"
            for table, key in ((users, user), (hosts, host)):
                total = table.setdefault(key, [0.0, 0.0, 0, 0])
                total[0] += used
                total[1] += idle
                total[2] += 1
                total[3] += 1 if line.get("running") is True else 0
            queued, start = _number(line.get("queued")), _number(line.get("start"))
            if queued is not None and start is not None and start > queued:
                waits.append({"host": host, "user": user, "run": leases.shown(line.get("run_id")), "command": leases.shown(line.get("command"), 20),
                              "waited_s": round(start - queued, 1), "queued": queued})

    def rows(table: dict[str, list[float]], key: str) -> list[dict]:
        return [{key: name, "gpu_seconds": round(used, 1), "gpu_hours": round(used / 3600, 3), "idle_share": round(idle / used, 3) if used else 0.0,
                 "leases": count, "running": now} for name, (used, idle, count, now) in sorted(table.items(), key=lambda item: -item[1][0])]

    return {"since": since, "users": rows(users, "user"), "hosts": rows(hosts, "host"),
            "longest_waits": sorted(waits, key=lambda w: -w["waited_s"])[:LONGEST_WAITS]}


def ask(fleet: Fleet, hosts: Iterable[Host], since: float, timeout: float = 30) -> dict[str, dict]:
    """host -> its usage lines since `since` (or {"error": …}), one round-trip each."""
    results = fleet.run(lambda h: pyrun.command(h, "usage", repr(float(since)), site=False), stdin=pyrun.payload("leasehost"),
                        hosts=list(hosts), timeout=timeout)
    out = {}
    for result in results:
        data = pyrun.reply(result, "the lease script")
        out[result.host] = data if data is not None else {"error": result.error or result.status.value, "status": result.status.value}
    return out
