"""The sync as a person reads it (a row per host; with --dry-run, what would be sent and deleted), or JSON."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from mnft.core.output import console, fmt_size, print_json, status_text
from mnft.sync.mirror import SHOWN_DIFFERENCES, Difference, SyncReport, SyncStatus


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
            h.host, Text(h.status, style="bold red") if h.status in (SyncStatus.REFUSED, SyncStatus.CONFLICT) else status_text(h.status), h.target, str(files), str(deleted), fmt_size(h.bytes_sent),
            Text(match, style={"yes": "green", "NO": "bold red"}.get(match, "")), f"{h.seconds:.2f}", h.error,
        )
    out.print(table)
    for h in report.hosts.values():
        if report.dry_run and (h.would_send or h.would_delete):
            out.print(Text.assemble((f"{h.host}", "bold"), ":"))
            for line in Difference(tuple(h.would_send), tuple(h.would_delete)).describe():
                out.print(f"  {line.replace('differs: ', 'send: ').replace('extra: ', 'remove: ')}", highlight=False, markup=False)
        if h.conflicts:  # in the way, not mnft's: named, never overwritten (unless forced: then replaced)
            verb = "in the way (not placed by mnft, left as they are)" if h.status in (SyncStatus.CONFLICT, SyncStatus.WOULD_CHANGE) \
                else "replaced (--force)"
            out.print(Text.assemble((f"{h.host}", "bold red" if h.status == SyncStatus.CONFLICT else "bold"), f": {verb}:"))
            for path in h.conflicts[:SHOWN_DIFFERENCES]:
                out.print(f"  conflict: {path}", highlight=False, markup=False)
            if len(h.conflicts) > SHOWN_DIFFERENCES:
                out.print(f"  … {len(h.conflicts) - SHOWN_DIFFERENCES} more", highlight=False, markup=False)
        if h.kept:
            out.print(Text.assemble((f"{h.host}", "bold"), ": kept (placed by mnft, changed on the host since; the source no longer has them):"))
            for path in h.kept[:SHOWN_DIFFERENCES]:
                out.print(f"  kept: {path}", highlight=False, markup=False)
        if h.differing:
            out.print(Text.assemble((f"{h.host}", "red"), ": files that differ:"))
            for line in h.differing[:SHOWN_DIFFERENCES]:
                out.print(f"  {line}", highlight=False, markup=False)
