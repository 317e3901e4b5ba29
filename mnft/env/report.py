"""What provision did, per host and in all: the outcome values, the table a person reads, and --json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from rich.table import Table
from rich.text import Text

from mnft.core.errors import ExitCode
from mnft.core.output import console, fmt_size, plain, print_json, status_text
from mnft.env.diff import Changes, EnvDiff
from mnft.env.lockfile import Lock
from mnft.hosts.settings import Inventory


@dataclass
class HostOutcome:
    host: str
    status: str  # ok | changed | would-change | rolled-back | failed | unreachable | host-key-rejected | refused
    action: str = "none"  # the plan's: none | install | rollback | verify (a shared environment another host built) | skip
    error: str = ""
    before: EnvDiff | None = None
    after: EnvDiff | None = None
    changes: Changes = field(default_factory=Changes)
    python: str | None = None
    env: str | None = None  # the environment directory in use after the run
    fingerprint: str | None = None
    via: str = ""  # who sent the wheels: controller / a peer
    controller_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "status": self.status, "action": self.action, "error": self.error or None,
            "before": self.before.to_json() if self.before else None, "after": self.after.to_json() if self.after else None,
            "install": self.changes.install, "upgrade": self.changes.upgrade, "remove": self.changes.remove,
            "python": self.python, "env": self.env, "fingerprint": self.fingerprint, "via": self.via or None,
            "controller_bytes": self.controller_bytes, "seconds": self.seconds, "notes": self.notes,
        }


@dataclass
class ProvisionReport:
    inventory: Inventory
    lock: Lock | None
    python: str | None
    hosts: dict[str, HostOutcome]
    dry_run: bool = False
    rollback: bool = False
    relay: bool = False
    wheelhouse_bytes: int = 0  # the wheels (and uv) sent to the hosts, once
    controller_bytes: int = 0  # what the controller's rsyncs sent in all
    seconds: float = 0.0

    @property
    def changed(self) -> int:
        return sum(1 for o in self.hosts.values() if o.status in ("changed", "rolled-back"))

    def exit_code(self) -> ExitCode:
        statuses = [o.status for o in self.hosts.values()]
        if any(s in ("unreachable", "host-key-rejected") for s in statuses):
            return ExitCode.UNREACHABLE
        if any(s == "failed" for s in statuses):
            return ExitCode.FAILED
        return ExitCode.OK

    def to_json(self) -> dict:
        return {
            "inventory": str(self.inventory.path) if self.inventory.path else None,
            "lock": str(self.lock.path) if self.lock else None, "lock_sha256": self.lock.digest if self.lock else None,
            "python": self.python, "dry_run": self.dry_run, "rollback": self.rollback, "relay": self.relay,
            "changed": self.changed, "wheelhouse_bytes": self.wheelhouse_bytes, "controller_bytes": self.controller_bytes,
            "seconds": self.seconds, "exit_code": int(self.exit_code()),
            "hosts": {name: o.to_json() for name, o in self.hosts.items()},
        }


SHARED_UNKNOWN = "shared environments are not detected in a dry run: a real run may build once and verify, or refuse hosts that differ"


def print_table(title: str, hosts: Mapping[str, HostOutcome], report: ProvisionReport, out=None) -> None:
    """One row per host: status, Python, environment fingerprint, how it differs from the lock."""
    out = out or console()
    table = Table(title=plain(title))
    for col in ("host", "status", "python", "env", "differs from the lock"):
        table.add_column(col)
    for name, o in hosts.items():
        status, detail, style = cells(o)
        table.add_row(plain(name), status_text(status) if status == o.status else Text(status, style="yellow"), plain(o.python),
                      plain(o.fingerprint[:12] if o.fingerprint else None), Text(detail, style=style))
    out.print(table)


PENDING = {"install": "to install", "rollback": "to roll back", "verify": "to verify"}


def cells(o: HostOutcome) -> tuple[str, str, str]:
    """A host's status and how it differs from the lock, as its row says them (and the detail's style). Read before
    anything changed, a host whose environment does not match is not `ok`: it says what provision will do there
    ("to install") and what is missing (a host without an environment lacks every package of the lock)."""
    diff = o.after if o.after is not None else o.before
    status = PENDING.get(o.action, o.status) if o.status == "ok" and o.after is None else o.status
    if o.error:
        return status, o.error, "red"
    if diff is None:
        return status, "-", "dim"
    if diff.empty:
        return status, "identical", "green"
    if o.fingerprint is None and o.after is None and diff.missing and not diff.changed and not diff.extra:
        return status, f"no environment yet: all {len(diff.missing)} packages of the lock missing", "yellow"
    return status, diff.describe("lock"), "yellow"


def print_report(report: ProvisionReport, as_json: bool, out=None) -> None:
    if as_json:
        print_json(report.to_json())
        return
    out = out or console()
    if report.dry_run:
        for name, o in report.hosts.items():
            if o.status == "would-change":
                c = o.changes
                parts = [f"install {', '.join(c.install)}" if c.install else "", f"upgrade {', '.join(c.upgrade)}" if c.upgrade else "",
                         f"remove {', '.join(c.remove)}" if c.remove else ""]
                out.print(plain(f"{name}: would build a new environment: " + ("; ".join(p for p in parts if p) or "rebuild (incomplete)")))
        would = sum(o.status == "would-change" for o in report.hosts.values())
        if would and len(report.hosts) > 1:  # the marks that find a shared environment are left by a real run only
            out.print(plain(SHARED_UNKNOWN, style="yellow"))
        out.print(plain(f"dry run: {would} host(s) would change; nothing was changed"))
        return
    quiet = not report.rollback and report.changed == 0 and report.exit_code() == ExitCode.OK  # the "before" table said it all
    if not quiet:
        print_table("rollback" if report.rollback else "after", report.hosts, report, out)
    for name, o in report.hosts.items():
        for note in o.notes:
            out.print(plain(f"{name}: {note}", style="dim"))
    if not report.rollback and report.changed == 0 and report.exit_code() == ExitCode.OK:
        out.print(plain(f"nothing to do: every host's environment matches {report.lock.path.name if report.lock else 'the lock'} (0 changed, {report.seconds:.2f}s)", style="green"))
    elif not report.rollback:
        sent = f"; the controller sent {fmt_size(report.controller_bytes)} for a wheelhouse of {fmt_size(report.wheelhouse_bytes)}" if report.wheelhouse_bytes else ""
        shared = sum(1 for o in report.hosts.values() if o.action == "verify" and o.status == "changed")
        once = f", {shared} of them by verifying the build of a host they share their environment with" if shared else ""
        out.print(plain(f"{report.changed} host(s) changed in {report.seconds:.1f}s{once}" + (" (relayed over the mesh)" if report.relay else "") + sent))
