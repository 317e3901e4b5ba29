"""The inventory's effective settings, per-host results and host-key trust outcomes, as tables or JSON."""

from __future__ import annotations

from typing import Any, Iterable

from rich.table import Table
from rich.text import Text

from mnft.core.output import console, plain, print_json, status_text
from mnft.hosts.connection import Timeouts, fabric_connection, ssh_target
from mnft.hosts.fleet import Results
from mnft.hosts.hostkeys import TrustResult
from mnft.hosts.settings import Inventory


def effective_settings(inventory: Inventory) -> list[dict[str, Any]]:
    """Per host, what will actually be used: inventory values completed by ~/.ssh/config and defaults."""
    rows = []
    for host in inventory.hosts:
        row = host.settings()
        row["master"] = host.name == inventory.master_name
        if not host.is_local:
            conn = fabric_connection(host, Timeouts())
            row["address"], row["port"], row["user"] = ssh_target(conn)
            if not host.identity:
                identity = conn.ssh_config.get("identityfile")
                row["identity"] = identity[0] if identity else None
        rows.append(row)
    return rows


def print_inventory(inventory: Inventory, as_json: bool) -> None:
    rows = effective_settings(inventory)
    if as_json:
        print_json({
            "inventory": str(inventory.path) if inventory.path else None,
            "format": inventory.format,
            "master": inventory.master_name,
            "rendezvous_port": inventory.rendezvous_port,
            "known_hosts": str(inventory.known_hosts) if inventory.known_hosts else None,
            "world_size": inventory.world_size,
            "hosts": rows,
            "ignored_vars": {k: list(v) for k, v in inventory.ignored.items()},
        })
        return
    columns = ["rank", "name", "connection", "address", "port", "user", "identity", "python", "slots", "iface", "workdir", "data_dir", "shared_fs", "become"]
    table = Table(title=plain(f"{inventory.path or 'inventory'} ({inventory.format}): {len(rows)} hosts, world size {inventory.world_size}, rendezvous port {inventory.rendezvous_port}"))
    for col in columns:
        table.add_column(col)
    for row in rows:
        cells = [plain(row[c]) for c in columns]
        if row["master"]:
            cells[1].append(" (master)")
        table.add_row(*cells)
    out = console()
    out.print(table)
    for name, keys in inventory.ignored.items():
        out.print(plain(f"{name}: ignored vars not used by mnft: {', '.join(keys)}", style="dim"))


def print_results(title: str, results: Results, as_json: bool) -> None:
    if as_json:
        print_json({r.host: {"status": r.status.value, "exit_code": r.exit_code, "error": r.error or None, "seconds": r.seconds} for r in results})
        return
    table = Table(title=plain(title))
    for col in ("host", "status", "seconds", "detail"):
        table.add_column(col)
    for r in results:
        table.add_row(plain(r.host), status_text(r.status.value), f"{r.seconds:.2f}", plain(r.error or ""))
    console().print(table)


def print_trust(results: Iterable[TrustResult], as_json: bool) -> None:
    results = list(results)
    if as_json:
        print_json([r.__dict__ for r in results])
        return
    table = Table(title="host keys")
    for col in ("host", "known as", "type", "fingerprint", "result"):
        table.add_column(col)
    for r in results:
        style = {"recorded": "yellow", "already-trusted": "green"}.get(r.state, "bold red")
        table.add_row(plain(r.name), plain(r.known_as), plain(r.key_type), plain(r.fingerprint), Text(r.state + (f": {r.detail}" if r.detail else ""), style=style))
    console().print(table)


LAB_STYLE = {"free": "green", "held": "yellow", "outside": "magenta", "waiting": "cyan", "unreachable": "red", "failed": "red",
             "host-key-rejected": "red", "drained": "blue", "unhealthy": "bold red"}


def print_lab(inventory: Inventory, views: dict[str, dict], as_json: bool, seconds: float) -> int:
    """`mnft lab`: host × device → free / held (user, run, command, since) / in use outside mnft, memory and
    utilisation, each GPU's health, then each host's line of waiting runs. Exit 0, 4 when a host did not answer, 1 when a
    host's GPUs did not (a stalled nvidia-smi, named)."""
    from mnft.core.errors import ExitCode
    from mnft.hosts.lab import collision_line, rows, since, users

    table_rows = rows(inventory, views)
    per_user = users(inventory, views, table_rows)
    unanswered = [name for name, v in views.items() if v.get("error") and not v.get("devices")]
    unread = [name for name, v in views.items() if v.get("devices_error") and not v.get("devices")]  # its GPUs did not answer
    kernel_log = kernel_log_unread(views)
    if as_json:
        print_json({"hosts": [h.name for h in inventory.hosts], "seconds": round(seconds, 3), "devices": [r.to_json() for r in table_rows],
                    "kernel_log": kernel_log, "users": per_user["users"], "limits": per_user["limits"]})
        return ExitCode.UNREACHABLE if unanswered else ExitCode.FAILED if unread else ExitCode.OK
    free = sum(1 for r in table_rows if r.state == "free")
    devices = sum(1 for r in table_rows if r.state in ("free", "held", "outside", "drained", "unhealthy"))
    table = Table(title=plain(f"{inventory.path or 'the lab'}: {free} of {devices} device(s) free on {len(inventory.hosts)} host(s) "
                              f"(asked in {seconds:.2f}s)"))
    images = any(r.image for r in table_rows)  # the column only where a run in an image holds a device
    health = any(r.health for r in table_rows)  # the column only where a GPU is not well
    for col in ("host", "device", "state", "user", "run", "command", *(("image",) if images else ()), "since", "memory", "util",
                *(("health",) if health else ()), "detail"):
        table.add_column(col)
    for r in table_rows:
        detail = r.detail or (r.drain if r.drain and r.state != "drained" else "") or (f"supervised on {r.supervisor}" if r.supervisor else "")
        detail += f" — {r.why}" if r.why else ""
        table.add_row(plain(r.host), plain(r.device), plain(r.state, LAB_STYLE.get(r.state, "")), plain(r.user or ""), plain(r.run or ""),
                      plain(r.command or ""), *((plain(r.image or ""),) if images else ()), plain(since(r.since)), plain(r.memory or ""),
                      plain("" if r.utilization is None else f"{r.utilization}%"), *((plain(r.health or "", "red"),) if health else ()), plain(detail))
    console().print(table)
    for r in table_rows:  # a process on a GPU another run or session holds: named under the table, one line each
        line = collision_line(r)
        if line:
            console().print(plain(line, style="bold magenta"))
    print_users(per_user)
    if kernel_log:  # once for every host whose kernel log this user may not read, not a line per host
        hosts = ", ".join(sorted(kernel_log))
        console().print(plain(f"{hosts}: {next(iter(kernel_log.values()))}" if len(set(kernel_log.values())) == 1
                              else "; ".join(f"{h}: {w}" for h, w in sorted(kernel_log.items())), style="yellow"))
    for name, view in views.items():  # what the hosts said of their GPUs' reads: a drain mark not honoured
        if view.get("drain_problem"):
            console().print(plain(f"{name}: {view['drain_problem']}", style="red"))
        if (view.get("policy") or {}).get("problem"):  # a limit of the lab's policy that does not read: not applied
            console().print(plain(f"{name}: {view['policy']['problem']}", style="red"))
    return ExitCode.UNREACHABLE if unanswered else ExitCode.FAILED if unread else ExitCode.OK


def print_users(per_user: dict) -> None:
    """Under `mnft lab`'s table: each user's GPUs held and runs waiting in line (mnft.hosts.lab.users), and the lab's
    per-user limits when a host sets any."""
    from mnft.hosts.lab import limits_line

    limits = per_user["limits"]
    limited = limits.get("differ") or any(limits.get(k) is not None for k in ("max_gpus_while_others_wait", "max_waiting"))
    if per_user["users"]:
        table = Table(title="users")
        for col in ("user", "GPUs held", "waiting in line", *(("at max_gpus_while_others_wait on",) if limited else ())):
            table.add_column(col)
        for u in per_user["users"]:
            held = str(u["gpus_held"]) + (f" ({', '.join(f'{h}: {n}' for h, n in u['held_on'].items())})" if len(u["held_on"]) > 1 else "")
            table.add_row(plain(u["user"]), plain(held), plain(str(u["waiting"])), *((plain(", ".join(u["at_limit_on"])),) if limited else ()))
        console().print(table)
    if limited:
        console().print(plain(limits_line(limits), style="cyan"))


def kernel_log_unread(views: dict[str, dict]) -> dict[str, str]:
    """host -> why its kernel log (the Xids) is not readable by this user, for each host where it is not: the state
    `mnft lab --json` carries and the one line under the table; not a failure of the look (exit status unchanged)."""
    out = {}
    for name, view in views.items():
        why = next((d["health"]["kmsg"] for d in view.get("devices") or [] if (d.get("health") or {}).get("kmsg")), None)
        if why:
            out[name] = str(why)[:300]
    return out


def print_usage(inventory: Inventory, summary: dict, errors: dict[str, str], as_json: bool, days: float) -> int:
    """`mnft lab --usage`: GPU-hours per user and per host and their idle share, the longest waits in line.
    Exit 0, or 4 when a host did not answer (its usage is not counted, and named)."""
    from mnft.core.errors import ExitCode
    from mnft.hosts.lab import since as ago

    code = ExitCode.UNREACHABLE if errors else ExitCode.OK
    if as_json:
        print_json(dict(summary, errors=errors))
        return code
    span = f"{days:g} day(s)" if days >= 1 else f"{days * 24:g} hour(s)"
    for key, title in (("users", "user"), ("hosts", "host")):
        table = Table(title=plain(f"{inventory.path or 'the lab'}: GPU-hours per {title}, the last {span}"))
        for col in (title, "GPU-hours", "idle", "leases"):
            table.add_column(col)
        for row in summary[key]:
            leases = str(row["leases"]) + (f" ({row['running']} running)" if row.get("running") else "")
            table.add_row(plain(row[title]), plain(f"{row['gpu_hours']:.2f}"), plain(f"{row['idle_share'] * 100:.0f}%"), plain(leases))
        console().print(table)
    if summary["longest_waits"]:
        table = Table(title=plain("the longest waits in line"))
        for col in ("host", "user", "run", "command", "waited", "queued"):
            table.add_column(col)
        for w in summary["longest_waits"]:
            table.add_row(plain(w["host"]), plain(w["user"]), plain(w["run"] or ""), plain(w["command"] or ""), plain(f"{w['waited_s']:.0f}s"),
                          plain(ago(w["queued"]) + " ago"))
        console().print(table)
    for host, error in errors.items():
        console().print(plain(f"{host}: not counted: {error}", "yellow"))
    return code
