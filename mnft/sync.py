"""`invoke sync`: the same code (and data) on every host, proven by a tree hash.

Three layers, as everywhere in mnft:

* read: the local tree (exclude rules, then a tree hash) and each host's copy (the stdlib `mnft.treehash`
  script shipped through pyrun: real paths of the target and of the home, every file's size and sha256);
* plan (pure): per host, nothing to do / rsync with an exact argv / verify only (a shared filesystem another
  host wrote) / refused (the target resolves to `/` or the home). Tested with data: trees in, argv out;
* apply: rsync on every host at once (bounded pool), progress per host, then each host hashes its copy again
  and any difference fails that host, naming the files.

Which files belong to the tree: git decides, and the same rules protect a host's own files. Every ignore file
(each .gitignore in the tree, .git/info/exclude, core.excludesFile) is translated into rsync filter rules with
git's meaning (`!` re-includes, a middle slash anchors to the file's directory, last match wins -> first match
wins); those rules go to rsync and to the host's tree hash, so a host's checkpoints and logs that match
.gitignore are neither deleted by --delete nor counted as drift. rsync's own `--filter=':- .gitignore'` was not
used: rsync reads .gitignore lines as rsync patterns, which differ from git's. For the local tree git has the
last word: `git ls-files` lists what it ships and ignores, and any path where the translated patterns disagree
gets an anchored literal rule (`+ /path` or `/path`). On top (first) come the fixed excludes (`.git`, `runs/`,
caches, virtualenvs) and the configured ones; excluded paths are protected from `--delete` on the host.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from mnft import pyrun, treehash
from mnft.command import Command
from mnft.connection import Timeouts
from mnft.errors import ExitCode, InputError, MnftError
from mnft.fleet import Fleet, HostResult, Status
from mnft.hostkeys import SYSTEM_KNOWN_HOSTS, known_hosts_files, mnft_home
from mnft.inventory import Host, Inventory

ALWAYS_EXCLUDES = (".git", "runs/", "outputs/", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache", "*.egg-info")
DATA_EXCLUDES: tuple[str, ...] = ()
SSH_CONNECT_TIMEOUT = 10
RSYNC_IO_TIMEOUT = 120  # rsync --timeout: seconds without any data before a transfer is abandoned
HASH_TIMEOUT = 1800.0  # a first hash of a large data set reads every byte
SHOWN_DIFFERENCES = 20

# Targets that --delete must never mirror into. The home itself and `/` are refused in any spelling; these
# system directories too. A remote target that *resolves* to the home or an ancestor of it is refused per host.
SYSTEM_DIRS = frozenset({"/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/mnt", "/media", "/opt", "/proc", "/root",
                         "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/Users", "/usr/local", "/var/tmp", "/var/lib"})
HOME_LIKE = re.compile(r"^/(home|Users)/[^/]+$")


class SyncStatus:
    OK = "ok"  # already identical: nothing sent
    CHANGED = "changed"  # synced and verified identical
    WOULD_CHANGE = "would-change"  # --dry-run: differs, nothing sent
    REFUSED = "refused"  # the target is dangerous on that host (resolves to /, the home, ...): bad input, nothing touched
    FAILED = "failed"
    UNREACHABLE = Status.UNREACHABLE.value
    HOST_KEY_REJECTED = Status.HOST_KEY_REJECTED.value


# ------------------------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class LocalTree:
    root: Path
    rules: tuple[str, ...]  # exclude rules, rsync syntax: the same strings go to rsync and to the hash
    digest: str
    files: dict[str, tuple[int, str]]
    ignore_source: str  # how .gitignore was applied: "git", "git (no repository)" or "none: …"

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())


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

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RemoteTree":
        files = {rel: (int(v[0]), str(v[1])) for rel, v in (data.get("files") or {}).items()}
        return cls(str(data.get("root")), str(data.get("home")), bool(data.get("exists")), data.get("digest"), files,
                   dict(data.get("errors") or {}), data.get("refused") or None, data.get("rsync", ""))


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
class HostPlan:
    host: str
    action: str  # "none" | "rsync" | "verify" | "refuse" | "fail" (cannot sync: no rsync) | "skip" (unreachable)
    target: str
    argv: tuple[str, ...] = ()
    difference: Difference | None = None
    bytes_to_send: int = 0
    reason: str = ""


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
        if SyncStatus.FAILED in statuses:
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


@dataclass(frozen=True)
class SshSettings:
    """What rsync's ssh needs to verify hosts exactly like mnft's connection factory."""

    known_hosts: tuple[str, ...]
    global_known_hosts: str = str(SYSTEM_KNOWN_HOSTS)
    connect_timeout: int = SSH_CONNECT_TIMEOUT
    clear_known_hosts_command: bool = True  # OpenSSH >= 8.5 understands KnownHostsCommand (and `none`)

    @classmethod
    def for_inventory(cls, inventory: Inventory) -> "SshSettings":
        return cls(tuple(str(p) for p in known_hosts_files(inventory.known_hosts)), clear_known_hosts_command=ssh_accepts("KnownHostsCommand=none"))


_SSH_ACCEPTS: dict[str, bool] = {}


def ssh_accepts(option: str) -> bool:
    """Whether the installed OpenSSH accepts `-o option` (`ssh -G` parses the options and connects nowhere)."""
    if option not in _SSH_ACCEPTS:
        try:
            done = subprocess.run(["ssh", "-G", "-F", "none", "-o", option, "mnft-probe.invalid"], stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=10)
            _SSH_ACCEPTS[option] = done.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _SSH_ACCEPTS[option] = False
    return _SSH_ACCEPTS[option]


# ------------------------------------------------------------------------------------------------ pre-flight (pure)


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


def remote_refusal(tree: RemoteTree) -> str | None:
    """The host-side check: the probe's own refusal (real paths, before any walk: see treehash.refusal), and
    again here from the real paths it reported: not `/`, the home, or a directory above the home."""
    if tree.refused:
        return tree.refused
    root, home = tree.root.rstrip("/") or "/", tree.home.rstrip("/") or "/"
    if root == "/":
        return "the target resolves to / on this host"
    if root == home:
        return f"the target resolves to the home directory {home} on this host"
    if home.startswith(root + "/"):
        return f"the target {root} contains the home directory {home} on this host"
    return None


# ------------------------------------------------------------------------------------------------ read: local


PROJECT_DIR = Path(__file__).resolve().parent.parent  # the checkout holding tasks.py and invoke.yaml


def default_source(start: Path | None = None) -> Path:
    """The tree `invoke sync`, `invoke check` and `invoke train` use without --src: the top of the git repository
    around the current directory (so `cd docs && invoke sync` still copies the whole project), else mnft's own
    project directory (where tasks.py is). Never the current directory as such: it may be a subdirectory, whose
    mirror with --delete would remove the rest of the workdir, or the home, whose walk would never end."""
    start = Path(start or Path.cwd())
    if shutil.which("git") is not None:
        try:
            done = _git(["rev-parse", "--show-toplevel"], start, {**os.environ, "GIT_CONFIG_NOSYSTEM": "1"})
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.strip():
            return Path(os.fsdecode(done.stdout.strip()))
    if (PROJECT_DIR / "tasks.py").is_file():
        return PROJECT_DIR
    raise InputError(f"no source tree: {start} is not inside a git repository; give --src DIR")


def source_problem(src: Path) -> str | None:
    """Why src cannot be the tree to copy (not a directory, or one whose walk would read a whole machine), or None."""
    if not src.is_dir():
        return f"source {src} is not a directory"
    real = Path(os.path.realpath(src))
    home = Path(os.path.realpath(os.path.expanduser("~")))
    if str(real) == "/" or real == home or real in home.parents or str(real) in SYSTEM_DIRS:
        return f"source {src} is {'/' if str(real) == '/' else real}: give the project directory with --src"
    return None


def configured_excludes(config: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """`sync.exclude` from Invoke's configuration: from the task's config when given, else loaded the way invoke
    loads it for tasks.py (system, user and project invoke.yaml, INVOKE_* environment), so that check and train,
    which get no task config, apply the same list as `invoke sync`."""
    if config is None:
        from invoke import Config

        loaded = Config(project_location=str(PROJECT_DIR))
        loaded.load_system(merge=False)
        loaded.load_user(merge=False)
        loaded.load_project(merge=False)
        loaded.load_shell_env()
        config = loaded
    section = config.get("sync") or {}
    value = section.get("exclude") if hasattr(section, "get") else None
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise InputError(f"invoke config sync.exclude must be a list of patterns, got {value!r}")
    return tuple(_validate_patterns(value))


@dataclass(frozen=True)
class Source:
    """What to copy: the tree and the extra exclude patterns (configured + given), decided once for sync,
    check and train alike."""

    root: Path
    excludes: tuple[str, ...]


def code_source(src: Path | str | None = None, extra: Iterable[str] = (), *, config: Mapping[str, Any] | None = None) -> Source:
    root = Path(src) if src else default_source()
    return Source(root, (*configured_excludes(config), *_validate_patterns(extra)))



def _git(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, timeout=120)


def _split_gitignore_line(line: str) -> tuple[bool, bool, list[str]] | None:
    """One .gitignore line -> (negated, directories only, components), or None for a blank line or a comment."""
    line = line.rstrip("\r")
    if not line or line.startswith("#"):
        return None
    while line.endswith(" ") and not line.endswith("\\ "):
        line = line[:-1]
    negated = line.startswith("!")
    if negated:
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    parts = [p for p in line.lstrip("/").split("/") if p]
    if not parts:
        return None
    if not anchored and parts != ["**"]:
        parts = ["**", *parts]  # no slash: matches at any depth below the .gitignore's directory
    return negated, dir_only, parts


def _glob_part(text: str) -> list[tuple[str, str]]:
    """A git glob component -> tokens ("lit", char) / ("glob", text); git's backslash escapes any character."""
    tokens: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            tokens.append(("lit", text[i + 1]))
            i += 2
        elif c == "*":
            while i < n and text[i] == "*":  # `**` inside a component is `*` for git
                i += 1
            tokens.append(("glob", "*"))
        elif c == "?":
            tokens.append(("glob", "?"))
            i += 1
        elif c == "[":
            j = treehash.bracket_end(text, i)
            if j is None:
                tokens.append(("lit", c))
                i += 1
            else:
                tokens.append(("glob", text[i : j + 1]))
                i = j + 1
        else:
            tokens.append(("lit", c))
            i += 1
    return tokens


def _render(tokens: list[tuple[str, str]]) -> str:
    """Tokens -> an rsync pattern: literal wildcard characters are backslash-escaped, and backslashes only mean
    something in a pattern with a wildcard (rsync's rule, which mnft.treehash implements too)."""
    wild = any(kind == "glob" or text in "*?[" for kind, text in tokens)
    if not wild:
        return "".join(text for _, text in tokens)
    return "".join(("\\" + text if kind == "lit" and text in "*?[\\" else text) for kind, text in tokens)


def gitignore_rules(lines: Iterable[str], base: str = "") -> list[str]:
    """git ignore lines -> filter rules for the tree, in git's order (the last matching rule wins in git).

    base is the directory holding the ignore file, relative to the tree ("" for the tree's root and for
    info/exclude and core.excludesFile). Each rule is anchored at that directory; a `**` component, and the
    implicit one of a pattern without a slash, expands to "here or any depth below", spelled twice because
    rsync's `/**/` needs at least one directory. A `!` re-include becomes a `+ ` rule.
    """
    prefix = [("lit", c) for c in (base.strip("/") + "/" if base.strip("/") else "")]
    out: list[str] = []
    for line in lines:
        parsed = _split_gitignore_line(line)
        if parsed is None:
            continue
        negated, dir_only, parts = parsed
        if not prefix and len(parts) == 2 and parts[0] == "**" != parts[1]:
            bare = _render(_glob_part(parts[1])) + ("/" if dir_only else "")
            if not bare.startswith(("+ ", "- ")):  # a name anywhere: rsync's (and the hash's) pattern without a slash
                out.append(("+ " if negated else "") + bare)
                continue
        variants: list[list[tuple[str, str]]] = [list(prefix)]
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            if part == "**":
                if last:  # `a/**`: everything inside a
                    variants = [v + [("glob", "**")] for v in variants]
                else:  # zero or more directories
                    variants = [v for w in variants for v in (w, w + [("glob", "**"), ("lit", "/")])]
                continue
            variants = [v + _glob_part(part) + ([] if last else [("lit", "/")]) for v in variants]
        for tokens in variants[:8]:  # `**` repeated many times: enough spellings for any sane pattern
            rule = "/" + _render(tokens) + ("/" if dir_only else "")
            out.append(("+ " if negated else "") + rule)
    return out


def _ignore_files(src: Path, shipped: Iterable[str], env: dict[str, str], *, info: bool, global_file: bool) -> list[tuple[str, list[str]]]:
    """(base, lines) of every ignore file git applies to the tree, lowest precedence first."""
    found: list[tuple[str, list[str]]] = []

    def read(path: Path) -> list[str]:
        try:
            return path.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
        except OSError:
            return []

    configured = _git(["config", "--path", "--get", "core.excludesFile"], src, env)
    if not global_file:
        pass
    elif configured.returncode == 0 and configured.stdout.strip():
        found.append(("", read(Path(os.fsdecode(configured.stdout.strip())).expanduser())))
    else:
        xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
        found.append(("", read(Path(xdg) / "git" / "ignore")))
    if info:
        info = _git(["rev-parse", "--git-path", "info/exclude"], src, env)
        if info.returncode == 0:
            found.append(("", read(src / os.fsdecode(info.stdout.strip()))))
    for rel in sorted((p for p in shipped if p == ".gitignore" or p.endswith("/.gitignore")), key=lambda p: (p.count("/"), p)):
        found.append((posixpath.dirname(rel), read(src / rel)))
    return found


def git_view(src: Path) -> tuple[list[str], list[str], list[str], str]:
    """What git makes of src: (ignored paths, shipped files, ignore rules, how).

    ignored: paths git ignores (a collapsed directory ends with '/'); shipped: tracked and untracked files it
    does not ignore; rules: every ignore file as filter rules (see gitignore_rules), first match wins.
    """
    if shutil.which("git") is None:
        return [], [], [], "none: git is not installed, .gitignore files were not applied"
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1"}
    inside = _git(["rev-parse", "--is-inside-work-tree"], src, env)
    repository = inside.returncode == 0 and inside.stdout.strip() == b"true"
    top = repository and not _git(["rev-parse", "--show-prefix"], src, env).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="mnft-gitdir-") as gitdir:
        if not repository:  # a tree outside any repository: git's rules all the same, through a throwaway GIT_DIR
            subprocess.run(["git", "init", "-q", "--bare", gitdir], capture_output=True, check=False, timeout=60)
            env = {**env, "GIT_DIR": gitdir, "GIT_WORK_TREE": str(src)}
        done = _git(["ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"], src, env)
        listed = _git(["ls-files", "-z", "--cached", "--others", "--exclude-standard"], src, env)
        for run in (done, listed):
            if run.returncode != 0:
                raise MnftError(f"git ls-files failed in {src}: {run.stderr.decode(errors='replace').strip()}")
        shipped = [os.fsdecode(p) for p in listed.stdout.split(b"\0") if p]
        # info/exclude and core.excludesFile are relative to the repository's top: translated only when src is
        # that top (or in no repository); in a subdirectory the literal rules still apply them to local paths
        files = _ignore_files(src, shipped, env, info=bool(top), global_file=bool(top) or not repository)
    rules = [r for base, lines in files for r in gitignore_rules(lines, base)]
    rules.reverse()  # git: the last match wins; rsync: the first
    ignored = [os.fsdecode(p) for p in done.stdout.split(b"\0") if p]
    return ignored, shipped, rules, "git" if repository else "git (no repository)"


def git_ignored(src: Path) -> tuple[list[str], str]:
    """Paths under src that git ignores (a directory entry ends with '/'), and how they were found."""
    ignored, _, _, how = git_view(src)
    return ignored, how


def _validate_patterns(patterns: Iterable[str]) -> list[str]:
    out = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern or any(c in pattern for c in "\n\r\0"):
            raise InputError(f"exclude pattern {pattern!r} is empty or contains a control character")
        if pattern.startswith(("+ ", "- ")):
            raise InputError(f"exclude pattern {pattern!r}: give the pattern alone, without a '+ ' or '- ' rule prefix")
        out.append(pattern)
    return out


def _excluded_path(rules: treehash.Rules, rel: str, is_dir: bool, seen: dict[str, bool] | None = None) -> bool:
    """Whether rsync leaves rel out: it or a directory above it is excluded (rsync does not descend there)."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        folder = "/".join(parts[:i])
        hit = seen.get(folder) if seen is not None else None
        if hit is None:
            hit = rules.excluded(folder, True)
            if seen is not None:
                seen[folder] = hit
        if hit:
            return True
    return rules.excluded(rel, is_dir)


def exclude_rules(src: Path, extra: Iterable[str] = (), *, gitignore: bool = True, fixed: Sequence[str] = ALWAYS_EXCLUDES) -> tuple[tuple[str, ...], str]:
    """The filter rules for src, in rsync's order (first match wins); the same strings go to rsync and the hash.

    1. fixed + extra exclude patterns (they always win);
    2. exactness against git for the local tree: `+ /path` for a file git ships that the translated patterns
       would drop (a tracked file matching an ignore pattern, or a corner where the translation differs), and
       an anchored literal exclude for a path git ignores that they would keep;
    3. the ignore files' patterns themselves (gitignore_rules), so that files that exist only on a host
       (checkpoints, logs) are judged by the same patterns: left out of its hash and protected from --delete.
    """
    rules = [*fixed, *_validate_patterns(extra)]
    if not gitignore:
        return tuple(rules), "not applied"
    ignored, shipped, patterns, how = git_view(src)
    base, translated = treehash.Rules(rules), treehash.Rules(patterns)
    base_seen: dict[str, bool] = {}
    seen: dict[str, bool] = {}
    included: list[str] = []
    done: set[str] = set()
    for rel in shipped:
        if _excluded_path(base, rel, False, base_seen) or not _excluded_path(translated, rel, False, seen):
            continue
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in done:
                done.add(sub)
                included.append("+ " + treehash.escape_literal(sub) + ("/" if i < len(parts) else ""))
    if included:
        translated, seen = treehash.Rules(included + patterns), {}
    excluded: list[str] = []
    for path in ignored:
        is_dir = path.endswith("/")
        rel = path.rstrip("/")
        if rel and not _excluded_path(base, rel, is_dir, base_seen) and not _excluded_path(translated, rel, is_dir, seen):
            excluded.append(treehash.escape_literal(rel) + ("/" if is_dir else ""))
    exact = included + excluded
    return tuple(rules + exact + patterns), how


def _local_cache(root: Path) -> Path:
    return mnft_home() / "cache" / Path(treehash.default_cache(str(root))).name


def read_local(src: Path, extra_excludes: Iterable[str] = (), *, kind: str = "code", cache: bool = True) -> LocalTree:
    src = src.resolve()
    if kind == "code":
        rules, how = exclude_rules(src, extra_excludes)
    else:
        rules, how = exclude_rules(src, extra_excludes, gitignore=False, fixed=DATA_EXCLUDES)
    digest, files, errors = treehash.tree_hash(src, rules, str(_local_cache(src)) if cache else None)
    if errors:
        first = sorted(errors.items())[:3]
        raise InputError(f"cannot read the source tree {src}: " + "; ".join(f"{p}: {e}" for p, e in first))
    return LocalTree(src, rules, digest, dict(files), how)


def tree_hash(path: Path | str, excludes: Iterable[str] | None = None) -> tuple[str, dict[str, tuple[int, str]]]:
    """The tree hash of a local directory: (digest, {relpath: (size, sha256)}).

    excludes None means mnft's code rules for that directory (fixed excludes + what git ignores there).
    """
    path = Path(path)
    rules = exclude_rules(path.resolve())[0] if excludes is None else tuple(excludes)
    digest, files, errors = treehash.tree_hash(path, rules)
    if errors:
        raise InputError(f"cannot read {path}: " + "; ".join(f"{p}: {e}" for p, e in sorted(errors.items())[:3]))
    return digest, files


# ------------------------------------------------------------------------------------------------ read: remote


def hash_command(host: Host, target: str, *, if_exists: bool = False, other: str | None = None, expect: str | None = None) -> Command:
    """The host's tree hash probe for target; other is the host's other mnft directory, which must not overlap;
    expect the local digest (a host whose copy differs also reports its rsync version)."""
    args = [normalize_target(target)] + (["--other", normalize_target(other)] if other else []) + (["--expect", expect] if expect else []) \
        + (["--if-exists"] if if_exists else [])
    return pyrun.command(host, *args)


def hash_stdin(rules: Sequence[str]) -> bytes:
    import json

    return pyrun.payload(treehash.source()) + (json.dumps(list(rules)) + "\n").encode()


def parse_hash(result: HostResult) -> RemoteTree | None:
    import json

    if not result.ok:
        return None
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
        return RemoteTree.from_json(data)
    except (ValueError, IndexError, TypeError, KeyError, AttributeError):
        result.status = Status.FAILED
        result.error = "the tree hash printed no JSON: " + (result.tail(1) or "no output")
        return None


def other_dir(host: Host, target: str) -> str:
    """The host's other mnft directory: the data_dir for its workdir, the workdir for its data_dir."""
    return host.data_dir if target == host.workdir else host.workdir


def read_remote(fleet: Fleet, hosts: Sequence[Host], targets: Mapping[str, str], rules: Sequence[str], *, if_exists: bool = False,
                timeout: float = HASH_TIMEOUT, expect: str | None = None) -> dict[str, tuple[HostResult, RemoteTree | None]]:
    stdin = hash_stdin(rules)

    def one(host: Host) -> HostResult:
        target = targets[host.name]
        command = hash_command(host, target, if_exists=if_exists, other=other_dir(host, target), expect=expect)
        return fleet.run_one(host, command, stdin=stdin, timeout=timeout)

    results = fleet.map(one, hosts)
    return {r.host: (r, parse_hash(r)) for r in results}


# ------------------------------------------------------------------------------------------------ plan (pure)


def difference(local: Mapping[str, tuple[int, str]], remote: Mapping[str, tuple[int, str]]) -> Difference:
    send = tuple(sorted(p for p, v in local.items() if tuple(remote.get(p) or ()) != tuple(v)))
    delete = tuple(sorted(p for p in remote if p not in local))
    return Difference(send, delete)


def _rsync_e_word(word: str) -> str:
    """Quote one word of rsync's -e command (rsync splits it itself: quotes, doubled to escape; no backslashes)."""
    if word and not any(c in word for c in " \t'\""):
        return word
    return "'" + word.replace("'", "''") + "'"


def _ssh_path(path: str) -> str:
    """A file path for ssh's -o/-i, which expand `%` tokens in them: a literal `%` is written `%%`."""
    return path.replace("%", "%%")


def ssh_command(host: Host, ssh: SshSettings) -> str:
    """rsync's -e: OpenSSH with mnft's host-key verification (the same known_hosts files), ~/.ssh/config honoured
    for the rest. Options given with -o win over ~/.ssh/config, so the config cannot weaken the verification:
    no DNS-published keys (VerifyHostKeyDNS), no KnownHostsCommand adding keys mnft's files do not hold."""
    for path in ssh.known_hosts:
        if any(c in path for c in "\"\\\n"):
            raise InputError(f"known_hosts path {path!r} contains a quote, backslash or newline: OpenSSH cannot be given it safely")
    files = " ".join(f'"{_ssh_path(p)}"' if (" " in p or "'" in p) else _ssh_path(p) for p in ssh.known_hosts)
    words = [
        "ssh",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"UserKnownHostsFile={files}",
        "-o", f"GlobalKnownHostsFile={_ssh_path(ssh.global_known_hosts)}",
        "-o", "VerifyHostKeyDNS=no",
        *(["-o", "KnownHostsCommand=none"] if ssh.clear_known_hosts_command else []),
        "-o", f"ConnectTimeout={ssh.connect_timeout}",
        "-o", "ServerAliveInterval=15",
        "-o", "ServerAliveCountMax=4",
    ]
    if host.port is not None:
        words += ["-p", str(host.port)]
    if host.user:
        words += ["-l", host.user]
    if host.identity:
        words += ["-i", _ssh_path(os.path.expanduser(host.identity)), "-o", "IdentitiesOnly=yes"]
    return " ".join(_rsync_e_word(w) for w in words)


def remote_spec(host: Host, target: str) -> str:
    """rsync's destination. With -s the path reaches the remote rsync untouched by any shell, and a remote rsync
    starts in the home: `~/x` becomes the relative `x`. A local host gets its path expanded here."""
    norm = normalize_target(target)
    if host.is_local:
        return os.path.expanduser(norm).rstrip("/") + "/"
    path = norm[2:] if norm.startswith("~/") else norm
    address = f"[{host.address}]" if ":" in host.address else host.address
    return f"{address}:{path}/"


MKPATH_SINCE = (3, 2, 3)  # rsync's --mkpath (create the target's missing parents) is a receiver option


def supports_mkpath(version: str | None) -> bool:
    """Whether the host's rsync (as its probe reported it) understands --mkpath; an unknown version is tried."""
    parts = re.findall(r"\d+", version or "")
    return not parts or tuple(int(p) for p in parts[:3]) >= MKPATH_SINCE


def rsync_argv(host: Host, src: Path, target: str, rules_file: str, ssh: SshSettings, *, delete: bool = True,
               checksum: bool = False, io_timeout: int = RSYNC_IO_TIMEOUT, rsync: str = "rsync", mkpath: bool = True) -> tuple[str, ...]:
    argv = [
        rsync,
        "-a",  # recursive; keep links, permissions, times
        "-s",  # --secluded-args (--protect-args before 3.2.6): paths never meet the remote shell
        *(["--mkpath"] if mkpath else []),  # older receivers create the last component only
        "--from0",
        f"--filter=merge {rules_file}",
        f"--timeout={io_timeout}",
        "--stats",
        "--out-format=%i %l %n",
    ]
    if delete:
        argv.append("--delete")
    if checksum:
        argv.append("--checksum")
    if not host.is_local:
        argv += ["-e", ssh_command(host, ssh)]
    argv += [str(src).rstrip("/") + "/", remote_spec(host, target)]
    return tuple(argv)


def rules_file_bytes(rules: Sequence[str]) -> bytes:
    """The --filter merge file: `- PATTERN` per exclude, `+ PATTERN` per include, NUL-separated (--from0), so any
    path fits. Excluded paths are also protected from --delete on the receiver (rsync's default)."""
    return b"".join((b"" if r.startswith("+ ") else b"- ") + r.encode("utf-8", "surrogateescape") + b"\0" for r in rules)


def plan(
    inventory: Inventory,
    local: LocalTree,
    remote: Mapping[str, tuple[HostResult, RemoteTree | None]],
    *,
    kind: str,
    rules_file: str,
    ssh: SshSettings,
    delete: bool = True,
) -> list[HostPlan]:
    """Per host, what to do. Pure: the local tree, the hosts' trees (or why they could not be read) in; actions out.

    For data, hosts with shared_fs see one copy: a shared host that already holds it, else the first readable
    shared host with rsync writes it; the others only verify they see it.
    """
    plans = []
    shared_writer: str | None = None
    if kind == "data":
        shared = [(h.name, remote.get(h.name, (None, None))[1]) for h in inventory.hosts if h.shared_fs]
        readable = [(name, tree) for name, tree in shared if tree is not None and not remote_refusal(tree)]
        holder = next((name for name, t in readable if t.exists and t.digest == local.digest and not t.errors), None)
        shared_writer = holder or next((name for name, t in readable if t.rsync is not None), None)
    for host in inventory.hosts:
        target = host.workdir if kind == "code" else host.data_dir
        result, tree = remote.get(host.name, (None, None))
        if tree is None:
            plans.append(HostPlan(host.name, "skip", target, reason=(result.error if result is not None else "not read")))
            continue
        refusal = remote_refusal(tree)
        if refusal:
            plans.append(HostPlan(host.name, "refuse", target, reason=f"refused on {host.name}: {refusal}"))
            continue
        missing_rsync = f"rsync is not installed on {host.name} (install it, e.g. `apt-get install rsync`)" if tree.rsync is None else ""
        if tree.exists and tree.digest == local.digest and not tree.errors:  # (the probe may omit its file list then)
            plans.append(HostPlan(host.name, "none", target, difference=Difference((), ()), reason="identical"))
            continue
        diff = difference(local.files, tree.files if tree.exists else {})
        sending = sum(local.files[p][0] for p in diff.send)
        if kind == "data" and host.shared_fs and shared_writer not in (None, host.name):
            plans.append(HostPlan(host.name, "verify", target, difference=diff, bytes_to_send=0, reason=f"shared filesystem: the copy of {shared_writer}"))
            continue
        # rsync skips a file whose size and mtime match ("quick check"). When the hash found a file that differs
        # with the same size, a touched-back mtime could fool that check: compare contents instead.
        same_size = any(p in tree.files and tree.files[p][0] == local.files[p][0] for p in diff.send)
        if missing_rsync:
            plans.append(HostPlan(host.name, "fail", target, difference=diff, bytes_to_send=sending, reason=missing_rsync))
            continue
        argv = rsync_argv(host, local.root, target, rules_file, ssh, delete=delete, checksum=same_size, mkpath=supports_mkpath(tree.rsync))
        plans.append(HostPlan(host.name, "rsync", target, argv, diff, sending))
    return plans


# ------------------------------------------------------------------------------------------------ apply


# ssh could not reach or log in to the host. rsync's own "connection unexpectedly closed" (exit 12) is not one of
# these: the host was reached, and its rsync is missing, crashed or hit a full disk. That is a failure, with the cause.
_UNREACHABLE = re.compile(
    r"ssh: connect to host|Connection refused|Connection timed out|No route to host|Could not resolve|Name or service not known|"
    r"Network is unreachable|Permission denied \(|Connection closed by|Connection reset by|kex_exchange_identification"
)
_NO_RSYNC = re.compile(r"rsync: (command )?not found|rsync: No such file or directory")
_HOST_KEY = re.compile(r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED|No .* host key is known")


@dataclass
class RsyncOutcome:
    exit_code: int | None
    files_changed: int = 0
    files_deleted: int = 0
    bytes_sent: int = 0
    bytes_done: int = 0
    stderr: str = ""
    error: str = ""


def parse_stats(text: str) -> int:
    match = re.search(r"^Total bytes sent: ([\d,.]+)", text, re.MULTILINE)
    return int(re.sub(r"[,.]", "", match.group(1))) if match else 0


def classify(exit_code: int | None, stderr: str) -> tuple[str, str]:
    """(status, one-line error) for a finished rsync."""
    if exit_code == 0:
        return SyncStatus.CHANGED, ""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith("rsync error:")] or lines
    last = useful[-1] if useful else f"rsync exited with {exit_code}"
    if exit_code is None:
        return SyncStatus.FAILED, "rsync timed out"
    if _HOST_KEY.search(stderr):
        return SyncStatus.HOST_KEY_REJECTED, "host key verification failed (unknown or changed key): " + (useful[0] if useful else "")
    if exit_code == 255 or (exit_code == 12 and _UNREACHABLE.search(stderr)):
        return SyncStatus.UNREACHABLE, last
    if _NO_RSYNC.search(stderr):
        return SyncStatus.FAILED, f"rsync exit {exit_code}: rsync is not installed on the host ({_NO_RSYNC.search(stderr).group(0)})"
    problems = [ln for ln in useful if re.search(r"No space left|Permission denied|Read-only file system|Disk quota|unknown option|"
                                                 r"Killed|Segmentation fault|out of memory", ln)]
    causes = [ln for ln in useful if not re.search(r"connection unexpectedly closed|error in rsync protocol data stream", ln)]
    why = problems[0] if problems else (causes[-1] if causes else last)
    if exit_code == 12 and not problems:
        why = f"the host's rsync stopped (it crashed or its disk filled): {why}"
    return SyncStatus.FAILED, f"rsync exit {exit_code}: {why}"


def run_rsync(argv: Sequence[str], on_item: Callable[[int, bool], None] | None = None, timeout: float = 3600.0) -> RsyncOutcome:
    """Run one rsync, reporting each finished file (its size, whether it was a deletion) as it goes."""
    env = {**os.environ, "LC_ALL": "C"}
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    out = RsyncOutcome(None)
    tail: list[str] = []
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            parts = line.split(" ", 2)
            if line.startswith("*deleting"):
                out.files_deleted += 1
                if on_item:
                    on_item(0, True)
            elif len(parts) == 3 and len(parts[0]) == 11 and parts[0][0] in "<>ch.":
                if parts[0][1] != "d":
                    out.files_changed += 1
                    size = int(parts[1]) if parts[1].isdigit() else 0
                    out.bytes_done += size
                    if on_item:
                        on_item(size, False)
            else:
                tail.append(line)
        code = proc.wait()
    finally:
        timer.cancel()
    reader.join(timeout=10)
    out.exit_code = None if timed_out.is_set() else code
    out.stderr = b"".join(err).decode(errors="replace")
    out.bytes_sent = parse_stats("\n".join(tail))
    return out


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
) -> SyncReport:
    """read -> plan -> apply -> verify for the code (workdir) or a data set (data_dir).

    src None: the default source (see default_source); the exclude patterns are the configured ones
    (configured_excludes, from `config` or Invoke's files) plus extra_excludes.
    """
    started = time.monotonic()
    if kind == "data" and src is None:
        raise InputError("sync --data needs the data directory")
    source = code_source(src, extra_excludes, config=config)
    src = source.root
    preflight(inventory, src, kind)
    local = read_local(src, source.excludes, kind=kind)
    own_fleet = fleet is None
    fleet = fleet or Fleet(inventory, Timeouts(connect=SSH_CONNECT_TIMEOUT, command=HASH_TIMEOUT))
    targets = {h.name: (h.workdir if kind == "code" else h.data_dir) for h in inventory.hosts}
    try:
        with tempfile.TemporaryDirectory(prefix="mnft-sync-") as tmp:
            rules_file = str(Path(tmp) / "excludes")
            before = read_remote(fleet, inventory.hosts, targets, local.rules, expect=local.digest)
            plans = plan(inventory, local, before, kind=kind, rules_file=rules_file, ssh=SshSettings.for_inventory(inventory), delete=delete)
            if dry_run:
                hosts = {p.host: _dry_result(p, before, local, delete) for p in plans}
            else:
                outcomes = apply(plans, local.rules, rules_file, progress=progress, workers=workers, timeout=timeout)
                again = [h for h in inventory.hosts if any(p.host == h.name and p.action in ("rsync", "verify") for p in plans)]
                after = read_remote(fleet, again, targets, local.rules) if again else {}
                hosts = {p.host: _result(p, before, outcomes.get(p.host), after.get(p.host), local, delete) for p in plans}
    finally:
        if own_fleet:
            fleet.close()
    return SyncReport(kind, local.root, local.digest, len(local.files), local.total_bytes, hosts, dry_run, local.ignore_source,
                      round(time.monotonic() - started, 3))


def _unread(p: HostPlan, read: tuple[HostResult, RemoteTree | None] | None) -> HostSync:
    result = read[0] if read else None
    status = result.status.value if result is not None else SyncStatus.FAILED
    error = (result.error if result is not None else "") or "cannot read the host's tree"
    if status == Status.OK.value:
        status = SyncStatus.FAILED
    return HostSync(p.host, status, p.target, error=error, seconds=result.seconds if result else 0.0)


def _dry_result(p: HostPlan, before, local: LocalTree, delete: bool = True) -> HostSync:
    if p.action == "skip":
        return _unread(p, before.get(p.host))
    tree = before[p.host][1]
    if p.action == "refuse":
        return HostSync(p.host, SyncStatus.REFUSED, p.target, error=p.reason)
    if p.action == "fail":
        return HostSync(p.host, SyncStatus.FAILED, p.target, remote_hash=tree.digest, error=p.reason)
    diff = p.difference or Difference((), ())
    if not delete:  # --no-delete: files only on the host stay, so they are not listed as deletions
        diff = Difference(diff.send, ())
    if p.action == "verify":  # nothing is ever sent to it: it is checked after the shared copy is written
        status = SyncStatus.OK if diff.empty else SyncStatus.WOULD_CHANGE
        return HostSync(p.host, status, p.target, remote_hash=tree.digest, error="" if diff.empty else p.reason + ": verified after the sync")
    status = SyncStatus.OK if p.action == "none" or diff.empty else SyncStatus.WOULD_CHANGE
    return HostSync(p.host, status, p.target, remote_hash=tree.digest, would_send=list(diff.send), would_delete=list(diff.delete),
                    bytes_sent=p.bytes_to_send, error=p.reason if p.action == "verify" else "")


def _result(p: HostPlan, before, outcome: tuple[RsyncOutcome, float] | None, after, local: LocalTree, delete: bool) -> HostSync:
    if p.action == "skip":
        return _unread(p, before.get(p.host))
    tree = before[p.host][1]
    if p.action == "refuse":
        return HostSync(p.host, SyncStatus.REFUSED, p.target, error=p.reason)
    if p.action == "fail":
        return HostSync(p.host, SyncStatus.FAILED, p.target, remote_hash=tree.digest, error=p.reason)
    if p.action == "none":
        return HostSync(p.host, SyncStatus.OK, p.target, remote_hash=tree.digest)
    sync = HostSync(p.host, SyncStatus.CHANGED, p.target)
    if outcome is not None:
        ran, seconds = outcome
        sync.bytes_sent, sync.files_changed, sync.files_deleted, sync.seconds = ran.bytes_sent, ran.files_changed, ran.files_deleted, seconds
        status, error = classify(ran.exit_code, ran.stderr)
        if status != SyncStatus.CHANGED:
            sync.status, sync.error = status, error
            return sync
    if after is None or after[1] is None:
        result = after[0] if after else None
        sync.status = result.status.value if result is not None and result.status is not Status.OK else SyncStatus.FAILED
        sync.error = "verification failed: " + ((result.error if result is not None else "") or "cannot read the host's tree")
        return sync
    tree = after[1]
    sync.remote_hash = tree.digest if tree.exists else None
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
              dry_run: bool = False, extra_excludes: Iterable[str] = (), workers: int = 16, config: Mapping[str, Any] | None = None) -> SyncReport:
    """Copy the project tree at src (None: the repository, see default_source) into every host's workdir and
    prove each copy is identical (tree hash). Configured excludes (Invoke's sync.exclude) always apply.

    The launcher calls this before training; `report.ok` says whether every host holds `report.local_hash`.
    """
    return sync_tree(inventory, src, kind="code", fleet=fleet, progress=progress, delete=delete, dry_run=dry_run,
                     extra_excludes=extra_excludes, workers=workers, config=config)


def sync_data(inventory: Inventory, path: Path, *, fleet: Fleet | None = None, progress: bool = True, delete: bool = True,
              dry_run: bool = False, extra_excludes: Iterable[str] = (), workers: int = 16, timeout: float = 3600.0,
              config: Mapping[str, Any] | None = None) -> SyncReport:
    """Copy a data directory into every host's data_dir; shared_fs hosts get one copy and verify they see it.

    timeout: seconds each host's rsync may take in all (a large data set may need more than the default hour).
    """
    return sync_tree(inventory, path, kind="data", fleet=fleet, progress=progress, delete=delete, dry_run=dry_run,
                     extra_excludes=extra_excludes, workers=workers, timeout=timeout, config=config)


# ------------------------------------------------------------------------------------------------ check


def code_hashes(fleet: Fleet, hosts: Sequence[Host], src: Path | None = None, *, extra_excludes: Iterable[str] = (),
                config: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """For `invoke check`: each host's code hash when its workdir exists, and whether it matches the tree
    `invoke sync` would copy (the same source and rules: code_source)."""
    try:
        source = code_source(src, extra_excludes, config=config)
        why = source_problem(source.root)
        if why:
            raise InputError(why)
        local = read_local(source.root, source.excludes)
    except MnftError as exc:
        return {h.name: {"hash": None, "exists": None, "matches": None, "error": str(exc)} for h in hosts}
    read = read_remote(fleet, hosts, {h.name: h.workdir for h in hosts}, local.rules, if_exists=True)
    out: dict[str, dict[str, Any]] = {}
    for name, (result, tree) in read.items():
        if tree is None:
            out[name] = {"hash": None, "exists": None, "matches": None, "error": result.error or "cannot read the workdir"}
            continue
        refusal = remote_refusal(tree)
        if refusal:
            out[name] = {"hash": None, "exists": None, "matches": None, "error": f"workdir refused: {refusal}"}
            continue
        diff = difference(local.files, tree.files) if tree.exists else None
        out[name] = {
            "hash": tree.digest,
            "exists": tree.exists,
            "matches": (tree.digest == local.digest) if tree.exists else None,
            "local_hash": local.digest,
            "differing": diff.describe() if diff and not diff.empty else [],
        }
    return out


# ------------------------------------------------------------------------------------------------ output


def print_sync(report: SyncReport, as_json: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from mnft.report import console, print_json, status_text

    if as_json:
        print_json(report.to_json())
        return
    out = console()
    verb = "would sync" if report.dry_run else "sync"
    table = Table(title=f"{verb} {report.kind}: {report.src} ({report.local_files} files, {_size(report.local_bytes)}, hash {report.local_hash[:12]})")
    for col in ("host", "status", "target", "files", "deleted", "bytes sent", "hash match", "seconds", "detail"):
        table.add_column(col)
    for h in report.hosts.values():
        match = "-" if h.remote_hash is None else ("yes" if h.remote_hash == report.local_hash else "NO")
        files = len(h.would_send) if report.dry_run else h.files_changed
        deleted = len(h.would_delete) if report.dry_run else h.files_deleted
        table.add_row(
            h.host, Text(h.status, style="bold red") if h.status == SyncStatus.REFUSED else status_text(h.status), h.target, str(files), str(deleted), _size(h.bytes_sent),
            Text(match, style={"yes": "green", "NO": "bold red"}.get(match, "")), f"{h.seconds:.2f}", h.error,
        )
    out.print(table)
    for h in report.hosts.values():
        if report.dry_run and (h.would_send or h.would_delete):
            out.print(f"[bold]{h.host}[/bold]:")
            for line in Difference(tuple(h.would_send), tuple(h.would_delete)).describe():
                out.print(f"  {line.replace('differs: ', 'send: ').replace('extra: ', 'delete: ')}", highlight=False, markup=False)
        if h.differing:
            out.print(f"[red]{h.host}[/red]: files that differ:")
            for line in h.differing[:SHOWN_DIFFERENCES]:
                out.print(f"  {line}", highlight=False, markup=False)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
