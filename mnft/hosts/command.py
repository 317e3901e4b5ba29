"""Commands are values: argument lists rendered to a shell string at the last moment, quoted once per shell layer.

Nothing from an inventory or a user ever reaches a shell unquoted: every argument goes through `shlex.quote`.
Environment variable names are validated; values whose name looks secret are never rendered onto a command
line (they travel as 0600 files instead) and are shown as `***` in anything a person or a log sees.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Iterable

from mnft.core.errors import InputError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    """True when an environment variable's name says its value must never be printed or put on a command line.

    A word of the name (split at `_`) that is a marker, ends in one (APIKEY, HFTOKEN) or is its plural (KEYS) is
    secret; a word that merely begins with one is not (TOKENIZERS_PARALLELISM, KEYBOARD_LAYOUT are settings)."""
    for word in name.upper().split("_"):
        for marker in SECRET_MARKERS:
            if word.endswith(marker) or word == marker + "S":
                return True
    return False


def check_env_name(name: str) -> str:
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        raise InputError(f"environment variable name {name!r} is invalid: use letters, digits and _ only")
    return name


def quote_path(path: str) -> str:
    """Quote a remote path for a POSIX shell, keeping a leading `~/` meaning the remote user's home."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")  # https://user:token@host/… : the part a log must not show


def redact_url(text: str) -> str:
    """Credentials in any URL of a text (an index URL with a token) replaced by ***."""
    return URL_CREDENTIALS.sub("***@", text)


def shell_word(arg: str) -> str:
    """One argument as a POSIX shell reads it back, the home written `"$HOME"` so that a `~/…` path (or `key=~/…`,
    which mnft's agent expands itself) still means the host user's home when the line is pasted into a shell."""
    key, sep, rest = arg.partition("=")
    if sep and ENV_NAME.fullmatch(key) and (rest == "~" or rest.startswith("~/")):
        return key + "=" + quote_path(rest)
    return quote_path(arg) if arg == "~" or arg.startswith("~/") else shlex.quote(arg)


def shell_line(argv: Iterable[str]) -> str:
    """A command line to read or copy: every argument quoted once (shell_word), nothing else interpreted."""
    return " ".join(shell_word(a) for a in argv)


@dataclass(frozen=True)
class Command:
    """A command to run on one host: argv, environment, working directory.

    `render()` gives the string a remote login shell runs (ssh hands the remote shell one string, so this
    is the one quoting layer ssh adds). `sh()` wraps that string for one more shell layer (`sudo sh -c`).
    """

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = field(default=())
    cwd: str | None = None

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("a command needs at least one argument")
        for arg in self.argv:
            if not isinstance(arg, str):
                raise TypeError(f"command arguments are strings, got {arg!r}")
        for name, value in self.env:
            check_env_name(name)
            if is_secret_name(name):
                raise InputError(
                    f"environment variable {name} looks secret: it is never put on a command line; "
                    "ship it as an env file instead"
                )
            if not isinstance(value, str):
                raise TypeError(f"environment value of {name} must be a string")

    @classmethod
    def of(cls, *argv: str, env: dict[str, str] | None = None, cwd: str | None = None) -> "Command":
        return cls(tuple(str(a) for a in argv), tuple((env or {}).items()), cwd)

    def render(self) -> str:
        parts = []
        if self.cwd is not None:
            parts.append(f"cd -- {quote_path(self.cwd)} &&")
        if self.env:
            parts.append("env " + " ".join(f"{name}={shlex.quote(value)}" for name, value in self.env))
        parts.append(" ".join(quote_path(a) if a.startswith("~/") else shlex.quote(a) for a in self.argv))
        return " ".join(parts)

    def sh(self) -> str:
        """One more quoting layer: `sh -c '<rendered>'`, for sudo or a nested shell."""
        return shlex.join(["sh", "-c", self.render()])

    def __str__(self) -> str:
        return self.render()


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """A copy of an environment fit for logs and run records: secret values replaced with ***."""
    return {name: (REDACTED if is_secret_name(name) else value) for name, value in env.items()}
