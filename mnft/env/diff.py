"""Python environments compared: a host's installed distributions against a lock, or against another host.

Pure: name -> version mappings (read from metadata on the hosts, never by importing) in; differences and the
one-line description a person reads out (`numpy 2.1.0 (master: 1.26.4); extra: foo 0.3; missing: bar 1.0`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:  # a lock's pins are only compared here: check compares hosts without reading a lock (nor packaging)
    from mnft.env.lockfile import Pin


def canonical(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class EnvDiff:
    changed: tuple[tuple[str, str, str], ...] = ()  # (name, this host's version, the reference's)
    extra: tuple[tuple[str, str], ...] = ()  # only on this host
    missing: tuple[tuple[str, str], ...] = ()  # only in the reference
    python: tuple[str, str] | None = None  # (this host's Python X.Y, the reference's) when they differ

    @property
    def empty(self) -> bool:
        return not (self.changed or self.extra or self.missing or self.python)

    def describe(self, label: str, limit: int = 12) -> str:
        parts = []
        if self.python:
            parts.append(f"Python {self.python[0] or 'none'} ({label}: {self.python[1] or 'none'})")
        parts += [f"{name} {mine} ({label}: {theirs})" for name, mine, theirs in self.changed]
        if self.extra:
            parts.append("extra: " + ", ".join(f"{n} {v}" for n, v in self.extra))
        if self.missing:
            parts.append("missing: " + ", ".join(f"{n} {v}" for n, v in self.missing))
        text = "; ".join(parts)
        count = len(self.changed) + len(self.extra) + len(self.missing)
        if len(parts) > limit:
            text = "; ".join(parts[:limit]) + f"; … ({count} packages differ)"
        return text

    def to_json(self) -> dict:
        return {"changed": [list(c) for c in self.changed], "extra": [list(e) for e in self.extra],
                "missing": [list(m) for m in self.missing], "python": list(self.python) if self.python else None}


def compare(mine: Mapping[str, str], reference: Mapping[str, str], *, same_version=None, ignore: Iterable[str] = ()) -> EnvDiff:
    """How `mine` differs from `reference` (both name -> version; names canonicalised here). same_version(name,
    mine, reference) decides whether two versions are the same (default: equal text)."""
    same_version = same_version or (lambda name, a, b: a == b)
    skip = {canonical(n) for n in ignore}
    a = {canonical(n): v for n, v in mine.items() if canonical(n) not in skip}
    b = {canonical(n): v for n, v in reference.items() if canonical(n) not in skip}
    changed = tuple((n, a[n], b[n]) for n in sorted(a.keys() & b.keys()) if not same_version(n, a[n], b[n]))
    extra = tuple((n, a[n]) for n in sorted(a.keys() - b.keys()))
    missing = tuple((n, b[n]) for n in sorted(b.keys() - a.keys()))
    return EnvDiff(changed, extra, missing)


def against_lock(installed: Mapping[str, str], pins: Iterable[Pin]) -> EnvDiff:
    """An environment against the lock's pins for that host (a +local label on the wheel matches a bare pin)."""
    by_name = {p.name: p for p in pins}
    return compare(installed, {n: p.version for n, p in by_name.items()},
                   same_version=lambda name, have, want: by_name[name].matches(have))


def fingerprint(python: str | None, dists: Mapping[str, str]) -> str:
    """sha256 of the Python X.Y and the sorted name==version lines: equal fingerprints, equal environments."""
    minor = ".".join((python or "").split(".")[:2])
    lines = [f"python {minor}"] + sorted(f"{canonical(n)}=={v}" for n, v in dists.items())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


@dataclass
class Changes:
    """What provisioning a host does to its environment, for --dry-run and the report."""

    install: list[str] = field(default_factory=list)  # "name version"
    upgrade: list[str] = field(default_factory=list)  # "name old -> new"
    remove: list[str] = field(default_factory=list)  # "name version"

    @classmethod
    def of(cls, diff: EnvDiff) -> "Changes":
        return cls([f"{n} {v}" for n, v in diff.missing], [f"{n} {mine} -> {theirs}" for n, mine, theirs in diff.changed],
                   [f"{n} {v}" for n, v in diff.extra])

    @property
    def count(self) -> int:
        return len(self.install) + len(self.upgrade) + len(self.remove)
