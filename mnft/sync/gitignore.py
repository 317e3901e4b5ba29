"""git's ignore files as filter rules with git's meaning, for rsync and for mnft's tree hash.

Every ignore file (each .gitignore in the tree, .git/info/exclude, core.excludesFile) is translated: `!`
re-includes, a middle slash anchors to the file's directory, and git's last match wins becomes rsync's first match
wins. rsync's own `--filter=':- .gitignore'` is not used: rsync reads .gitignore lines as rsync patterns, which
differ from git's. git_view also asks git itself what it ships and ignores, so that mnft.sync.source can pin every
path where the translation and git disagree.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from mnft.core import limits
from mnft.core.errors import InputError, MnftError
from mnft.onhost import treehash


def git(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
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
    something in a pattern with a wildcard (rsync's rule, which mnft.onhost.treehash implements too)."""
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
        """Its lines; none when it cannot be read (as git); past limits.IGNORE_FILE_BYTES, one line (git itself
        ignores one over 100 MiB: mnft would ship what git leaves out, so it refuses instead)."""
        try:
            data = limits.read_file(path, limits.IGNORE_FILE_BYTES, "ignore file", "IGNORE_FILE_BYTES", missing=b"")
        except limits.TooLarge:
            raise
        except InputError:
            return []
        return data.decode("utf-8", "surrogateescape").splitlines()

    configured = git(["config", "--path", "--get", "core.excludesFile"], src, env)
    if not global_file:
        pass
    elif configured.returncode == 0 and configured.stdout.strip():
        found.append(("", read(Path(os.fsdecode(configured.stdout.strip())).expanduser())))
    else:
        xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
        found.append(("", read(Path(xdg) / "git" / "ignore")))
    if info:
        info = git(["rev-parse", "--git-path", "info/exclude"], src, env)
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
    inside = git(["rev-parse", "--is-inside-work-tree"], src, env)
    repository = inside.returncode == 0 and inside.stdout.strip() == b"true"
    top = repository and not git(["rev-parse", "--show-prefix"], src, env).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="mnft-gitdir-") as gitdir:
        if not repository:  # a tree outside any repository: git's rules all the same, through a throwaway GIT_DIR
            subprocess.run(["git", "init", "-q", "--bare", gitdir], capture_output=True, check=False, timeout=60)
            env = {**env, "GIT_DIR": gitdir, "GIT_WORK_TREE": str(src)}
        done = git(["ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"], src, env)
        listed = git(["ls-files", "-z", "--cached", "--others", "--exclude-standard"], src, env)
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

