"""What uninstall found and did: one table (a row per host and item, this machine's last) and --json."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from mnft.core.output import command, console, fmt_size, plain, print_json, status_text
from mnft.uninstall.plan import Item, freed
from mnft.uninstall.uninstall import UninstallReport

HERE = "(this machine)"
SETUP_HINT = "setup's changes (SSH mesh, /etc/hosts, firewall) are undone by {}"


def cell(item: Item, dry_run: bool) -> tuple[str, str]:
    """What happens (or happened) to an item, and its style."""
    if dry_run or not item.outcome:
        return ("would remove" if item.action == "remove" else "would remove if empty" if item.action == "remove if empty" else "keep",
                "yellow" if item.action != "keep" else "dim")
    return item.outcome, {"removed": "green", "failed": "red"}.get(item.outcome, "dim")


def print_report(report: UninstallReport, as_json: bool, out=None) -> None:
    if as_json:
        print_json(report.to_json())
        return
    out = out or console()
    table = Table(title=plain("uninstall --dry-run" if report.dry_run else "uninstall"))
    for col in ("host", "what", "path", "size", "action", "why"):
        table.add_column(col)
    rows = [(name, o.status, o.error, o.items) for name, o in report.hosts.items()] + [(HERE, "ok", "", report.controller)]
    for name, status, error, items in rows:
        if error or not items:
            table.add_row(plain(name), Text("-" if not error else "", style="dim"), plain(None), plain(None), status_text(status if error else "nothing"),
                          plain(error or "nothing of mnft's here", style="red" if error else "dim"))
        for item in items:
            action, style = cell(item, report.dry_run)
            size = fmt_size(item.bytes) if item.bytes else (f"{item.files} file(s)" if item.files else "-")
            table.add_row(plain(name), plain(item.key), plain(item.path), plain(size), Text(action, style=style), plain(item.why, style="dim"))
    out.print(table)
    total = sum(freed(o.items) for o in report.hosts.values()) + freed(report.controller)
    if report.dry_run:
        would = sum(o.status == "would-remove" for o in report.hosts.values())
        out.print(plain(f"dry run: {would} host(s) and this machine would free {fmt_size(total)}; nothing was changed"))
    else:
        counts = {}
        for o in report.hosts.values():
            counts[o.status] = counts.get(o.status, 0) + 1
        said = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        out.print(plain(f"uninstall: {said}; {fmt_size(total)} freed in {report.seconds:.1f}s"))
    if not report.include_outputs and any(i.why.startswith("what runs wrote") for o in report.hosts.values() for i in o.items):
        out.print(plain("the runs' outputs stay: --include-outputs removes them too", style="dim"))
    out.print(plain(SETUP_HINT.format(command("setup --undo")), style="dim"))
