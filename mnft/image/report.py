"""`sync --image` as a person reads it (a row per host: status, the id it holds, where its copy came from), or JSON."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from mnft.core.output import console, fmt_size, plain, print_json, status_text
from mnft.image.distribute import CONTROLLER, ImageReport, short


def print_image_sync(report: ImageReport, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
        return
    out = console()
    source = "this machine" if report.source == CONTROLLER else report.source
    verb = "would sync" if report.dry_run else "sync"
    how = ", relayed host to host" if report.relay else ""
    size = f", {fmt_size(report.archive_bytes)}" if report.archive_bytes else ""
    table = Table(title=plain(f"{verb} image {report.image} ({short(report.reference)}, from {source}{size}{how})"))
    for col in ("host", "status", "image id", "id match", "via", "sent by this machine", "seconds", "detail"):
        table.add_column(col)
    for h in report.hosts.values():
        match = "-" if h.id is None else ("yes" if h.id == report.reference else "NO")
        detail = h.error or "; ".join(h.notes)
        table.add_row(plain(h.host), status_text(h.status), plain(short(h.id) if h.id else None), Text(match, style={"yes": "green", "NO": "bold red"}.get(match, "")),
                      plain(h.via or None), fmt_size(h.controller_bytes), f"{h.seconds:.2f}", plain(detail))
    out.print(table)
    if not report.dry_run:
        fetched = f"fetched {fmt_size(report.fetched_bytes)} from {source} and " if report.fetched_bytes else ""
        out.print(plain(f"this machine {fetched}sent {fmt_size(report.controller_bytes)} in {report.seconds:.1f} s", style="dim"))
