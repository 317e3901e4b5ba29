"""`invoke sync`: the same code (and data) on every host, proven by a tree hash.

Three layers, as everywhere in mnft:

* read: the local tree (mnft.sync.source: which files, by git's rules and the configured excludes, and their hash) and
  each host's copy (the stdlib `mnft.onhost.treehash` script shipped through pyrun: real paths of the target and of the
  home, every file's size and sha256);
* plan (pure): per host, nothing to do / rsync with an exact argv (mnft.sync.rsync) / verify only (a shared filesystem
  another host wrote) / refused (the target resolves to `/` or the home: mnft.sync.targets). Tested with data: trees
  in, argv out;
* apply: rsync on every host at once (bounded pool), progress per host, then each host hashes its copy again
  and any difference fails that host, naming the files.

The exclude rules go to rsync and to every host's hash alike. Nothing that exists only on a host is ever deleted or
overwritten: each directory mnft writes keeps a record of what it placed there (checkout.PLACED); a sync removes only
a recorded file the source no longer has and that is still as mnft left it, and a host file in the way of a source
file that the record does not name (a run's output, a person's file) is a conflict, named, nothing written on that
host, unless forced (`placement`, pure). A run's code goes into a snapshot of its own tree hash
(`<workdir>/.mnft/code/<hash>`, read-only, unchanged files hard-linked from the snapshots beside it) and from there,
as hard links, into its job's working directory (`<workdir>/outputs/<job>`): see mnft.sync.snapshot. Printing is
mnft.sync.report's.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from mnft.core.errors import ExitCode, InputError, MnftError
from mnft.hosts import leases, pyrun
from mnft.hosts.command import Command
from mnft.hosts.connection import Timeouts
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.settings import Host, Inventory
from mnft.sync.rsync import (
    SSH_CONNECT_TIMEOUT,
    RsyncOutcome,
    SshSettings,
    classify,
    rsync_argv,
    rules_file_bytes,
    run_rsync,
    supports_mkpath,
)
from mnft.sync.source import LocalTree, code_source, read_local
from mnft.sync.targets import normalize_target, preflight, remote_refusal, source_problem

KEEP_SNAPSHOTS = 8  # a host's code snapshots kept beside the one a sync places (checkout.prune)
HASH_TIMEOUT = 1800.0  # a first hash of a large data set reads every byte
SHOWN_DIFFERENCES = 20


class SyncStatus:
    OK = "ok"  # already identical: nothing sent
    CHANGED = "changed"  # synced and verified identical
    WOULD_CHANGE = "would-change"  # --dry-run: differs, nothing sent
    REFUSED = "refused"  # the target is dangerous on that host (resolves to /, the home, ...): bad input, nothing touched
    CONFLICT = "conflict"  # a host file mnft did not place is in the way of a source file: nothing written there
    FAILED = "failed"
    UNREACHABLE = Status.UNREACHABLE.value
    HOST_KEY_REJECTED = Status.HOST_KEY_REJECTED.value


# ------------------------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class RemoteTree:
    """A host's copy as its treehash probe saw it."""

    root: str  # real path
    home: str  # real path of the home
    exists: bool
    digest: str | None
    files: dict[str, tuple[int, str]]
    errors: dict[str, str] = field(default_factory=dict)
    refused: str | None = None  # the probe's refusal, judged before it walked anything
    rsync: str | None = ""  # the host's rsync version; None: not installed; "": not reported
    mark: Sighting | None = None  # asked to mark and look (read_remote with mark and names): what it saw
    placed: dict[str, tuple[int, str]] | None = None  # the record of what mnft placed there (None: none)
    siblings: tuple[str, ...] = ()  # the code snapshots beside it, newest first
    kept: dict[str, str] = field(default_factory=dict)  # recorded files the sync was to remove but found changed
    linked: dict[str, str] | None = None  # made in that round-trip from a snapshot (checkout.link_tree): its errors
    snapshot_ok: bool | None = None  # the snapshot it links from is there and is the tree asked for (None: not asked)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RemoteTree":
        files = {rel: (int(v[0]), str(v[1])) for rel, v in (data.get("files") or {}).items()}
        record = data.get("placed")
        placed = {str(rel): (int(v[0]), str(v[1])) for rel, v in (record.get("files") or {}).items()} if isinstance(record, dict) else None
        return cls(str(data.get("root")), str(data.get("home")), bool(data.get("exists")), data.get("digest"), files,
                   dict(data.get("errors") or {}), data.get("refused") or None, data.get("rsync", ""), Sighting.from_json(data),
                   placed, tuple(str(s[0]) for s in data.get("siblings") or ()), dict(data.get("kept") or {}),
                   dict(data["linked"]) if isinstance(data.get("linked"), dict) else None,
                   bool(data["snapshot_ok"]) if "snapshot_ok" in data else None)


@dataclass(frozen=True)
class Sighting:
    """One host's part in finding who shares a directory: why its mark could not be left (None: it was), and
    whose marks it saw after leaving its own (its own included)."""

    why: str | None
    seen: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Sighting | None":
        if "seen" not in data:
            return None  # not asked to look (or refused before marking)
        return cls(str(data["marked"]) if data.get("marked") else None, tuple(str(n) for n in data.get("seen") or ()))


@dataclass(frozen=True)
class Difference:
    send: tuple[str, ...]  # missing on the host or different content
    delete: tuple[str, ...]  # on the host only

    @property
    def empty(self) -> bool:
        return not self.send and not self.delete

    def describe(self, limit: int = SHOWN_DIFFERENCES) -> list[str]:
        lines = [f"differs: {p}" for p in self.send] + [f"extra: {p}" for p in self.delete]
        return lines[:limit] + ([f"… {len(lines) - limit} more"] if len(lines) > limit else [])


@dataclass(frozen=True)
class Placement:
    """What a sync may do in a directory that holds files of others beside mnft's (placement)."""

    conflicts: tuple[str, ...] = ()  # host files in the way of a source file that mnft did not place (or that changed since)
    remove: tuple[tuple[str, int, str], ...] = ()  # mnft's files the source no longer has, as mnft left them: (path, size, sha256)
    kept: tuple[str, ...] = ()  # mnft's files the source no longer has, changed on the host since: kept


@dataclass(frozen=True)
class HostPlan:
    host: str
    action: str  # "none" | "rsync" | "record" (only the record and removals) | "verify" | "refuse" | "conflict" | "fail" (cannot sync: no rsync) | "skip" (unreachable)
    target: str
    argv: tuple[str, ...] = ()
    difference: Difference | None = None
    bytes_to_send: int = 0
    reason: str = ""
    placement: Placement = Placement()


@dataclass
class HostSync:
    host: str
    status: str
    target: str
    bytes_sent: int = 0
    files_changed: int = 0
    files_deleted: int = 0
    remote_hash: str | None = None
    differing: list[str] = field(default_factory=list)
    would_send: list[str] = field(default_factory=list)
    would_delete: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # host files in the way that mnft did not place: never overwritten
    kept: list[str] = field(default_factory=list)  # mnft's files the source dropped, changed on the host: kept
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in (SyncStatus.OK, SyncStatus.CHANGED, SyncStatus.WOULD_CHANGE)


@dataclass
class SyncReport:
    kind: str  # "code" | "data"
    src: Path
    local_hash: str
    local_files: int
    local_bytes: int
    hosts: dict[str, HostSync]
    dry_run: bool = False
    ignore_source: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts.values())

    def exit_code(self) -> ExitCode:
        statuses = {h.status for h in self.hosts.values()}
        if statuses & {SyncStatus.UNREACHABLE, SyncStatus.HOST_KEY_REJECTED}:
            return ExitCode.UNREACHABLE
        if SyncStatus.REFUSED in statuses:  # a bad target is bad input, wherever it was found
            return ExitCode.BAD_INPUT
        if statuses & {SyncStatus.FAILED, SyncStatus.CONFLICT}:
            return ExitCode.FAILED
        return ExitCode.OK

    def summary(self) -> str:
        bad = [h for h in self.hosts.values() if not h.ok]
        if not bad:
            return f"{len(self.hosts)} hosts hold {self.local_hash[:12]}"
        return "; ".join(f"{h.host}: {h.status}: {h.error or ', '.join(h.differing[:3])}" for h in bad)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "src": str(self.src),
            "local_hash": self.local_hash,
            "local_files": self.local_files,
            "local_bytes": self.local_bytes,
            "dry_run": self.dry_run,
            "ignore_source": self.ignore_source,
            "seconds": self.seconds,
            "exit_code": int(self.exit_code()),
            "hosts": {name: {**asdict(h), "hash_match": h.remote_hash == self.local_hash if h.remote_hash else None} for name, h in self.hosts.items()},
        }


# ------------------------------------------------------------------------------------------------ read: remote


def hash_args(host: Host, target: str, *, if_exists: bool = False, other: str | None = None, expect: str | None = None,
              mark: str | None = None, names: Sequence[str] = (), placed: bool = False, siblings: bool = False,
              prune: int | None = None, also: Sequence[str] = ()) -> list[str]:
    """The tree hash script's arguments for target; other is the host's other mnft directory, which must not
    overlap; expect the local digest (a host whose copy differs also reports its rsync version); mark: leave this
    operation's mark (nonce.host) beside the target and, with names, then look for theirs (sharing_of)."""
    return [normalize_target(target)] + (["--other", normalize_target(other)] if other else []) + (["--expect", expect] if expect else []) \
        + (["--mark", f"{mark}.{host.name}"] if mark else []) + (["--names", ",".join(names)] if mark and names else []) \
        + (["--if-exists"] if if_exists else []) + (["--placed"] if placed else []) + (["--siblings"] if siblings else []) \
        + (["--prune", str(prune)] if prune is not None else []) + (["--also", json.dumps(list(also))] if also else [])


def hash_command(host: Host, target: str, **options: Any) -> Command:
    """The host's tree hash probe (hash_args) as a command of its own."""
    return pyrun.command(host, *hash_args(host, target, **options), site=False)


def rules_line(rules: Sequence[str], placed: Mapping[str, Any] | None = None) -> str:
    """The tree hash's stdin after its source: the rules, and with placed (--placed) what to hash, remove and record."""
    return json.dumps(list(rules)) + "\n" + (json.dumps(dict(placed)) + "\n" if placed is not None else "")


def hash_stdin(rules: Sequence[str], placed: Mapping[str, Any] | None = None) -> bytes:
    return pyrun.payload("treehash") + rules_line(rules, placed).encode()


def parse_hash(result: HostResult) -> RemoteTree | None:
    if not result.ok:
        return None
    try:
        data = pyrun.last_json(result.stdout)
        return RemoteTree.from_json(data)
    except (ValueError, IndexError, TypeError, KeyError, AttributeError):
        result.status = Status.FAILED
        result.error = "the tree hash printed no JSON: " + (result.tail(1) or "no output")
        return None


def other_dir(host: Host, target: str) -> str:
    """The host's other mnft directory: the data_dir for its workdir (and whatever lies below it), the workdir for
    its data_dir."""
    return host.workdir if target == host.data_dir else host.data_dir


def read_remote(fleet: Fleet, hosts: Sequence[Host], targets: Mapping[str, str], rules: Sequence[str], *, if_exists: bool = False,
                timeout: float = HASH_TIMEOUT, expect: str | None = None, mark: str | None = None,
                placed: Mapping[str, Mapping[str, Any]] | None = None, siblings: bool = False,
                prune: int | None = None, also: Mapping[str, Sequence[str]] | None = None) -> dict[str, tuple[HostResult, RemoteTree | None]]:
    """Each host's copy of its target, hashed; with mark, each host also leaves its mark and looks for the
    others' (RemoteTree.mark): who shares the target is known from this one round-trip (sharing_of). placed: host ->
    what to hash, remove and record there (treehash.report's `placed`); siblings: the snapshots beside the target;
    also: host -> directories whose hash caches the host may trust for hard links of their files (treehash.tree_hash)."""
    names = [h.name for h in hosts] if mark and len(hosts) > 1 else ()

    def one(host: Host) -> HostResult:
        target = targets[host.name]
        mine = (placed or {}).get(host.name)
        args = hash_args(host, target, if_exists=if_exists, other=other_dir(host, target), expect=expect, mark=mark, names=names,
                         placed=mine is not None, siblings=siblings, prune=prune, also=tuple((also or {}).get(host.name) or ()))
        # a host this controller holds the lease of hashes in its lease holder's process (no new session)
        held = leases.run_held(host, "treehash", args, rules_line(rules, mine), timeout)
        return held if held is not None else fleet.run_one(host, pyrun.command(host, *args, site=False), stdin=hash_stdin(rules, mine), timeout=timeout)

    results = fleet.map(one, hosts)
    return {r.host: (r, parse_hash(r)) for r in results}


def look(fleet: Fleet, hosts: Sequence[Host], targets: Mapping[str, str], nonce: str, names: Sequence[str]) -> dict[str, set[str]]:
    """A round-trip of its own: whose marks of nonce (among names) each host sees for its target."""
    results = fleet.run(lambda h: pyrun.command(h, normalize_target(targets[h.name]), "--seen", nonce, "--names", ",".join(names), site=False),
                        stdin=pyrun.payload("treehash"), hosts=list(hosts), timeout=HASH_TIMEOUT)
    sees = {}
    for result in results:
        try:
            sees[result.host] = set(pyrun.last_json(result.stdout)["seen"]) if result.ok else set()
        except (ValueError, IndexError, KeyError, TypeError):
            sees[result.host] = set()
    return sees


def sharing_of(fleet: Fleet, hosts: Sequence[Host], targets: Mapping[str, str], nonce: str,
               sightings: Mapping[str, Sighting]) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """Which hosts see the same target directory, from one round-trip in which each host left its mark and then
    looked for everyone's (sightings: host -> its Sighting; a host without one is left out). A mark appears whole
    (renamed into place), so of two hosts that share, the later to mark sees the earlier's mark: seeing taken both
    ways (groups_of) finds every group. A host whose mark could not be left is seen by nobody and shares only by
    the marks it sees: it looks again, after every mark is in (one more round-trip, for those hosts only).
    Returns the groups and the hosts whose mark could not be left, with why."""
    unmarked = {name: s.why for name, s in sightings.items() if s.why}
    sees = {name: set(s.seen) for name, s in sightings.items()}
    again = [h for h in hosts if h.name in unmarked]
    if again:
        sees.update(look(fleet, again, targets, nonce, [h.name for h in hosts if h.name in sightings]))
    return groups_of([h.name for h in hosts if h.name in sightings], sees), unmarked


def detect_shared(fleet: Fleet, hosts: Sequence[Host], targets: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Which hosts see the same directory (provision: each host's environment directory): detect_sharing's groups."""
    return detect_sharing(fleet, hosts, targets)[0]


def detect_sharing(fleet: Fleet, hosts: Sequence[Host], targets: Mapping[str, str]) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """Which hosts see the same directory (check without the code hash: each host's workdir; a resume: each
    checkpoints directory): one round-trip, a mark each and a look for everyone's (sharing_of); and the hosts
    whose mark could not be left, with why (a host that did not answer among them)."""
    nonce = secrets.token_hex(8)
    names = [h.name for h in hosts]
    results = fleet.run(lambda h: pyrun.command(h, *mark_request(h, targets[h.name], nonce, names)[1], site=False),
                        stdin=pyrun.payload("treehash"), hosts=list(hosts), timeout=HASH_TIMEOUT)
    sightings = {r.host: sighting_of(r) for r in results}
    groups, _ = sharing_of(fleet, hosts, targets, nonce, {name: s for name, s in sightings.items() if s is not None})
    return groups, {r.host: why for r in results if (why := mark_refused(r))}


def mark_refused(result: HostResult) -> str | None:
    """Why a host left no mark (the mark probe answers {"marked": null} or {"marked": "why not"}), or None."""
    if not result.ok:
        return f"{result.status.value}: {result.error or result.tail(1) or 'no answer'}"
    try:
        why = pyrun.last_json(result.stdout)["marked"]
    except (ValueError, IndexError, KeyError, TypeError):
        return "the mark probe printed no answer"
    return str(why) if why else None


def groups_of(order: Sequence[str], sees: Mapping[str, set[str]]) -> dict[str, tuple[str, ...]]:
    """Pure: who sees whose mark -> the groups sharing a directory (seeing is taken both ways: a group is a
    connected set), each in `order`; a host that shares with nobody is not in the result."""
    group = {name: {name} for name in order}
    for name in order:
        for other in sees.get(name, ()):
            if other in group and group[other] is not group[name]:
                merged = group[name] | group[other]
                for member in merged:
                    group[member] = merged
    return {name: tuple(n for n in order if n in members) for name, members in group.items() if len(members) > 1}


# ------------------------------------------------------------------------------------------------ plan (pure)


def declared_group(order: Sequence[str], groups: Mapping[str, tuple[str, ...]], declared: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The groups found, with the hosts declared shared_fs and every host found sharing with one of them joined
    into one group (in `order`): what the inventory asserts is held to one copy, and verified."""
    if len(declared) < 2:
        return dict(groups)
    members = set(declared).union(*(groups.get(name, ()) for name in declared))
    joined = tuple(name for name in order if name in members)
    return {**groups, **{name: joined for name in joined}}


def difference(local: Mapping[str, tuple[int, str]], remote: Mapping[str, tuple[int, str]]) -> Difference:
    send = tuple(sorted(p for p, v in local.items() if tuple(remote.get(p) or ()) != tuple(v)))
    delete = tuple(sorted(p for p in remote if p not in local))
    return Difference(send, delete)


def placement(local: Mapping[str, tuple[int, str]], remote: Mapping[str, tuple[int, str]],
              placed: Mapping[str, tuple[int, str]] | None) -> Placement:
    """Pure: what a sync may do in a directory where others write too. local: the source's files; remote: the
    host's (those of the source's paths and of the record's); placed: the record of what mnft placed there (None:
    none, so nothing there is mnft's). A host file that differs from the source file of its path is mnft's to replace
    only when the record names it as it is now; otherwise it is a conflict (a run's output, a person's file, or
    mnft's file changed since). A recorded file the source no longer has is removed when unchanged, else kept."""
    placed = placed or {}
    conflicts = tuple(sorted(p for p, v in local.items() if p in remote and tuple(remote[p]) != tuple(v)
                             and tuple(placed.get(p) or ()) != tuple(remote[p])))
    gone = sorted(p for p in placed if p not in local and p in remote)
    remove = tuple((p, int(placed[p][0]), str(placed[p][1])) for p in gone if tuple(remote[p]) == tuple(placed[p]))
    kept = tuple(p for p in gone if tuple(remote[p]) != tuple(placed[p]))
    return Placement(conflicts, remove, kept)


def conflict_line(host: str, target: str, conflicts: Sequence[str], fix: str) -> str:
    shown = ", ".join(conflicts[:5]) + (f" (and {len(conflicts) - 5} more)" if len(conflicts) > 5 else "")
    return (f"{host}: {len(conflicts)} file(s) in {target} that mnft did not place are in the way of the source's: {shown}; "
            f"nothing was written there ({fix})")


CONFLICT_FIX = "move them away, or pass --force to replace them"


def plan(
    inventory: Inventory,
    local: LocalTree,
    remote: Mapping[str, tuple[HostResult, RemoteTree | None]],
    *,
    kind: str,
    rules_file: str,
    ssh: SshSettings,
    delete: bool = True,
    shared: Mapping[str, tuple[str, ...]] | None = None,
    targets: Mapping[str, str] | None = None,
    force: bool = False,
    link_dest: Mapping[str, Sequence[str]] | None = None,
    conflict_fix: str = CONFLICT_FIX,
) -> list[HostPlan]:
    """Per host, what to do. Pure: the local tree, the hosts' trees (or why they could not be read) and which hosts
    see the same directory (sharing_of) in; actions out.

    kind: "code" (the workdir), "data" (the data_dir), "job" (a job's working directory) keep a record of what mnft
    placed (placement: nothing of others is removed or replaced; `delete` False: not even mnft's own files the source
    dropped; `force`: conflicts are replaced); "snapshot" (a code snapshot: mnft's alone) is mirrored exactly and
    read-only. targets: host -> its directory (default: the workdir or data_dir by kind). link_dest: host -> directories
    on the host whose identical files rsync hard-links instead of copying.

    Hosts that see one directory get one copy: a host of the group that already holds it, else the first readable
    one with rsync writes it; the others only verify they see it. For data, the hosts the inventory declares
    shared_fs (an assertion that their data_dir is one directory) are one group with the hosts found sharing
    theirs: a declared host whose mount is missing fails its verification instead of getting a private copy.
    """
    plans = []
    writers: dict[str, str | None] = {}
    groups = dict(shared or {})
    placing = kind != "snapshot"
    if kind == "data":
        groups = declared_group([h.name for h in inventory.hosts], groups, [h.name for h in inventory.hosts if h.shared_fs])
    for members in set(groups.values()):
        trees = [(name, remote.get(name, (None, None))[1]) for name in members]
        readable = [(name, tree) for name, tree in trees if tree is not None and not remote_refusal(tree.root, tree.home, tree.refused)]
        holder = next((name for name, t in readable if t.exists and t.digest == local.digest and not t.errors), None)
        writer = holder or next((name for name, t in readable if t.rsync is not None), None)
        writers.update({name: writer for name in members})
    for host in inventory.hosts:
        target = (targets or {}).get(host.name) or (host.data_dir if kind == "data" else host.workdir)
        result, tree = remote.get(host.name, (None, None))
        if tree is None:
            plans.append(HostPlan(host.name, "skip", target, reason=(result.error if result is not None else "not read")))
            continue
        refusal = remote_refusal(tree.root, tree.home, tree.refused)
        if refusal:
            plans.append(HostPlan(host.name, "refuse", target, reason=f"refused on {host.name}: {refusal}"))
            continue
        missing_rsync = f"rsync is not installed on {host.name} (install it, e.g. `apt-get install rsync`)" if tree.rsync is None else ""
        there = tree.files if tree.exists else {}
        where = placement(local.files, there, tree.placed) if placing and tree.exists else Placement()
        if placing and not delete:
            where = replace(where, remove=())
        recorded = not placing or (tree.placed is not None and dict(tree.placed) == dict(local.files)) or not tree.exists
        if tree.exists and tree.digest == local.digest and not tree.errors and not where.remove and recorded:
            plans.append(HostPlan(host.name, "none", target, difference=Difference((), ()), reason="identical", placement=where))
            continue
        diff = difference(local.files, there)
        if placing:  # files only on the host are never deleted: only the record's, when unchanged
            diff = Difference(diff.send, tuple(p for p, _, _ in where.remove))
        sending = sum(local.files[p][0] for p in diff.send)
        if writers.get(host.name) not in (None, host.name):
            plans.append(HostPlan(host.name, "verify", target, difference=diff, bytes_to_send=0,
                                  reason=f"shared filesystem: the copy of {writers[host.name]}", placement=where))
            continue
        if where.conflicts and not force:
            plans.append(HostPlan(host.name, "conflict", target, difference=diff, reason=conflict_line(host.name, target, where.conflicts, conflict_fix),
                                  placement=where))
            continue
        if not diff.send and placing:  # every source file is there as it is: only the record (and removals) to write
            plans.append(HostPlan(host.name, "record", target, difference=diff, placement=where))
            continue
        # rsync skips a file whose size and mtime match ("quick check"). When the hash found a file that differs
        # with the same size, a touched-back mtime could fool that check: compare contents instead.
        same_size = any(p in there and there[p][0] == local.files[p][0] for p in diff.send)
        if missing_rsync:
            plans.append(HostPlan(host.name, "fail", target, difference=diff, bytes_to_send=sending, reason=missing_rsync, placement=where))
            continue
        argv = rsync_argv(host, local.root, target, rules_file, ssh, delete=not placing, checksum=same_size, mkpath=supports_mkpath(tree.rsync),
                          link_dest=tuple((link_dest or {}).get(host.name) or ()), read_only=kind == "snapshot")
        plans.append(HostPlan(host.name, "rsync", target, argv, diff, sending, placement=where))
    return plans


# ------------------------------------------------------------------------------------------------ apply


class _Progress:
    """Per-host progress (files and bytes), on stderr (or the rich Console given as `enabled`), or nothing."""

    def __init__(self, enabled: Any, plans: Sequence[HostPlan]) -> None:
        self.enabled = bool(enabled) and any(p.action == "rsync" for p in plans)
        self.tasks: dict[str, Any] = {}
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[files]}"), TimeElapsedColumn(),
            console=enabled if isinstance(enabled, Console) else Console(stderr=True), transient=False,
        )
        width = max(len(p.host) for p in plans)
        for p in plans:
            if p.action == "rsync":
                total_files = len(p.difference.send) if p.difference else 0
                total = max(p.bytes_to_send, 1)
                self.tasks[p.host] = [self.progress.add_task(p.host.ljust(width), total=total, files=f"0/{total_files} files"), 0, total_files, total]

    def __enter__(self) -> "_Progress":
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self.progress.stop()

    def item(self, host: str) -> Callable[[int, bool], None] | None:
        if not self.enabled:
            return None
        lock = threading.Lock()

        def on_item(size: int, deleted: bool) -> None:
            with lock:
                entry = self.tasks[host]
                if not deleted:
                    entry[1] += 1
                self.progress.update(entry[0], advance=size, files=f"{entry[1]}/{entry[2]} files")

        return on_item

    def done(self, host: str, ok: bool) -> None:
        if self.enabled and ok:  # rsync sends deltas: a finished host shows its bar full
            entry = self.tasks[host]
            self.progress.update(entry[0], completed=entry[3])


def apply(plans: Sequence[HostPlan], rules: Sequence[str], rules_file: str, *, progress: bool = True, workers: int = 16,
          timeout: float = 3600.0) -> dict[str, tuple[RsyncOutcome, float]]:
    """Run every planned rsync, at most `workers` at once; one outcome per host."""
    todo = [p for p in plans if p.action == "rsync"]
    if not todo:
        return {}
    Path(rules_file).write_bytes(rules_file_bytes(rules))
    outcomes: dict[str, tuple[RsyncOutcome, float]] = {}
    with _Progress(progress, plans) as bar, ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo))), thread_name_prefix="mnft-rsync") as pool:
        def one(p: HostPlan) -> None:
            started = time.monotonic()
            outcome = run_rsync(p.argv, bar.item(p.host), timeout)
            outcomes[p.host] = (outcome, round(time.monotonic() - started, 3))
            bar.done(p.host, outcome.exit_code == 0)

        for future in [pool.submit(one, p) for p in todo]:
            future.result()
    return outcomes


# ------------------------------------------------------------------------------------------------ the whole sync


def placed_request(local: LocalTree, plan_: HostPlan | None = None) -> dict[str, Any]:
    """What the tree hash is asked in a directory with a record (treehash.report's `placed`): before the sync, only
    the source's paths (and the record's, which the host adds); after it, also the removals and the new record,
    written when the source's paths hash as the source does."""
    request: dict[str, Any] = {"paths": sorted(local.files)}
    if plan_ is not None and plan_.action in ("rsync", "record"):
        request.update(remove=[list(r) for r in plan_.placement.remove],
                       write={"digest": local.digest, "files": {p: list(v) for p, v in local.files.items()}}, when=local.digest)
    return request


def sync_tree(
    inventory: Inventory,
    src: Path | None,
    *,
    kind: str = "code",
    fleet: Fleet | None = None,
    progress: bool = True,
    delete: bool = True,
    dry_run: bool = False,
    extra_excludes: Iterable[str] = (),
    workers: int = 16,
    timeout: float = 3600.0,
    config: Mapping[str, Any] | None = None,
    force: bool = False,
    local: LocalTree | None = None,
    targets: Mapping[str, str] | None = None,
    link_dest: Callable[[Host, RemoteTree], Sequence[str]] | None = None,
    lease: bool = True,
    conflict_fix: str = CONFLICT_FIX,
    also: Mapping[str, Sequence[str]] | None = None,
) -> SyncReport:
    """read -> plan -> apply -> verify for the code (workdir), a data set (data_dir), a code snapshot or a job's
    working directory (place_code).

    src None: the default source (see default_source); the exclude patterns are the configured ones
    (configured_excludes, from `config` or Invoke's files) plus extra_excludes. local: the tree already read (and
    fixed: place_code's local snapshot); targets: host -> its directory; link_dest: host, its tree as read -> the
    directories there to hard-link identical files from; lease: take the directory's lease (a train holds its own).
    """
    started = time.monotonic()
    if kind == "data" and src is None and local is None:
        raise InputError("sync --data needs the data directory")
    if local is None:
        source = code_source(src, extra_excludes, config=config)
        src = source.root
        preflight(inventory, src, "data" if kind == "data" else "code")
        local = read_local(src, source.excludes, kind=kind)
    own_fleet = fleet is None
    fleet = fleet or Fleet(inventory, Timeouts(connect=SSH_CONNECT_TIMEOUT, command=HASH_TIMEOUT))
    targets = dict(targets) if targets else {h.name: (h.data_dir if kind == "data" else h.workdir) for h in inventory.hosts}
    placing = kind != "snapshot"
    try:
        # the directory's lease on each host first (dry run: none): one sync or run per directory; a busy one refuses,
        # nothing touched; another user's run on the same hosts does not
        with leases.hold(fleet, inventory.hosts, "sync", skip=dry_run or not lease, scope=leases.sync_scope(kind)), \
                tempfile.TemporaryDirectory(prefix="mnft-sync-") as tmp:
            rules_file = str(Path(tmp) / "excludes")
            nonce = None if dry_run else secrets.token_hex(8)  # a dry run leaves no mark: it changes nothing
            asked = {h.name: placed_request(local) for h in inventory.hosts} if placing else None
            before = read_remote(fleet, inventory.hosts, targets, local.rules, expect=local.digest, mark=nonce, placed=asked,
                                 siblings=kind == "snapshot", prune=KEEP_SNAPSHOTS if kind == "snapshot" and not dry_run else None, also=also)
            # who shares with whom (each host marked and looked in that round-trip) decides who writes and who
            # verifies; not needed when every host already holds the tree
            sightings = {name: tree.mark for name, (_, tree) in before.items() if tree is not None and tree.mark is not None}
            shared = sharing_of(fleet, inventory.hosts, targets, nonce, sightings)[0] if nonce and not all_current(before, local.digest) else {}
            links = {h.name: tuple(link_dest(h, before[h.name][1])) for h in inventory.hosts
                     if link_dest is not None and before.get(h.name, (None, None))[1] is not None}
            plans = plan(inventory, local, before, kind=kind, rules_file=rules_file, ssh=SshSettings.for_inventory(inventory), delete=delete,
                         shared=shared, targets=targets, force=force, link_dest=links, conflict_fix=conflict_fix)
            if dry_run:
                hosts = {p.host: _dry_result(p, before, local, delete) for p in plans}
            else:
                outcomes = apply(plans, local.rules, rules_file, progress=progress, workers=workers, timeout=timeout)
                again = [h for h in inventory.hosts if any(p.host == h.name and p.action in ("rsync", "verify", "record") for p in plans)]
                # a host whose rsync failed is read for the source's paths only: nothing removed, no record written
                finish = {p.host: placed_request(local, p if p.action != "rsync" or outcomes.get(p.host, (None,))[0] is None
                                                 or outcomes[p.host][0].exit_code == 0 else None)
                          for p in plans if p.action in ("rsync", "verify", "record")} if placing else None
                # what rsync hard-linked from the link-dest directories is known by their caches: only new files are read
                trusted = {name: tuple((also or {}).get(name) or ()) + tuple(links.get(name) or ()) for name in targets}
                after = read_remote(fleet, again, targets, local.rules, placed=finish, also=trusted) if again else {}
                hosts = {p.host: _result(p, before, outcomes.get(p.host), after.get(p.host), local, not placing) for p in plans}
    finally:
        if own_fleet:
            fleet.close()
    return SyncReport(kind, local.root, local.digest, len(local.files), local.total_bytes, hosts, dry_run, local.ignore_source,
                      round(time.monotonic() - started, 3))


def all_current(before: Mapping[str, tuple[HostResult, RemoteTree | None]], digest: str) -> bool:
    """Whether every host's copy was read and equals the local tree (nor refused, nor with an unreadable file)."""
    return all(tree is not None and tree.refused is None and not tree.errors and tree.digest == digest for _, tree in before.values())


def _unread(p: HostPlan, read: tuple[HostResult, RemoteTree | None] | None) -> HostSync:
    result = read[0] if read else None
    status = result.status.value if result is not None else SyncStatus.FAILED
    error = (result.error if result is not None else "") or "cannot read the host's tree"
    if status == Status.OK.value:
        status = SyncStatus.FAILED
    return HostSync(p.host, status, p.target, error=error, seconds=result.seconds if result else 0.0)


def _settled(p: HostPlan, before) -> HostSync | None:
    """The outcome of a host the plan already decided (not read, refused, failed), for a dry run and a real one."""
    if p.action == "skip":
        return _unread(p, before.get(p.host))
    if p.action == "refuse":
        return HostSync(p.host, SyncStatus.REFUSED, p.target, error=p.reason)
    if p.action == "fail":
        return HostSync(p.host, SyncStatus.FAILED, p.target, remote_hash=before[p.host][1].digest, error=p.reason)
    if p.action == "conflict":
        return HostSync(p.host, SyncStatus.CONFLICT, p.target, remote_hash=before[p.host][1].digest, error=p.reason,
                        conflicts=list(p.placement.conflicts), kept=list(p.placement.kept))
    return None


def _dry_result(p: HostPlan, before, local: LocalTree, delete: bool = True) -> HostSync:
    if (settled := _settled(p, before)) is not None:
        return settled
    tree = before[p.host][1]
    diff = p.difference or Difference((), ())
    if not delete:  # --no-delete: files only on the host stay, so they are not listed as deletions
        diff = Difference(diff.send, ())
    if p.action == "verify":  # nothing is ever sent to it: it is checked after the shared copy is written
        status = SyncStatus.OK if diff.empty else SyncStatus.WOULD_CHANGE
        return HostSync(p.host, status, p.target, remote_hash=tree.digest, error="" if diff.empty else p.reason + ": verified after the sync")
    status = SyncStatus.OK if p.action == "none" or (diff.empty and p.action != "record") else SyncStatus.WOULD_CHANGE
    return HostSync(p.host, status, p.target, remote_hash=tree.digest, would_send=list(diff.send), would_delete=list(diff.delete),
                    bytes_sent=p.bytes_to_send, error=p.reason if p.action == "verify" else "", conflicts=list(p.placement.conflicts),
                    kept=list(p.placement.kept))


def _result(p: HostPlan, before, outcome: tuple[RsyncOutcome, float] | None, after, local: LocalTree, delete: bool) -> HostSync:
    if (settled := _settled(p, before)) is not None:
        return settled
    tree = before[p.host][1]
    if p.action == "none":
        return HostSync(p.host, SyncStatus.OK, p.target, remote_hash=tree.digest)
    sync = HostSync(p.host, SyncStatus.CHANGED, p.target)
    if outcome is not None:
        ran, seconds = outcome
        sync.bytes_sent, sync.files_changed, sync.files_deleted, sync.seconds = ran.bytes_sent, ran.files_changed, ran.files_deleted, seconds
        status, error = classify(ran.exit_code, ran.stderr)
        if status is not Status.OK:
            sync.status, sync.error = status.value, error
            return sync
    if after is None or after[1] is None:
        result = after[0] if after else None
        sync.status = result.status.value if result is not None and result.status is not Status.OK else SyncStatus.FAILED
        sync.error = "verification failed: " + ((result.error if result is not None else "") or "cannot read the host's tree")
        return sync
    tree = after[1]
    sync.remote_hash = tree.digest if tree.exists else None
    sync.conflicts = list(p.placement.conflicts)  # (forced: replaced)
    sync.kept = sorted(set(p.placement.kept) | set(tree.kept))
    sync.files_deleted = max(sync.files_deleted, len(p.placement.remove) - len(tree.kept))
    if p.action == "verify":
        sync.status = SyncStatus.OK
    diff = difference(local.files, tree.files if tree.exists else {})
    if not delete:
        diff = Difference(diff.send, ())
    if tree.errors or not diff.empty:
        sync.status = SyncStatus.FAILED
        sync.differing = diff.describe(10**6) + [f"unreadable: {rel}: {e}" for rel, e in sorted(tree.errors.items())]
        what = f"host {p.host} does not see the shared data at {p.target} ({p.reason[len('shared filesystem: '):]}): is the shared filesystem mounted?" \
            if p.action == "verify" else "differs after the sync"
        sync.error = f"{what}: {len(diff.send) + len(diff.delete) + len(tree.errors)} file(s): " + ", ".join(sync.differing[:3])
    return sync


def sync_code(inventory: Inventory, src: Path | None = None, *, fleet: Fleet | None = None, progress: bool = True, delete: bool = True,
              dry_run: bool = False, extra_excludes: Iterable[str] = (), workers: int = 16, config: Mapping[str, Any] | None = None,
              force: bool = False) -> SyncReport:
    """Copy the project tree at src (None: the repository, see default_source) into every host's workdir and
    prove each copy is identical (tree hash). Configured excludes (Invoke's sync.exclude) always apply. Files of
    others in the workdir are never removed or replaced (placement); force: conflicts are replaced; delete False:
    mnft's own files the source dropped stay too. (`train` places a run's code itself: mnft.sync.snapshot.)"""
    return sync_tree(inventory, src, kind="code", fleet=fleet, progress=progress, delete=delete, dry_run=dry_run,
                     extra_excludes=extra_excludes, workers=workers, config=config, force=force)


def sync_data(inventory: Inventory, path: Path, *, fleet: Fleet | None = None, progress: bool = True, delete: bool = True,
              dry_run: bool = False, extra_excludes: Iterable[str] = (), workers: int = 16, timeout: float = 3600.0,
              config: Mapping[str, Any] | None = None, force: bool = False) -> SyncReport:
    """Copy a data directory into every host's data_dir; shared_fs hosts get one copy and verify they see it. As
    for the code, files of others there are never removed or replaced (force: conflicts are).

    timeout: seconds each host's rsync may take in all (a large data set may need more than the default hour).
    """
    return sync_tree(inventory, path, kind="data", fleet=fleet, progress=progress, delete=delete, dry_run=dry_run,
                     extra_excludes=extra_excludes, workers=workers, timeout=timeout, config=config, force=force)


# ------------------------------------------------------------------------------------------------ check


def code_local(src: Path | None = None, *, extra_excludes: Iterable[str] = (), config: Mapping[str, Any] | None = None) -> LocalTree:
    """The tree `invoke sync` would copy (the same source and rules: code_source), read here; MnftError when it
    cannot be (then every host's code is unknown: code_unknown)."""
    source = code_source(src, extra_excludes, config=config)
    why = source_problem(source.root)
    if why:
        raise InputError(why)
    return read_local(source.root, source.excludes)


def code_unknown(error: str) -> dict[str, Any]:
    return {"hash": None, "exists": None, "matches": None, "error": error}


def code_request(host: Host, local: LocalTree, *, mark: str | None = None, names: Sequence[str] = ()) -> tuple[str, list[str], str]:
    """What hashes the host's workdir for code_of (with mark: also marks it and looks for the marks of `names`):
    the tree-hash entry, its arguments and its stdin (the rules), for a host script already running there to run
    (check's probe session, mnft.check.session)."""
    return "treehash", hash_args(host, host.workdir, if_exists=True, other=other_dir(host, host.workdir), mark=mark, names=names), \
        rules_line(local.rules)


def mark_request(host: Host, target: str, nonce: str, names: Sequence[str]) -> tuple[str, list[str], str]:
    """detect_sharing's look for one host as code_request's triple: leave its mark for target, look for those of
    `names`, hash nothing (read its answer with sighting_of)."""
    return "treehash", [normalize_target(target), "--mark", f"{nonce}.{host.name}", "--only", "--names", ",".join(names)], ""


def sighting_of(result: HostResult) -> Sighting | None:
    """What a mark_request's run saw, or None when it gave no answer."""
    try:
        return Sighting.from_json(pyrun.last_json(result.stdout)) if result.ok else None
    except (ValueError, IndexError, TypeError, AttributeError):
        return None


def code_of(local: LocalTree, result: HostResult, tree: RemoteTree | None) -> dict[str, Any]:
    """Pure: a host's code entry for check from its tree hash (parse_hash of its result): its hash, whether its
    workdir exists and matches the local tree, and which files differ; or why it is unknown."""
    if tree is None:
        return code_unknown(result.error or "cannot read the workdir")
    refusal = remote_refusal(tree.root, tree.home, tree.refused)
    if refusal:
        return code_unknown(f"workdir refused: {refusal}")
    diff = difference(local.files, tree.files) if tree.exists else None
    return {
        "hash": tree.digest,
        "exists": tree.exists,
        "matches": (tree.digest == local.digest) if tree.exists else None,
        "local_hash": local.digest,
        "source": str(local.root),
        "differing": diff.describe() if diff and not diff.empty else [],
    }


def code_hashes(fleet: Fleet, hosts: Sequence[Host], src: Path | None = None, *, extra_excludes: Iterable[str] = (),
                config: Mapping[str, Any] | None = None, mark: str | None = None) -> tuple[dict[str, dict[str, Any]], dict[str, Sighting]]:
    """For `invoke check`: each host's code hash when its workdir exists, and whether it matches the tree
    `invoke sync` would copy (code_local, code_of), in a round-trip of its own. With mark, each host also marks its
    workdir and looks for the others' marks in that round-trip: the Sightings, for sharing_of (none when the
    local tree could not be read: no round-trip)."""
    try:
        local = code_local(src, extra_excludes=extra_excludes, config=config)
    except MnftError as exc:
        return {h.name: code_unknown(str(exc)) for h in hosts}, {}
    read = read_remote(fleet, hosts, {h.name: h.workdir for h in hosts}, local.rules, if_exists=True, mark=mark)
    out = {name: code_of(local, result, tree) for name, (result, tree) in read.items()}
    return out, {name: tree.mark for name, (_, tree) in read.items() if tree is not None and tree.mark is not None}
