"""Where mnft may mirror a tree with --delete, and from where: judged from the text of a target (pure), and on
each host from the real paths its tree-hash probe reported. The home itself, `/`, a directory above the home and
the system directories are refused in any spelling, before anything is touched.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path

from mnft.core.errors import InputError
from mnft.hosts.settings import Inventory

# Targets that --delete must never mirror into. The home itself and `/` are refused in any spelling; these
# system directories too. A remote target that *resolves* to the home or an ancestor of it is refused per host.
SYSTEM_DIRS = frozenset({"/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/mnt", "/media", "/opt", "/proc", "/root",
                         "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/Users", "/usr/local", "/var/tmp", "/var/lib"})
HOME_LIKE = re.compile(r"^/(home|Users)/[^/]+$")


def normalize_target(path: str) -> str:
    """`~/a//b/` -> `~/a/b`, `/x/./y/` -> `/x/y`; the text a target is judged and rendered by."""
    if path == "~" or path.startswith("~/"):
        rest = posixpath.normpath(path[2:]) if path[2:] else "."
        return "~" if rest == "." else "~/" + rest
    return posixpath.normpath(path) if path.startswith("/") else path


def target_problem(path: str, what: str = "workdir") -> str | None:
    """Why mnft refuses to mirror (with --delete) into this target, or None. Pure: judged from the text alone."""
    if not isinstance(path, str) or not path.strip():
        return f"{what} is empty"
    if any(c in path for c in "\n\r\0"):
        return f"{what} {path!r} contains a control character"
    if path.startswith("~") and not (path == "~" or path.startswith("~/")):
        return f"{what} {path!r}: only '~/' (the remote user's home) is supported, not '~user'"
    if not path.startswith(("/", "~")):
        return f"{what} {path!r} is relative: use an absolute path or one starting with '~/'"
    norm = normalize_target(path)
    if norm == "~":
        return f"{what} {path!r} is the home directory itself: use a directory of mnft's own, e.g. ~/mnft"
    if norm.startswith("~/.."):
        return f"{what} {path!r} leaves the home directory"
    if norm.startswith("/"):
        if norm in ("/", "//"):
            return f"{what} {path!r} is the root directory"
        if HOME_LIKE.match(norm) or norm == "/root":
            return f"{what} {path!r} is a home directory: use a directory of mnft's own inside it"
        if norm in SYSTEM_DIRS:
            return f"{what} {path!r} is a system directory: use a directory of mnft's own"
    return None


def _overlap(a: str, b: str) -> bool:
    a, b = normalize_target(a).rstrip("/") + "/", normalize_target(b).rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def source_problem(src: Path) -> str | None:
    """Why src cannot be the tree to copy (not a directory, or one whose walk would read a whole machine), or None."""
    if not src.is_dir():
        return f"source {src} is not a directory"
    real = Path(os.path.realpath(src))
    home = Path(os.path.realpath(os.path.expanduser("~")))
    if str(real) == "/" or real == home or real in home.parents or str(real) in SYSTEM_DIRS:
        return f"source {src} is {'/' if str(real) == '/' else real}: give the project directory with --src"
    return None


def preflight(inventory: Inventory, src: Path, kind: str = "code") -> None:
    """Refuse bad input before any host is touched: InputError (exit 2) listing every problem."""
    problem = source_problem(src)
    problems = [problem] if problem else []
    what = "workdir" if kind == "code" else "data_dir"
    for host in inventory.hosts:
        target = host.workdir if kind == "code" else host.data_dir
        why = target_problem(target, what)
        if why:
            problems.append(f"host {host.name!r}: {why}")
            continue
        if _overlap(host.workdir, host.data_dir):
            problems.append(f"host {host.name!r}: workdir {host.workdir!r} and data_dir {host.data_dir!r} overlap: a sync with --delete of one would delete the other")
            continue
        if host.is_local and src.is_dir():
            local = Path(os.path.expanduser(normalize_target(target))).resolve()
            source = src.resolve()
            if local == source or source in local.parents or local in source.parents:
                problems.append(f"host {host.name!r}: the local {what} {local} and the source {source} overlap")
    if problems:
        raise InputError("sync refused: " + "; ".join(problems))


def remote_refusal(root: str, home: str, refused: str | None = None) -> str | None:
    """The host-side check: the probe's own refusal (real paths, before any walk: see systemdirs.refusal), and
    again here from the real paths it reported: not `/`, the home, or a directory above the home."""
    if refused:
        return refused
    root, home = root.rstrip("/") or "/", home.rstrip("/") or "/"
    if root == "/":
        return "the target resolves to / on this host"
    if root == home:
        return f"the target resolves to the home directory {home} on this host"
    if home.startswith(root + "/"):
        return f"the target {root} contains the home directory {home} on this host"
    return None
