"""What mnft placed in a directory, and the code snapshots beside it: the record (PLACED, `.mnft-checkout.json` at the
tree's top: {"digest", "files": {relpath: [size, sha256]}}) read, written, and the files of it still as mnft left
them removed; a job's directory made from its snapshot by hard links; the snapshots past the newest few pruned.
The tree hash does each of these on a sync's request (mnft.onhost.treehash.report); uninstall reads the record
(mnft.onhost.uninstallhost). Python >= 3.8 and the standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat

from .filehash import sha256_file

PLACED = ".mnft-checkout.json"  # at a tree's top: what mnft placed there (never hashed, never sent)
SNAPSHOT = re.compile(r"^[0-9a-f]{16}$")  # a code snapshot's directory name: its tree hash, cut


def read_placed(root: str):
    """The record of what mnft placed in root ({"digest", "files"}), or None (none, or unreadable: nothing is
    taken as mnft's then, so nothing is removed)."""
    try:
        with open(os.path.join(root, PLACED), encoding="utf-8") as f:
            data = json.loads(f.read(64 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return None
    return {"digest": data.get("digest"), "files": {str(k): [v[0], v[1]] for k, v in data["files"].items()
                                                   if isinstance(v, list) and len(v) == 2}}


def write_placed(root: str, record: dict) -> None:
    """The record of what mnft placed, written whole (another name, then renamed)."""
    path = os.path.join(root, PLACED)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True))
    os.replace(tmp, path)


def remove_placed(root: str, doomed, cache=None) -> dict:
    """Remove each [relpath, size, sha256] that is still exactly that (what mnft placed and the source no longer
    has); a file changed since is kept. Empty directories left behind are removed. -> {relpath: why kept}."""
    kept = {}
    for item in doomed:
        rel, size, sha = str(item[0]), item[1], item[2]
        if rel.startswith("/") or ".." in rel.split("/"):
            kept[rel] = "not a path inside the tree"
            continue
        full = os.path.join(root, rel)
        try:
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode) or st.st_size != size or sha256_file(full) != sha:
                kept[rel] = "changed on the host since mnft placed it"
                continue
            os.unlink(full)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                kept[rel] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)
            continue
        remove_empty_parents(root, rel)
    return kept


def remove_empty_parents(root: str, rel: str) -> None:
    """The directories above a removed file, up to the tree's top, each while it is left empty."""
    folder = os.path.dirname(rel)
    while folder:
        try:
            os.rmdir(os.path.join(root, folder))
        except OSError:
            break
        folder = os.path.dirname(folder)


def link_tree(source: str, root: str) -> dict:
    """root (which does not exist) made as a copy of the tree at source by hard links (no byte copied): a job's
    directory from its code snapshot. Made under another name, then renamed, so root appears whole; another host of
    a shared filesystem that made it first wins, and this one's copy is discarded. -> {relpath: error}."""
    import shutil

    errors = {}
    parent = os.path.dirname(os.path.abspath(root))
    os.makedirs(parent, exist_ok=True)
    tmp = "%s.linking-%d" % (os.path.abspath(root), os.getpid())
    for folder, dirs, names in os.walk(source, onerror=lambda exc: errors.setdefault(".", str(exc))):
        rel = os.path.relpath(folder, source)
        here = tmp if rel == "." else os.path.join(tmp, rel)
        os.makedirs(here, exist_ok=True)
        for name in dirs[:]:
            if os.path.islink(os.path.join(folder, name)):  # a symlink to a directory is linked as the link it is
                dirs.remove(name)
                names.append(name)
        for name in names:
            try:
                os.link(os.path.join(folder, name), os.path.join(here, name), follow_symlinks=False)
            except OSError as exc:
                errors[os.path.normpath(os.path.join(rel, name))] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)
    try:
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # made meanwhile (a host sharing it): that copy stands
    return errors


def siblings(root: str) -> list:
    """The code snapshots beside root (directories named by a tree hash), newest first: [[name, mtime]]."""
    parent = os.path.dirname(os.path.abspath(root))
    found = []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    for name in names:
        if SNAPSHOT.match(name) and name != os.path.basename(os.path.abspath(root)):
            try:
                st = os.stat(os.path.join(parent, name))
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                found.append([name, int(st.st_mtime)])
    found.sort(key=lambda item: -item[1])
    return found


def prune(root: str, keep: int) -> list:
    """Remove the code snapshots beside root past the newest `keep` (root itself and those marked <name>.keep
    beside them stay): they are the cache that job directories hard-link from, so removing one frees only what no
    job links. -> the names removed."""
    import shutil

    parent = os.path.dirname(os.path.abspath(root))
    removed = []
    for name, _ in siblings(root)[keep:]:
        if os.path.exists(os.path.join(parent, name + ".keep")):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed
