"""A run's code, fixed when it is started: a snapshot of the tree here, then on every host, then its job's directory.

* here (`fix`): when `train` is invoked, the tree it will run is copied into this machine's snapshot store
  (`$MNFT_HOME/code/<hash>`, read-only, unchanged files hard-linked from the newest snapshot there), verified by its
  tree hash, and held (a shared flock) for as long as the run lives. A run that waits in line for its GPUs runs
  that copy, whatever happens to the repository meanwhile.
* on each host (`place`): the snapshot goes to `<workdir>/.mnft/code/<hash>` (read-only; rsync hard-links every
  unchanged file from the snapshots already there, so a new commit costs the changed files), verified; then into the
  job's working directory `<workdir>/outputs/<job>` as hard links to it, under the rules of a directory others write
  in (mnft.sync.mirror.placement): a file the job wrote is never removed or replaced, a file in the way is a
  conflict, named, and the run is refused. The job directory is the ranks' working directory: what a script writes
  relative to it is found again by a restart and a `--resume`.
* a host's snapshots are only the cache the job directories link from: the newest KEEP stay (or one marked
  `<hash>.keep` beside it); removing one frees nothing a job uses. Here, a snapshot a run holds is never removed.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mnft.core.errors import InputError, MnftError
from mnft.core.output import fmt_size
from mnft.hosts.fleet import Fleet
from mnft.hosts.hostkeys import mnft_home
from mnft.hosts.settings import Host, Inventory
from mnft.onhost import checkout, treehash
from mnft.sync.mirror import KEEP_SNAPSHOTS, HostSync, SyncReport, SyncStatus, placed_request, read_remote, sync_tree
from mnft.sync.source import LocalTree, code_source, read_local
from mnft.sync.targets import source_problem

KEEP = KEEP_SNAPSHOTS  # snapshots this machine's store keeps beyond the ones in use, as each host keeps its own
CUT = 16  # a snapshot's directory name: its tree hash, cut (checkout.SNAPSHOT)
LINK_FROM = 5  # the newest snapshots a new one hard-links unchanged files from
CONFLICT_FIX = "the job wrote them or someone put them there: move them away, or start a new job instead of --resume"


class SnapshotError(MnftError):
    pass


def store() -> Path:
    """This machine's snapshot store."""
    return mnft_home() / "code"


def name_of(digest: str) -> str:
    return digest[:CUT]


def snapshot_dir(host: Host, digest: str) -> str:
    """A code snapshot's directory on a host."""
    return host.workdir.rstrip("/") + "/.mnft/code/" + name_of(digest)


def job_dir(host: Host, job_id: str) -> str:
    """A job's working directory on a host: its code (hard links to its snapshot) and what it writes there; the
    same across its restarts and resumes."""
    return host.workdir.rstrip("/") + "/outputs/" + job_id


# ------------------------------------------------------------------------------------------------ here


@dataclass
class Fixed:
    """A tree fixed in the store: its LocalTree (root: the snapshot) and the lock that keeps it there."""

    tree: LocalTree
    source: Path
    seconds: float
    _lock: Any = None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _hold(directory: Path) -> Any:
    """A shared flock on the snapshot's lock file: while held, prune leaves it."""
    lock = open(str(directory) + ".lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_SH)
    return lock


def fix(src: Path | None, *, config: Any = None, extra_excludes=(), root: Path | None = None) -> Fixed:
    """The tree at src (the same source and rules as sync: code_source) copied into the store and verified, held
    until released. The copy is of the files the hash read; a file changed in between makes the copy's hash differ,
    and the tree is read again (three tries)."""
    started = time.monotonic()
    source = code_source(src, extra_excludes, config=config)
    if why := source_problem(source.root):
        raise InputError(why)
    base = root or store()
    base.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        local = read_local(source.root, source.excludes)
        target = base / name_of(local.digest)
        complete = base / (name_of(local.digest) + ".complete")
        lock = _hold(target)
        if complete.exists() and _digest(target, local) == local.digest:
            os.utime(complete)
            return Fixed(_as_snapshot(target, local), source.root, round(time.monotonic() - started, 3), lock)
        _copy(local, target, base)
        if _digest(target, local) == local.digest:
            complete.touch()
            prune(base)
            return Fixed(_as_snapshot(target, local), source.root, round(time.monotonic() - started, 3), lock)
        lock.close()
    raise SnapshotError(f"{source.root} kept changing while mnft copied it (three tries): start the run once the files are written")


def _digest(target: Path, local: LocalTree) -> str:
    """The snapshot's tree hash, by the source's own rules (cached beside the store; a file hard-linked from an
    earlier snapshot is known by its inode from that one's cache, so a new snapshot reads its new files only)."""
    earlier = [str(p) + ".hashes" for p in _snapshots(target.parent)[:LINK_FROM] if p != target]
    digest, _, errors = treehash.tree_hash(target, local.rules, str(target) + ".hashes", also=earlier)
    return "" if errors else digest


def _as_snapshot(target: Path, local: LocalTree) -> LocalTree:
    return LocalTree(target, local.rules, local.digest, local.files, local.ignore_source)


def _copy(local: LocalTree, target: Path, base: Path) -> None:
    """The tree's files into target, read-only, hard-linked from the newest snapshots where unchanged (rsync)."""
    newest = [p for p in _snapshots(base) if p != target and Path(str(p) + ".complete").exists()]
    listing = b"".join(rel.encode("utf-8", "surrogateescape") + b"\0" for rel in sorted(local.files))
    argv = ["rsync", "-a", "--chmod=Fa-w", "--from0", "--files-from=-", "--delete", *[f"--link-dest={p}" for p in newest[:LINK_FROM]],
            str(local.root) + "/", str(target) + "/"]
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, input=listing, capture_output=True, timeout=3600, check=False)
    if done.returncode not in (0, 24):  # 24: a file vanished while copied (the hash of the copy tells)
        raise SnapshotError(f"copying {local.root} into {target} failed: rsync exit {done.returncode}: "
                            + done.stderr.decode("utf-8", "replace").strip()[-300:])


def prune(base: Path, keep: int = KEEP) -> list[str]:
    """Remove the store's snapshots beyond the newest `keep` that no run holds (a flock taken at once) and that are
    not marked <name>.keep. Returns the names removed."""
    removed = []
    for path in _snapshots(base)[keep:]:
        if Path(str(path) + ".keep").exists():
            continue
        with open(str(path) + ".lock", "a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a run holds it
            for folder, _, _ in os.walk(path):
                os.chmod(folder, 0o700)
            shutil.rmtree(path, ignore_errors=True)
            for leftover in (".complete", ".hashes"):
                Path(str(path) + leftover).unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _snapshots(base: Path) -> list[Path]:
    """The store's snapshots, newest first (by when one was last fixed: its .complete mark's time)."""
    def when(p: Path) -> float:
        mark = Path(str(p) + ".complete")
        return mark.stat().st_mtime if mark.exists() else p.stat().st_mtime
    return sorted((p for p in base.iterdir() if p.is_dir() and checkout.SNAPSHOT.match(p.name)), key=when, reverse=True)


# ------------------------------------------------------------------------------------------------ on the hosts


@dataclass
class Placed:
    """Where a run's code went: every host's snapshot, then every host's job directory."""

    snapshot: SyncReport
    job: SyncReport | None

    @property
    def ok(self) -> bool:
        return self.snapshot.ok and self.job is not None and self.job.ok

    @property
    def reports(self) -> list[SyncReport]:
        return [self.snapshot] + ([self.job] if self.job is not None else [])

    def conflicts(self) -> list[str]:
        """Each host's line naming the files in the way in its job directory (nothing was written there)."""
        return [h.error for r in self.reports for h in r.hosts.values() if h.status == SyncStatus.CONFLICT]

    def failure(self) -> str | None:
        """Why the code is not in place on every host (None: it is)."""
        bad = next((r for r in self.reports if not r.ok), None)
        if bad is None:
            return None if self.job is not None else "the job's directory was not placed"
        return "; ".join(self.conflicts()) or f"sync failed: {bad.summary()}"

    def line(self, fixed: "Fixed", job_dir_shown: str) -> str:
        """What train says: the code's hash and source, where it went and what it cost, the job's directory, and
        what the job changed that the code dropped (kept)."""
        hosts = len(self.snapshot.hosts)
        sent = sum(h.bytes_sent for r in self.reports for h in r.hosts.values())
        new = sum(1 for h in self.snapshot.hosts.values() if h.status == SyncStatus.CHANGED)
        kept = sorted({p for h in (self.job.hosts.values() if self.job else ()) for p in h.kept})
        return (f"code {fixed.tree.digest[:12]} from {fixed.source} ({len(fixed.tree.files)} files): "
                + (f"snapshot sent to {new} of {hosts} hosts ({fmt_size(sent)})" if new else f"already on all {hosts} hosts")
                + f"; job directory {job_dir_shown}"
                + (f"; kept {len(kept)} file(s) the job changed that the code no longer has: {', '.join(kept[:3])}" if kept else ""))


def _snapshot_links(host: Host, tree: Any) -> list[str]:
    parent = os.path.dirname(tree.root)
    return [f"{parent}/{name}" for name in tree.siblings[:LINK_FROM]]


def _job_links(digest: str) -> Callable[[Host, Any], list[str]]:
    def links(host: Host, tree: Any) -> list[str]:
        workdir = os.path.dirname(os.path.dirname(tree.root))  # <workdir>/outputs/<job> -> <workdir>
        return [f"{workdir}/.mnft/code/{name_of(digest)}"]
    return links


def place(inventory: Inventory, fixed: LocalTree, job_id: str, *, fleet: Fleet, progress: Any = False, dry_run: bool = False) -> Placed:
    """The fixed tree onto every host: its snapshot, verified, then the job's working directory (hard links to it).
    A host's refusal or conflict leaves the job directories untouched everywhere (the snapshots are mnft's own).

    The usual start is one round-trip per host: its snapshot is checked there (its hash cached: no file read) and the
    new job's directory made from it in the same breath (checkout.link_tree: linked, hashed, recorded). Only hosts
    whose snapshot is missing or not this tree get it sent (rsync --link-dest to the ones beside it) and are linked
    then; a job's directory that exists already (a resume) is placed by rsync from here under the rules of a
    directory the job writes in (mirror.placement)."""
    targets = {h.name: job_dir(h, job_id) for h in inventory.hosts}
    if dry_run:
        snap = _snapshots_to(inventory, inventory.hosts, fixed, fleet, progress, dry_run=True)
        job = sync_tree(inventory, None, kind="job", fleet=fleet, progress=False, local=fixed, dry_run=True, lease=False, targets=targets,
                        link_dest=_job_links(fixed.digest), conflict_fix=CONFLICT_FIX)
        return Placed(snap, job)
    linked, fine = _link(inventory.hosts, fixed, targets, fleet)
    need = [h for h in inventory.hosts if h.name not in fine]
    snap = _snapshots_to(inventory, need, fixed, fleet, progress)
    if not snap.ok:
        return Placed(snap, None)
    again, _ = _link([h for h in need if h.name not in linked], fixed, targets, fleet)
    linked.update(again)
    rest = [h for h in inventory.hosts if h.name not in linked]
    job = sync_tree(inventory.only([h.name for h in rest]), None, kind="job", fleet=fleet, progress=False, local=fixed, lease=False,
                    targets=targets, link_dest=_job_links(fixed.digest), conflict_fix=CONFLICT_FIX,
                    also={h.name: (snapshot_dir(h, fixed.digest),) for h in rest}) if rest else None
    hosts = {h.name: linked[h.name] if h.name in linked else job.hosts[h.name] for h in inventory.hosts}
    return Placed(snap, SyncReport("job", fixed.root, fixed.digest, len(fixed.files), fixed.total_bytes, hosts, False, fixed.ignore_source,
                                   max([job.seconds if job else 0.0] + [h.seconds for h in linked.values()])))


def _snapshots_to(inventory: Inventory, hosts: list[Host], fixed: LocalTree, fleet: Fleet, progress: Any, dry_run: bool = False) -> SyncReport:
    """The snapshot sent to the hosts that lack it (rsync --link-dest to the ones beside it), verified; every other
    host already holds it (checked in the round-trip that made its job's directory)."""
    sent = sync_tree(inventory.only([h.name for h in hosts]), None, kind="snapshot", fleet=fleet, progress=progress, local=fixed,
                     dry_run=dry_run, lease=False, targets={h.name: snapshot_dir(h, fixed.digest) for h in hosts},
                     link_dest=_snapshot_links) if hosts else None
    there = {h.name: HostSync(h.name, SyncStatus.OK, snapshot_dir(h, fixed.digest), remote_hash=fixed.digest)
             for h in inventory.hosts if sent is None or h.name not in sent.hosts}
    return SyncReport("snapshot", fixed.root, fixed.digest, len(fixed.files), fixed.total_bytes, {**there, **(sent.hosts if sent else {})},
                      dry_run, fixed.ignore_source, sent.seconds if sent else 0.0)


def _link(hosts: list[Host], fixed: LocalTree, targets: dict[str, str], fleet: Fleet) -> tuple[dict[str, HostSync], set[str]]:
    """One round-trip per host: its snapshot checked and, where it is this tree and the job's directory is new, the
    directory made from it. -> (the directories made, the hosts whose snapshot is this tree); a host not read is in
    neither (the snapshot's sync, which it then gets, says why)."""
    if not hosts:
        return {}, set()
    started = time.monotonic()
    request = {h.name: {**placed_request(fixed), "link_from": snapshot_dir(h, fixed.digest), "link_digest": fixed.digest,
                        "write": {"digest": fixed.digest, "files": {p: list(v) for p, v in fixed.files.items()}}, "when": fixed.digest}
               for h in hosts}
    read = read_remote(fleet, hosts, targets, fixed.rules, placed=request)
    linked, fine = {}, set()
    for name, (result, tree) in read.items():
        if tree is None or tree.refused:
            continue
        if tree.snapshot_ok:
            fine.add(name)
        if tree.linked is not None:  # made now: from the snapshot, hashed, recorded
            ok = tree.digest == fixed.digest and not tree.errors and tree.placed is not None
            linked[name] = HostSync(name, SyncStatus.CHANGED if ok else SyncStatus.FAILED, targets[name], remote_hash=tree.digest,
                                    files_changed=len(fixed.files), seconds=round(time.monotonic() - started, 3),
                                    error="" if ok else "the job's directory does not hold its snapshot's files: "
                                    + ", ".join(f"{p}: {e}" for p, e in sorted(tree.errors.items())[:3]))
    return linked, fine

