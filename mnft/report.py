"""What a person reads: rich tables, one row per host; and the same data as JSON for machines."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mnft.check import GIB, CheckReport, comparable, reference_host
from mnft.connection import fabric_connection, ssh_target, Timeouts
from mnft.fleet import Results, Status
from mnft.hostkeys import TrustResult
from mnft.inventory import Inventory
from mnft.sync import SHOWN_DIFFERENCES, Difference, SyncReport, SyncStatus

STATUS_STYLE = {
    "ok": "green",
    "changed": "yellow",
    "failed": "red",
    "unreachable": "magenta",
    "host-key-rejected": "bold red",
    "recorded": "yellow",
    "already-trusted": "green",
    "changed-key": "bold red",
}


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 200)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def status_text(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def plain(value: Any, style: str = "") -> Text:
    """A cell or title from data (host names, paths, errors): never read as rich markup ("a[/b]", "[bold]x")."""
    return Text("-" if value is None else str(value), style=style)


def fmt_size(n: int | float) -> str:
    """Bytes for a person: 512 B, 1.5 MiB, 43.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ------------------------------------------------------------------------------------------------ inventory


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


# ------------------------------------------------------------------------------------------------ check


def _gpus(facts: dict) -> str:
    gpus = (facts.get("nvidia") or {}).get("gpus") or []
    if not gpus:
        return "0"
    names = {g.get("name") for g in gpus}
    return f"{len(gpus)}× {', '.join(sorted(n for n in names if n))}"


def _code(code: dict | None) -> Text:
    """The workdir's code hash (short) and whether it matches the local tree; '-' when there is no workdir."""
    if not code or not code.get("exists") or not code.get("hash"):
        return Text("-" if not code or not code.get("error") else "?", style="dim")
    same = code.get("matches")
    return Text(code["hash"][:10] + (" =" if same else " ≠"), style="green" if same else "bold red")


def print_check(report: CheckReport, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
        return
    inv = report.inventory
    ref_name = reference_host(inv, report.facts)
    reference = comparable(report.facts[ref_name]) if ref_name is not None else {}
    table = Table(title=plain(f"check: {len(inv.hosts)} hosts, master {inv.master_name} ({report.master_addr or '?'}:{report.port or inv.rendezvous_port})"))
    for col in ("rank", "host", "status", "python", "torch", "cuda", "nccl", "driver", "gpus/slots", "disk free", "iface", "reach master", "clock", "code"):
        table.add_column(col)
    for host in inv.hosts:
        status = report.status(host.name)
        facts = report.facts.get(host.name)
        if facts is None:
            outcome = report.outcomes[host.name]
            table.add_row(str(host.rank), plain(host.name), status_text(status), Text(outcome.error or "", style="dim"), *[""] * 10)
            continue
        mine = comparable(facts)

        def cell(key: str) -> Text:
            value = mine[key]
            differs = bool(reference) and host.name != ref_name and value != reference.get(key)
            return Text(str(value) if value is not None else "-", style="bold red" if differs else "")

        disk = facts.get("disk") or {}
        free = disk.get("free_bytes")
        reach = report.reach.get(host.name)
        iface = host.iface or (reach.iface if reach else None) or "-"
        reach_text = Text("-") if reach is None else Text("yes" if reach.ok else "NO", style="green" if reach.ok else "bold red")
        skew = report.skew.get(host.name)
        table.add_row(
            str(host.rank),
            plain(host.name + (" *" if host.name == inv.master_name else "")),
            status_text(status),
            cell("python"),
            cell("torch"),
            cell("cuda"),
            cell("nccl"),
            cell("driver"),
            plain(f"{_gpus(facts)}/{host.slots}"),
            f"{free / GIB:.1f} GiB" if isinstance(free, int) else "-",
            plain(iface),
            reach_text,
            f"{skew:+.2f}s" if skew is not None else "-",
            _code(report.code.get(host.name)),
        )
    out = console()
    out.print(table)
    if ref_name is not None and ref_name != inv.master_name:
        out.print(plain(f"versions compared with {ref_name}, the first host that answered (the master {inv.master_name} did not)", style="yellow"))
    problems = report.problems
    unreachable = [report.outcomes[h.name] for h in inv.hosts if report.outcomes[h.name].status is not Status.OK]
    if not problems and not unreachable:
        out.print("[green]every host can join the job[/green]")
        return
    for outcome in unreachable:
        out.print(Text.assemble((f"{outcome.host}: {outcome.status.value}", STATUS_STYLE[outcome.status.value]), f": {outcome.error}"))
    for p in problems:
        style = "yellow" if p.severity == "warning" else "red"
        out.print(Text.assemble((f"{p.host}: {p.field}", style), f": {p.message}\n    fix: {p.fix}"))


# ------------------------------------------------------------------------------------------------ sync


def print_sync(report: SyncReport, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
        return
    out = console()
    verb = "would sync" if report.dry_run else "sync"
    table = Table(title=f"{verb} {report.kind}: {report.src} ({report.local_files} files, {fmt_size(report.local_bytes)}, hash {report.local_hash[:12]})")
    for col in ("host", "status", "target", "files", "deleted", "bytes sent", "hash match", "seconds", "detail"):
        table.add_column(col)
    for h in report.hosts.values():
        match = "-" if h.remote_hash is None else ("yes" if h.remote_hash == report.local_hash else "NO")
        files = len(h.would_send) if report.dry_run else h.files_changed
        deleted = len(h.would_delete) if report.dry_run else h.files_deleted
        table.add_row(
            h.host, Text(h.status, style="bold red") if h.status == SyncStatus.REFUSED else status_text(h.status), h.target, str(files), str(deleted), fmt_size(h.bytes_sent),
            Text(match, style={"yes": "green", "NO": "bold red"}.get(match, "")), f"{h.seconds:.2f}", h.error,
        )
    out.print(table)
    for h in report.hosts.values():
        if report.dry_run and (h.would_send or h.would_delete):
            out.print(f"[bold]{h.host}[/bold]:")
            for line in Difference(tuple(h.would_send), tuple(h.would_delete)).describe():
                out.print(f"  {line.replace('differs: ', 'send: ').replace('extra: ', 'delete: ')}", highlight=False, markup=False)
        if h.differing:
            out.print(f"[red]{h.host}[/red]: files that differ:")
            for line in h.differing[:SHOWN_DIFFERENCES]:
                out.print(f"  {line}", highlight=False, markup=False)


# ------------------------------------------------------------------------------------------------ generic


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


def fmt_loss(value) -> str:
    """A loss as text: 4 decimals, or as the recipe wrote it ("nan", "inf": JSON has no NaN), or "-" for none."""
    if isinstance(value, (int, float)):
        return f"{value:.4f}"
    return str(value) if value is not None else "-"


def print_status(record, states: dict[str, dict], as_json: bool, live: dict | None = None) -> int:
    """A row per host; returns the exit code: 0 healthy (running or exited 0 everywhere), 1 not, 4 unreachable.
    live: what the run's attached supervisor says (its attempt, when restarting: healthy while it recovers)."""
    from mnft.errors import ExitCode

    if as_json:
        print_json({"run": record.run_id, "hosts": states, **({"supervisor": live} if live else {})})
    else:
        job = record.data.get("job") or {}
        label = job.get("name") or (f"recipe {record.data.get('recipe')}" if record.data.get("recipe") else " ".join(job.get("entry") or ["?"]))
        table = Table(title=plain(f"run {record.run_id} ({label}, {len(states)} hosts)"))
        for col in ("host", "node_rank", "state", "exit code", "processes", "step", "loss", "since", "last line"):
            table.add_column(col)
        import time as _time

        for name, st in states.items():
            metric = st.get("last_metric") or {}
            since = st.get("ended") or st.get("started")
            state = st.get("state", "?")
            style = {"running": "green", "exited": "green" if st.get("exit_code") == 0 else "red"}.get(state, "magenta")
            table.add_row(
                plain(name),
                str(record.data["hosts"][name]["node_rank"]),
                Text(state, style=style),
                str(st.get("exit_code")) if st.get("exit_code") is not None else "-",
                str(st.get("processes", "-")),
                str(metric["step"]) if metric.get("step") is not None else "-",
                plain(fmt_loss(metric.get("loss"))),
                f"{_time.time() - since:.0f}s ago" if since else plain(st.get("error") or "-"),
                plain((st.get("last_line") or "")[-60:] or "-"),
            )
        console().print(table)
        if live and live.get("max_restarts"):
            console().print(plain(f"attempt {live.get('attempt')}/{live['max_restarts'] + 1}: {live.get('state')}"
                                  + (f" ({live['note']})" if live.get("note") else ""), "yellow" if (live.get("attempt") or 1) > 1 else ""))
        for name, st in states.items():
            if st.get("meaning"):
                console().print(plain(f"{name}: exit code {st.get('exit_code')}: {st['meaning']}", "yellow"))
            if st.get("straggler"):
                console().print(plain(f"straggler {name}: {st['straggler']['why']} — see docs/perf.md", "bold yellow"))
    if any(st.get("state") in ("unreachable", "host-key-rejected") for st in states.values()):
        return ExitCode.UNREACHABLE
    healthy = all(st.get("state") == "running" or (st.get("state") == "exited" and st.get("exit_code") == 0) for st in states.values())
    recovering = bool(live) and live.get("state") in ("waiting", "starting", "running")
    return ExitCode.OK if healthy or recovering else ExitCode.FAILED


def print_stop(record, result: dict[str, dict], as_json: bool) -> int:
    from mnft.errors import ExitCode

    if as_json:
        print_json({"run": record.run_id, "hosts": result})
    else:
        table = Table(title=plain(f"stop run {record.run_id}"))
        for col in ("host", "killed", "remaining", "gpus held"):
            table.add_column(col)
        for name, r in result.items():
            if "remaining" not in r:
                table.add_row(plain(name), Text(r.get("state", "?"), style="magenta"), plain(r.get("error", "")), "")
                continue
            table.add_row(plain(name), ", ".join(map(str, r["killed"])) or "-", Text(", ".join(map(str, r["remaining"])) or "none", style="red" if r["remaining"] else "green"), ", ".join(map(str, r.get("gpus_held") or [])) or "-")
        console().print(table)
    if any("remaining" not in r for r in result.values()):
        return ExitCode.UNREACHABLE
    return ExitCode.FAILED if any(r["remaining"] for r in result.values()) else ExitCode.OK
