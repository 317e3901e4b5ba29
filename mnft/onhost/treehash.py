"""mnft tree hash: the identity of a directory tree (paths, sizes, sha256 of contents), here or on a host.

The controller imports this module to hash its own tree and ships this module (its payload: mnft.hosts.payload) to each
host's Python (mnft.hosts.pyrun) to hash the host's copy, so both sides walk and hash with the same code. Its command
line (after the payload's bootstrap) is `ROOT [--cache FILE] [--other DIR] [--expect DIGEST] [--if-exists] [--placed]
[--siblings]`, with the exclude rules as one JSON line on stdin (and, with --placed, a second line: the paths to
hash, the files to remove and the record to write: see `placed`).

It also keeps a directory's record of what mnft placed there (PLACED, `.mnft-checkout.json` at the tree's top:
{"digest", "files": {relpath: [size, sha256]}}): a sync removes only a file of that record that the source no
longer has and that is still as mnft left it, and a file in the way that the record does not name (a run's output,
a person's file) is never replaced (mnft.sync.mirror plans that, from what this script reports).

Exclude rules are a subset of rsync's filter patterns, so the rules given to rsync and the ones the hash applies
are the same strings with the same meaning:
  * `name`          matches the last component of a path anywhere (`__pycache__`, `*.pyc`);
  * `a/b`, `**`     a pattern with a slash (or `**`) matches the end of the path at a component boundary;
  * `/a/b`          a leading slash anchors the pattern at the tree's root;
  * `dir/`          a trailing slash matches directories only; an excluded directory is not descended into;
  * wildcards `*` (not across `/`), `**` (across `/`), `?`, `[...]`; when a pattern has a wildcard, a
    backslash makes the next character literal (rsync's rule), otherwise the pattern is literal text.

  * `+ PATTERN`     an include: rules are tried in order and the first that matches decides (rsync's order).

Before walking anything the probe refuses a target whose real path is /, the home or above it, inside ~/.ssh,
a system directory (or above one, or inside /etc, /usr, ...), or overlapping the host's other mnft directory
(`--other`): `refused` says why, and nothing is read.

Output (one JSON object on stdout): root and home (real paths), whether the root exists, `refused`, the host's
rsync version when the tree differs from `--expect` (`rsync`: null when there is none, so the controller can
say so instead of a broken pipe; "" when not asked), files
{relpath: [size, sha256]}, the digest, and per-path errors.

Hashing is cached per root (size, mtime_ns, ctime_ns, inode -> sha256) in a file outside the tree, so a re-hash
of an unchanged tree reads no file contents. A write through any tool changes ctime, so the cache cannot hide a
modification short of a clock reset.

Constraints, because this runs on hosts mnft does not control: Python >= 3.8 and the standard library only;
never raises on a bad file (the error is recorded for that path); exit status 0, 2 for a bad command line.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys

from .checkout import PLACED, link_tree, prune, read_placed, remove_placed, siblings, write_placed
from .filehash import sha256_file
from .sharemarks import _mark, seen
from .systemdirs import refusal

CACHE_VERSION = 1
CACHE_BYTES = 1 << 30  # the hash cache read at most (~200 bytes a file: millions of files); past it, hashed again
WILDCARDS = "*?["


# ------------------------------------------------------------------------------------------------ rules


def bracket_end(text: str, i: int) -> int | None:
    """The index of the `]` closing the class that opens at text[i] (`[!...]`, `[^...]`, `[]...]` as git and
    rsync read them), or None when it is never closed (then the `[` is a literal)."""
    j, n = i + 1, len(text)
    if j < n and text[j] in "!^":
        j += 1
    if j < n and text[j] == "]":
        j += 1
    while j < n and text[j] != "]":
        j += 1
    return j if j < n else None


def _glob_regex(pattern: str) -> str:
    """rsync wildmatch subset -> regex (`*` stays inside a component, `**` crosses `/`)."""
    if not any(c in pattern for c in WILDCARDS):
        return re.escape(pattern)
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        if c == "*":
            if pattern.startswith("**", i):
                out.append(".*")
                i += 2
            else:
                out.append("[^/]*")
                i += 1
            continue
        if c == "?":
            out.append("[^/]")
            i += 1
            continue
        if c == "[":
            j = bracket_end(pattern, i)
            if j is None:  # no closing bracket: a literal "["
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1 : j]
            negate = body[:1] in ("!", "^")
            if negate:
                body = body[1:]
            body = "".join("\\" + ch if ch in "[\\&~|" else ch for ch in body)  # literal inside the class
            out.append("[" + ("^" if negate else "") + body + "]")
            i = j + 1
            continue
        out.append(re.escape(c))
        i += 1
    return "".join(out)


class Rules:
    """Compiled filter rules; `excluded(relpath, is_dir)` says whether rsync would leave the path out.

    A rule is an exclude pattern, or `+ PATTERN` for an include; the first rule that matches decides (rsync's
    order), and a path no rule matches is included.
    """

    def __init__(self, patterns) -> None:
        self.patterns = list(patterns)
        compiled = []
        for pattern in self.patterns:
            include = pattern.startswith("+ ")
            if include:
                pattern = pattern[2:]
            if not pattern or pattern in ("/", "//"):
                continue
            dir_only = pattern.endswith("/")
            body = pattern.rstrip("/") if dir_only else pattern
            anchored = body.startswith("/")
            if anchored:
                body = body.lstrip("/")
            prefix = "^" if anchored else "(?:^|.*/)"
            compiled.append((prefix + _glob_regex(body) + "$", dir_only, include))
        # consecutive rules of the same kind (include or exclude) are one alternation: their order among
        # themselves cannot change the outcome, and one regex per group keeps a walk fast with many rules
        self._groups = []
        for regex, dir_only, include in compiled:
            if not self._groups or self._groups[-1][0] != include:
                self._groups.append((include, [], []))
            self._groups[-1][2 if dir_only else 1].append(regex)
        self._groups = [
            (include, re.compile("|".join("(?:%s)" % r for r in any_kind), re.DOTALL) if any_kind else None,
             re.compile("|".join("(?:%s)" % r for r in dirs), re.DOTALL) if dirs else None)
            for include, any_kind, dirs in self._groups
        ]

    def excluded(self, relpath: str, is_dir: bool) -> bool:
        for include, any_kind, dirs in self._groups:
            if (any_kind is not None and any_kind.match(relpath)) or (is_dir and dirs is not None and dirs.match(relpath)):
                return not include
        return False


def escape_literal(relpath: str) -> str:
    """An rsync filter pattern that matches exactly this path (anchored at the tree's root)."""
    if any(c in relpath for c in WILDCARDS):
        relpath = re.sub(r"([\\*?\[])", r"\\\1", relpath)
    return "/" + relpath


# ------------------------------------------------------------------------------------------------ hashing


def digest_of(files: dict) -> str:
    """One sha256 over the sorted (path, size, sha256) entries: equal digests mean equal trees."""
    import hashlib

    digest = hashlib.sha256()
    for rel in sorted(files):
        size, sha = files[rel]
        digest.update(rel.encode("utf-8", "surrogateescape") + b"\0" + str(size).encode() + b"\0" + sha.encode() + b"\n")
    return digest.hexdigest()


def _load_cache(path):
    if not path:
        return {}
    try:
        if os.path.getsize(path) > CACHE_BYTES:  # a cache: past its bound, the tree is hashed again
            return {}
        with open(path, encoding="utf-8") as fh:
            data = json.loads(fh.read(CACHE_BYTES + 1))
        if data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict):
            return data["files"]
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return {}


def _save_cache(path, files) -> None:
    if not path:
        return
    import tempfile

    try:
        folder = os.path.dirname(path)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".treehash-")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"version": CACHE_VERSION, "files": files}, fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a cache that cannot be written only costs time


def walk(root: str, rules: Rules):
    """(relpath, absolute path, lstat) of every non-directory entry rsync would transfer, sorted."""
    found = []
    errors = {}

    def onerror(exc):
        rel = os.path.relpath(exc.filename, root) if exc.filename else "."
        errors[rel] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)

    for folder, dirs, names in os.walk(root, onerror=onerror):
        rel_folder = os.path.relpath(folder, root)
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        keep = []
        for name in sorted(dirs):
            rel = rel_folder + name
            full = os.path.join(folder, name)
            try:
                st = os.lstat(full)
            except OSError as exc:
                errors[rel] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)
                continue
            if stat.S_ISLNK(st.st_mode):  # a symlink to a directory: copied as a link, not followed
                if not rules.excluded(rel, False):
                    found.append((rel, full, st))
                continue
            if not rules.excluded(rel, True):
                keep.append(name)
        dirs[:] = keep
        for name in names:
            rel = rel_folder + name
            full = os.path.join(folder, name)
            if rel == PLACED or rules.excluded(rel, False):
                continue
            try:
                st = os.lstat(full)
            except OSError as exc:
                errors[rel] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)
                continue
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                found.append((rel, full, st))
    found.sort(key=lambda item: item[0])
    return found, errors


def tree_hash(root, excludes=(), cache=None, only=None, also=()):
    """(digest, {relpath: (size, sha256)}, {relpath: error}) of the tree at root, with the exclude rules applied;
    only (a collection of relpaths): those alone are hashed (the rest is not read). also: the caches of other trees
    whose files this one may hold as hard links (a job's directory, its snapshot; a snapshot, the one before): a
    read-only file with the same inode, size and mtime as one of theirs is the same file, its hash not read again.

    A symlink counts as its target text (size = its length), never followed. `cache` is a JSON file outside the
    tree that remembers each file's sha256 by (size, mtime_ns, ctime_ns, inode).
    """
    import hashlib

    root = os.fspath(root)
    rules = excludes if isinstance(excludes, Rules) else Rules(excludes)
    entries, errors = walk(root, rules)
    if only is not None:
        wanted = set(only)
        entries = [e for e in entries if e[0] in wanted]
    old = _load_cache(cache)
    # by inode, size and mtime: a hard link made since (a job's directory, the next snapshot) changed the inode's
    # ctime, so ctime cannot be compared; only read-only files are taken (snapshot files: nobody but root writes them)
    linked = {}
    for known in [_load_cache(other) for other in also or ()] + [old]:  # its own too: linking bumped their ctime
        linked.update({(v[0], v[1], v[3]): v[4] for v in known.values() if isinstance(v, list) and len(v) == 5})
    new = {}
    files = {}
    for rel, full, st in entries:
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(full)
            except OSError as exc:
                errors[rel] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)
                continue
            data = os.fsencode(target)
            files[rel] = (len(data), hashlib.sha256(b"symlink\0" + data).hexdigest())
            continue
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        hit = old.get(rel)
        if hit and hit[:4] == key:
            sha = hit[4]
        elif not st.st_mode & 0o222 and (st.st_size, st.st_mtime_ns, st.st_ino) in linked:
            sha = linked[(st.st_size, st.st_mtime_ns, st.st_ino)]
        else:
            try:
                sha = sha256_file(full)
            except OSError as exc:
                errors[rel] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)
                continue
        new[rel] = key + [sha]
        files[rel] = (st.st_size, sha)
    if cache and new != old:
        _save_cache(cache, new)
    return digest_of(files), files, errors


def default_cache(root: str) -> str:
    """Where a host keeps the cache for a root: outside the tree, in the user's cache directory."""
    import hashlib

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha256(os.path.realpath(root).encode("utf-8", "surrogateescape")).hexdigest()[:20]
    return os.path.join(base, "mnft", "treehash-%s.json" % key)


# ------------------------------------------------------------------------------------------------ main


def rsync_version():
    """The version of the rsync a remote shell here would start ("3.2.7"), "unknown", or None when there is none."""
    import shutil
    import subprocess

    path = shutil.which("rsync")
    if not path:
        return None
    try:
        text = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL, capture_output=True, timeout=20).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    match = re.search(r"version\s+v?(\d+(?:\.\d+)+)", text)
    return match.group(1) if match else "unknown"


def report(root: str, patterns, cache=None, if_exists: bool = False, other=None, expect=None, mark=None, placed=None,
           with_siblings: bool = False, keep=None, also=()) -> dict:
    """The probe's answer for root. expect: the digest the controller wants; when the tree differs from it (a
    sync will follow) the host's rsync version is reported too; when it is equal, the file list is left out.
    placed (a dict, --placed): the record of what mnft placed here is read and reported; "paths" (a list) hashes only
    those paths (a job's directory holds its outputs: only the code's paths matter); "remove" ([relpath, size,
    sha256] each) are removed first when still exactly that; "write" (a record) is written when the tree then hashes
    without errors. with_siblings: the code snapshots beside root (siblings)."""
    expanded = os.path.expanduser(root)
    out = {
        "root": os.path.realpath(expanded),
        "home": os.path.realpath(os.path.expanduser("~")),
        "exists": os.path.isdir(expanded),
        "digest": None,
        "files": None,
        "errors": {},
        "refused": None,
        "rsync": "",
    }
    out["refused"] = refusal(out["root"], out["home"], os.path.realpath(os.path.expanduser(other)) if other else None)
    if out["refused"]:
        return out
    if mark:
        out["marked"] = _mark(expanded, mark)
    if keep is not None:
        out["pruned"] = prune(expanded, keep)
    if with_siblings:
        out["siblings"] = siblings(expanded)
    if placed is not None and placed.get("link_from") and placed.get("link_digest"):
        # the snapshot a job's directory links from, checked first (its hash cached: no file read): missing or not the
        # tree the controller fixed, nothing is linked and the controller sends it (mirror.place)
        source_dir = os.path.expanduser(str(placed["link_from"]))
        snap_digest, _, snap_errors = tree_hash(source_dir, patterns, default_cache(source_dir)) if os.path.isdir(source_dir) else (None, {}, {})
        out["snapshot_ok"] = snap_digest == placed["link_digest"] and not snap_errors
    if placed is not None and placed.get("link_from") and out.get("snapshot_ok", True) and not out["exists"] and not os.path.lexists(expanded):
        out["linked"] = link_tree(os.path.expanduser(str(placed["link_from"])), expanded)
        out["exists"] = os.path.isdir(expanded)
    if placed is not None and out["exists"]:
        if placed.get("remove"):
            out["kept"] = remove_placed(expanded, placed["remove"])
        out["placed"] = read_placed(expanded)
    if not out["exists"]:
        if not if_exists and os.path.lexists(expanded):
            out["errors"]["."] = "not a directory"
        if expect:
            out["rsync"] = rsync_version()
        return out
    only = placed.get("paths") if placed is not None else None
    record = out.get("placed") or {}
    trusted = [default_cache(os.path.expanduser(str(placed[key]))) for key in ("link_from", "cache_from") if placed and placed.get(key)] \
        + [default_cache(os.path.expanduser(str(d))) for d in also or ()]
    digest, files, errors = tree_hash(expanded, patterns, cache or default_cache(expanded),
                                      only=None if only is None else set(only) | set(record.get("files") or ()), also=trusted)
    extra = False
    if only is not None:  # the digest is the source's paths' (what the sync placed); the record's others are listed beside
        wanted = set(only)
        extra = any(rel not in wanted for rel in files)
        digest = digest_of({rel: v for rel, v in files.items() if rel in wanted})
    errors.update(out.get("linked") or {})
    out.update(digest=digest, files={rel: list(v) for rel, v in files.items()}, errors=errors)
    if placed is not None and placed.get("write") is not None and not errors and placed.get("when") == digest:
        try:
            write_placed(expanded, placed["write"])
            out["placed"] = placed["write"]
        except OSError as exc:
            errors[PLACED] = "%s: %s" % (exc.__class__.__name__, exc.strerror or exc)
    if expect and digest == expect and not errors and not extra:
        out["files"] = None  # identical to what the controller has: the list would only be read to learn nothing
    elif expect:
        out["rsync"] = rsync_version()
    return out


def main(argv) -> int:
    usage = ("usage: treehash.py ROOT [--cache FILE] [--other DIR] [--expect DIGEST] [--mark NONCE.HOST [--names HOST,HOST...]] [--if-exists]"
             " [--placed] [--siblings] [--prune N] [--also JSON-LIST] < rules.json [placed.json]\n"
             "       treehash.py ROOT --mark NONCE.HOST --only [--names HOST,HOST...]\n"
             "       treehash.py ROOT --seen NONCE --names HOST,HOST...\n"
             "--mark with --names: after marking (and hashing), whose marks of that nonce this host sees\n")
    args = list(argv)
    values = {"--cache": None, "--other": None, "--expect": None, "--mark": None, "--seen": None, "--names": None, "--prune": None,
              "--also": None}
    if_exists = "--if-exists" in args
    if if_exists:
        args.remove("--if-exists")
    flags = {}
    for flag in ("--only", "--placed", "--siblings"):
        flags[flag] = flag in args
        if flags[flag]:
            args.remove(flag)
    for flag in values:
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                sys.stderr.write(usage)
                return 2
            values[flag] = args[i + 1]
            del args[i : i + 2]
    if len(args) != 1:
        sys.stderr.write(usage)
        return 2
    mark, names = values["--mark"], (values["--names"] or "").split(",") if values["--names"] else None
    if mark is not None and "--only" in argv:  # mark (and look), hash nothing
        sys.stdout.write(json.dumps(_looked({"marked": _mark(args[0], mark)}, args[0], mark, names)) + "\n")
        return 0
    if values["--seen"] is not None:
        sys.stdout.write(json.dumps({"seen": seen(args[0], values["--seen"], (values["--names"] or "").split(","))}) + "\n")
        return 0
    cache, other, expect = values["--cache"], values["--other"], values["--expect"]
    line = sys.stdin.readline()
    try:
        patterns = json.loads(line) if line.strip() else []
    except ValueError:
        sys.stderr.write("treehash: the rules line on stdin is not JSON\n")
        return 2
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        sys.stderr.write("treehash: the rules must be a JSON list of strings\n")
        return 2
    placed = None
    if flags["--placed"]:
        line = sys.stdin.readline()
        try:
            placed = json.loads(line) if line.strip() else {}
        except ValueError:
            placed = None
        if not isinstance(placed, dict):
            sys.stderr.write("treehash: --placed needs a JSON object on the second line of stdin\n")
            return 2
    keep = int(values["--prune"]) if (values["--prune"] or "").isdigit() else None
    try:
        also = [str(d) for d in json.loads(values["--also"])] if values["--also"] else []
    except (ValueError, TypeError):
        also = []
    out = report(args[0], patterns, cache, if_exists, other, expect, mark, placed, flags["--siblings"], keep, also)
    sys.stdout.write(json.dumps(_looked(out, args[0], mark, names)) + "\n")
    return 0


def _looked(out: dict, root: str, mark, names) -> dict:
    """out with "seen" (whose marks of this nonce this host sees for root) when it marked and was given the names.
    Looked for after its own mark was left (or could not be): what makes one round-trip enough."""
    if mark is not None and names is not None and "marked" in out:
        out["seen"] = seen(root, mark.split(".", 1)[0], names)
    return out
