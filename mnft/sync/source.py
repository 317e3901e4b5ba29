"""The local tree mnft copies: which directory (the git top level by default), which files (fixed excludes,
Invoke's configured `sync.exclude`, the user's patterns, then what git ignores, made exact against git), and its
tree hash. The same rules go to rsync and to every host's hash, so a host's checkpoints and logs that match
.gitignore are neither deleted by --delete nor counted as drift.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from mnft.core.errors import InputError
from mnft.hosts.hostkeys import mnft_home
from mnft.onhost import sharemarks, treehash
from mnft.sync.gitignore import git, git_view

# the marks of shared storage (sharemarks._anchor: inside a target that is a mount point of its own, or beside a
# directory mnft marks, such as a checkpoints directory within the tree), at any depth: neither hashed, sent nor
# deleted
SHARE_MARKS = f"{sharemarks.SHARE_DIR}/"
ALWAYS_EXCLUDES = (".git", "runs/", "outputs/", "/.mnft/", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache", "*.egg-info",
                   SHARE_MARKS)
DATA_EXCLUDES: tuple[str, ...] = (SHARE_MARKS,)


PROJECT_DIR = Path(__file__).resolve().parents[2]  # the checkout holding tasks.py and invoke.yaml


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


def default_source(start: Path | None = None) -> Path:
    """The tree `sync`, `check` and `train` use without --src: the top of the git repository around the current
    directory (so `cd docs && mnft sync` still copies the whole project), else the current directory itself; never
    mnft's own installation. A directory whose walk would read a whole machine (/, the home, a system directory)
    is refused where the tree is used (mnft.sync.targets.source_problem)."""
    start = Path(start or Path.cwd())
    if shutil.which("git") is not None:
        try:
            done = git(["rev-parse", "--show-toplevel"], start, {**os.environ, "GIT_CONFIG_NOSYSTEM": "1"})
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.strip():
            return Path(os.fsdecode(done.stdout.strip()))
    return start


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

