"""mnft uninstall, the host side: what of mnft's is on this host (look), and its removal (remove).

The controller ships this module (its payload: mnft.hosts.payload) to the host's base Python (mnft.hosts.pyrun) and reads one
JSON object from stdout. Standard library only, Python >= 3.8; nothing here imports an installed package.

    look SPEC_JSON      every place mnft writes to on this host (LOCATIONS): what is there, its size, whether it is
                        mnft's (a link, another user's directory, a file changed since mnft placed it are not)
    remove SPEC_JSON    remove the places the controller's plan names (SPEC_JSON's "remove"), each judged again as
                        look judges it, so nothing that changed in between is removed

SPEC_JSON: {"venv": "~/mnft-env" or null, "workdir": "~/mnft", "data_dir": "~/mnft-data", "remove": [KEY, ...]}.

What mnft placed in a synced tree is its record (PLACED, `.mnft-checkout.json`, written by mnft.onhost.checkout):
only the files still exactly as recorded (size and sha256) are mnft's; the others, and any file the record does not
name, stay. A tree is removed without following a link, and never when its real path is /, the home, or a
system directory. An error on one file is recorded for that file; the script never raises on a bad file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import sys

from .checkout import PLACED, read_placed, remove_empty_parents
from .filehash import sha256_file
from .sharemarks import SHARE_DIR, _anchor
from .systemdirs import SYSTEM_TREES

# the same names as mnft.onhost.sharemarks and mnft.onhost.envhost (tests/test_uninstall.py holds them equal)
MARK = re.compile(r"^\.?[A-Za-z0-9][A-Za-z0-9_-]{0,63}\.[A-Za-z0-9][A-Za-z0-9._-]{0,252}(\.part)?$")
ENV_ROOT_NAMES = ("envs", "dist", "cache", "previous", ".lock")  # what provision makes in <venv>.d
SUPERVISOR, SUPERVISED = "~/.mnft/supervisor", "~/.mnft/supervised"  # mnft.onhost.superhost's BUNDLES and RUNS (tests hold them equal)
SYSTEM_DIRS = SYSTEM_TREES + ("/home", "/media", "/mnt", "/opt", "/root", "/run", "/srv", "/tmp", "/var", "/var/lib", "/var/tmp", "/Users")


def _expand(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def cache_dir() -> str:
    """mnft's cache on this host (tree-hash caches, GPU and .sif identities): as mnft.onhost.treehash.default_cache."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mnft")


def anchor(root: str):
    """Where a sync or provision leaves its share marks for root: mnft.onhost.sharemarks._anchor (the same rule)."""
    return _anchor(root)[0]


def unsafe(path: str):
    """Why the real path of path must never be removed as a whole here, or None."""
    real = os.path.realpath(path)
    home = os.path.realpath(os.path.expanduser("~"))
    if real == "/" or real == home or home.startswith(real.rstrip("/") + "/"):
        return "it is (or holds) / or the home directory"
    for folder in SYSTEM_DIRS:
        if real == folder or real == os.path.realpath(folder) or folder.startswith(real.rstrip("/") + "/"):
            return "it is (or holds) the system directory %s" % folder
    for folder in SYSTEM_TREES:
        if real.startswith(folder + "/"):
            return "it lies inside the system directory %s" % folder
    return None


def du(path: str):
    """(bytes, files) below path, links not followed, each inode counted once."""
    total, count, seen = 0, 0, set()
    try:
        st = os.lstat(path)
    except OSError:
        return 0, 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size, 1
    for folder, dirs, names in os.walk(path):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            count += 1
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total, count


def _kind(path: str) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return "link"
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"


def _owner_problem(path: str):
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    if st.st_uid != os.geteuid():
        return "another user's (uid %d)" % st.st_uid
    return None


# ------------------------------------------------------------------------------------------------ the places


def look_tree(path: str, need=None) -> dict:
    """A directory mnft made as a whole (its snapshots, the environments, its cache): all of it is mnft's."""
    out = {"path": path, "kind": _kind(path), "bytes": 0, "files": 0, "ours": False, "why": None}
    if out["kind"] == "missing":
        return out
    if out["kind"] != "dir":
        out["why"] = "a %s, not the directory mnft makes: not followed" % out["kind"]
        return out
    out["why"] = unsafe(path) or _owner_problem(path)
    if out["why"] is None and need:
        try:
            names = os.listdir(path)
        except OSError as exc:
            names, out["why"] = [], exc.strerror or str(exc)
        if out["why"] is None and not any(n in names for n in need):
            out["why"] = "not a directory mnft made (none of %s in it)" % ", ".join(need)
    out["bytes"], out["files"] = du(path)
    out["ours"] = out["why"] is None
    return out


def look_link(path: str, root: str) -> dict:
    """The environment's link: mnft's when it points into the environments provision keeps (<venv>.d/envs)."""
    out = {"path": path, "kind": _kind(path), "bytes": 0, "files": 0, "ours": False, "why": None}
    if out["kind"] == "missing":
        return out
    if out["kind"] != "link":
        out["why"] = "a %s, not the link provision makes: not mnft's (a directory of your own?)" % out["kind"]
        return out
    target = os.path.realpath(path)
    envs = os.path.join(os.path.realpath(root), "envs")
    out["ours"] = target.startswith(envs + "/")
    if not out["ours"]:
        out["why"] = "points to %s, outside %s" % (target, envs)
    out["files"] = 1
    return out


def _inside(root_real: str, full: str) -> bool:
    """full's directory is below root by its real path (no link on the way out of the tree)."""
    parent = os.path.realpath(os.path.dirname(full))
    return parent == root_real or parent.startswith(root_real + "/")


def placed_as_recorded(root: str, files: dict):
    """([relpath, size] still exactly as recorded, [relpath] changed or not a plain file, missing count)."""
    same, changed, missing = [], [], 0
    real = os.path.realpath(root)
    for rel in sorted(files):
        size, sha = files[rel]
        full = os.path.join(root, rel)
        if rel.startswith("/") or ".." in rel.split("/") or not _inside(real, full):
            changed.append(rel)
            continue
        try:
            st = os.lstat(full)
        except OSError:
            missing += 1
            continue
        try:
            if stat.S_ISREG(st.st_mode) and st.st_size == size and sha256_file(full) == sha:
                same.append([rel, size])
            else:
                changed.append(rel)
        except OSError:
            changed.append(rel)
    return same, changed, missing


def look_placed(root: str) -> dict:
    """The files mnft placed at root (its record), those still as placed: mnft's; the others are kept."""
    out = {"path": root, "kind": _kind(root), "bytes": 0, "files": 0, "ours": False, "why": None, "kept": []}
    if out["kind"] != "dir":
        return out
    record = read_placed(root)
    files = record["files"] if record is not None else None
    if files is None:
        out["why"] = "no record of what mnft placed here (%s)" % PLACED if os.path.lexists(os.path.join(root, PLACED)) else None
        out["kind"] = "missing" if out["why"] is None else out["kind"]
        return out
    same, changed, missing = placed_as_recorded(root, files)
    out.update(bytes=sum(s for _, s in same), files=len(same) + 1, ours=True, kept=changed[:50], kept_count=len(changed), gone=missing)
    return out


def look_marks(paths) -> dict:
    """The share marks sync and provision leave beside the given directories (<anchor>/.mnft-share)."""
    found, why = [], None
    for path in paths:
        where = anchor(path) if path else None
        share = os.path.join(where, SHARE_DIR) if where else None
        if share and share not in found and os.path.lexists(share):
            found.append(share)
    out = {"path": ", ".join(found) or None, "paths": found, "kind": "dir" if found else "missing", "bytes": 0, "files": 0, "ours": bool(found), "why": None}
    for share in found:
        if _kind(share) != "dir" or _owner_problem(share):
            why = "%s: %s" % (share, _owner_problem(share) or "not a directory")
            continue
        try:
            out["files"] += sum(1 for n in os.listdir(share) if MARK.match(n))
        except OSError as exc:
            why = "%s: %s" % (share, exc.strerror or exc)
    if why:
        out.update(ours=False, why=why)
    return out


def look_empty(path: str) -> dict:
    """A directory mnft made and leaves empty once the rest is gone (the workdir): removed only when empty then."""
    kind = _kind(path)
    return {"path": path, "kind": kind, "bytes": 0, "files": 0, "ours": kind == "dir" and unsafe(path) is None,
            "why": None if kind in ("dir", "missing") else "a %s, not a directory" % kind}


def locations(spec: dict):
    """key -> (how it is looked at, what removes it), in the order removal goes: what is inside first."""
    work, data, venv = _expand(spec["workdir"]), _expand(spec["data_dir"]), spec.get("venv")
    env = _expand(venv) if venv else None
    root = env.rstrip("/") + ".d" if env else None
    out = [
        ("env", (lambda: look_link(env, root)) if env else None, lambda found: _unlink(found["path"])),
        ("env_store", (lambda: look_tree(root, ENV_ROOT_NAMES)) if root else None, lambda found: _rmtree(found["path"])),
        ("snapshots", lambda: look_tree(os.path.join(work, ".mnft", "code")), lambda found: _rmtree(found["path"])),
        ("checkout", lambda: look_placed(work), lambda found: _remove_placed(found["path"])),
        ("data", lambda: look_placed(data), lambda found: _remove_placed(found["path"])),
        ("outputs", lambda: look_tree(os.path.join(work, "outputs")), lambda found: _rmtree(found["path"])),
        ("runs", lambda: look_tree(os.path.join(work, "runs")), lambda found: _rmtree(found["path"])),
        ("supervised", lambda: look_tree(_expand(SUPERVISED)), lambda found: _rmtree(found["path"])),
        ("supervisor", lambda: look_tree(_expand(SUPERVISOR)), lambda found: _rmtree(found["path"])),
        ("cache", lambda: look_tree(cache_dir()), lambda found: _rmtree(found["path"])),
        ("marks", lambda: look_marks([work, data, root]), lambda found: _remove_marks(found["paths"])),
        ("mnft_dir", lambda: look_empty(os.path.join(work, ".mnft")), lambda found: _rmdir(found["path"])),
        ("workdir", lambda: look_empty(work), lambda found: _rmdir(found["path"])),
        ("data_dir", lambda: look_empty(data), lambda found: _rmdir(found["path"])),
    ]
    return [(key, looker, remover) for key, looker, remover in out if looker is not None]


# ------------------------------------------------------------------------------------------------ removal


def _unlink(path: str) -> dict:
    os.unlink(path)
    return {}


def _rmtree(path: str) -> dict:
    errors = {}

    def onerror(func, name, exc_info):
        exc = exc_info[1]
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            return
        try:  # a read-only directory (never a file's mode: unlinking needs only its directory writable)
            parent = os.path.dirname(name)
            os.chmod(parent, os.lstat(parent).st_mode | stat.S_IWUSR | stat.S_IXUSR)
            func(name)
        except OSError as again:
            errors[name] = again.strerror or str(again)

    if sys.version_info >= (3, 12):  # onerror is deprecated there
        shutil.rmtree(path, onexc=lambda func, name, exc: onerror(func, name, (type(exc), exc, None)))
    else:
        shutil.rmtree(path, onerror=onerror)
    return errors


def _remove_placed(root: str) -> dict:
    """Each file of the record still exactly as recorded, then the record; directories left empty go too."""
    files = (read_placed(root) or {}).get("files") or {}
    same, _, _ = placed_as_recorded(root, files)
    errors = {}
    for rel, _ in same:
        try:
            os.unlink(os.path.join(root, rel))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                errors[rel] = exc.strerror or str(exc)
                continue
        remove_empty_parents(root, rel)
    if not errors:
        try:
            os.unlink(os.path.join(root, PLACED))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                errors[PLACED] = exc.strerror or str(exc)
    return errors


def _remove_marks(shares) -> dict:
    """The marks in each share directory (by name, never through a link), then the directory when that emptied it."""
    errors = {}
    for share in shares:
        try:
            fd = os.open(share, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                errors[share] = exc.strerror or str(exc)
            continue
        try:
            for name in os.listdir(fd):
                if MARK.match(name):
                    try:
                        os.unlink(name, dir_fd=fd)
                    except OSError as exc:
                        if exc.errno != errno.ENOENT:
                            errors[os.path.join(share, name)] = exc.strerror or str(exc)
        finally:
            os.close(fd)
        try:
            os.rmdir(share)
        except OSError:
            pass  # something else is in it: it stays
    return errors


def _rmdir(path: str) -> dict:
    try:
        os.rmdir(path)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            return {path: exc.strerror or str(exc)}
    return {}


# ------------------------------------------------------------------------------------------------ main


def look(spec: dict) -> dict:
    found = {}
    for key, looker, _ in locations(spec):
        try:
            found[key] = looker()
        except OSError as exc:
            found[key] = {"path": None, "kind": "error", "bytes": 0, "files": 0, "ours": False, "why": exc.strerror or str(exc)}
    return {"home": os.path.realpath(os.path.expanduser("~")), "found": found}


def remove(spec: dict) -> dict:
    """Remove the keys the plan names, each only when it is still mnft's as look judges it now."""
    wanted = set(spec.get("remove") or ())
    removed, errors, skipped = [], {}, {}
    for key, looker, remover in locations(spec):
        if key not in wanted:
            continue
        try:
            found = looker()
            if found["kind"] == "missing":
                continue
            if not found["ours"]:
                skipped[key] = found["why"] or "not mnft's"
                continue
            failed = remover(found)
            if failed:
                errors[key] = "; ".join("%s: %s" % item for item in sorted(failed.items())[:5])
            elif key in ("mnft_dir", "workdir", "data_dir") and os.path.lexists(found["path"]):
                continue  # not empty: what is left there is not mnft's
            removed.append(key)
        except OSError as exc:
            errors[key] = exc.strerror or str(exc)
    return {"removed": removed, "errors": errors, "skipped": skipped}


def main(argv) -> int:
    if len(argv) != 2 or argv[0] not in ("look", "remove"):
        sys.stderr.write("usage: uninstallhost.py look|remove SPEC_JSON\n")
        return 2
    try:
        spec = json.loads(argv[1])
        spec["workdir"], spec["data_dir"]  # noqa: B018 - both are required
    except (ValueError, KeyError, TypeError):
        sys.stderr.write("uninstallhost.py: SPEC_JSON must be an object with workdir and data_dir\n")
        return 2
    out = look(spec) if argv[0] == "look" else remove(spec)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0
