"""Shared storage: which hosts see the same directory. Each host leaves a mark for its target and looks for the other
hosts' marks of the same sync (mnft.onhost.treehash's --mark, --seen; mnft.sync.mirror.sharing_of reads them).
Python >= 3.8 and the standard library only.
"""

from __future__ import annotations

import errno
import os
import re
import time

from .systemdirs import SYSTEM_TREES

# Shared storage: each host leaves a mark <nonce>.<host> for its target in this directory beside it (in the
# deepest existing directory above it; inside it when the target is a mount point of its own, as a lab's NFS data
# mount is), then, in the same round-trip, looks for every host's mark of that nonce for the same path. A mark
# appears whole (written under another name, then renamed), so of two hosts that share, the later to mark sees
# the earlier's: the sightings taken both ways find every group (mirror.sharing_of).
SHARE_DIR = ".mnft-share"
MARK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\.[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


def _mount_points(mountinfo=None) -> set:
    """The mount points this host's processes see (/proc/self/mountinfo's fifth field, octal escapes undone):
    os.path.ismount misses a bind mount within one filesystem."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                mountinfo = f.read()
        except OSError:
            return set()
    fields = [line.split(" ") for line in mountinfo.splitlines()]
    return {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), x[4]) for x in fields if len(x) > 4}


def _anchor(root: str):
    """Where the marks for root go, and root relative to it: the deepest existing directory above root (root's
    parent when it exists), never / or inside a system tree (/etc, /usr, …); root itself ("." below it) when root is
    a mount point of its own (what hosts share is that mount, not its parent: marks beside it would be private).
    Marks go into root only then (it is the user's tree: `/.mnft-share/` is in sync's fixed excludes) and never
    create a directory (a missing mount must not become a local directory)."""
    real = os.path.realpath(os.path.expanduser(root))
    if real != "/" and os.path.isdir(real) and (os.path.ismount(real) or real in _mount_points()) \
            and not any(real == tree or real.startswith(tree + "/") for tree in SYSTEM_TREES):
        return real, "."
    path = os.path.dirname(real.rstrip("/") or "/")
    while path != "/" and not os.path.isdir(path):
        path = os.path.dirname(path)
    if path == "/" or any(path == tree or path.startswith(tree + "/") for tree in SYSTEM_TREES):
        return None, None
    return path, os.path.relpath(real, path)


MARK_BYTES = 8192  # a mark holds a path below its anchor


def _share_dir(anchor: str, create: bool) -> int:
    """An open descriptor of <anchor>/SHARE_DIR, made 0700 when missing (create). Never through a link, and only a
    directory of this user that nobody else can write into: marks may sit in a shared mount where others write,
    and mnft often runs as root (a planted link must never make it delete or write files elsewhere)."""
    parent = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if create:
            try:
                os.mkdir(SHARE_DIR, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
        fd = os.open(SHARE_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    finally:
        os.close(parent)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise PermissionError(errno.EPERM, "%s is another user's or writable by others: not used (remove it)" % os.path.join(anchor, SHARE_DIR))
    return fd


def _mark(root: str, mark: str):
    """Leave this sync's mark for root (<anchor>/SHARE_DIR/<nonce.host>, holding root's path below the anchor);
    marks older than a day are removed. Returns why not, or None. Every name is taken relative to the directory's
    descriptor, never followed through a link."""
    if not MARK.match(mark):
        return "invalid mark"
    anchor, rest = _anchor(root)
    if anchor is None:
        return "no directory above the target to mark"
    try:
        where = _share_dir(anchor, create=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        now = time.time()
        for entry in os.scandir(where):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > 86400:
                    os.unlink(entry.name, dir_fd=where)  # a link is removed itself, never what it points to
            except OSError:
                pass
        part = "." + mark + ".part"  # written whole under this name, then renamed: a mark is never seen half-written
        try:
            os.unlink(part, dir_fd=where)  # the same nonce and host again (a retry): written anew
        except FileNotFoundError:
            pass
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=where)
        with os.fdopen(fd, "w") as f:
            f.write(rest)
        os.rename(part, mark, src_dir_fd=where, dst_dir_fd=where)  # replaces a link there, never follows it
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(where)
    return None


def seen(root: str, nonce: str, names) -> list:
    """Which hosts' marks of this sync (nonce) this host sees for root, each for the same path: the hosts that
    share root with it. Looked up by name (a fresh name is in no negative lookup cache of a network filesystem)."""
    anchor, rest = _anchor(root)
    if anchor is None:
        return []
    try:
        where = _share_dir(anchor, create=False)
    except OSError:
        return []
    out = []
    try:
        for name in names:
            mark = "%s.%s" % (nonce, name)
            if not MARK.match(mark):
                continue
            try:
                fd = os.open(mark, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=where)
                with os.fdopen(fd, "rb") as f:
                    if f.read(MARK_BYTES).decode("utf-8") == rest:
                        out.append(name)
            except (OSError, UnicodeDecodeError):
                pass
    finally:
        os.close(where)
    return out
