"""What a person reads on the terminal, for every command: the console, cells and titles taken from data
(never read as rich markup), status colours, sizes, losses; and JSON for machines."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a person's output is made: `--json` never loads rich (a command's start, issue 30)
    from rich.console import Console
    from rich.text import Text

STATUS_STYLE = {
    "ok": "green",
    "changed": "yellow",
    "failed": "red",
    "unreachable": "magenta",
    "host-key-rejected": "bold red",
    "recorded": "yellow",
    "already-trusted": "green",
    "changed-key": "bold red",
}


def program(argv0: str | None = None) -> str:
    """The command the user runs mnft's tasks with, from how this process was started: `invoke` (or `inv`, or
    `python -m invoke`) in the mnft checkout, else `mnft` (the console command, and any other start: a library call,
    a test's `python -c`)."""
    start = (sys.argv[0] if sys.argv else "") if argv0 is None else argv0
    name = start.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    if name in ("invoke", "inv") or start.replace("\\", "/").endswith("/invoke/__main__.py"):
        return "invoke"
    return "mnft"


def command(rest: str) -> str:
    """A command line of mnft's to name in a message (`mnft trust-hosts --hosts <inventory>`), as the user runs it:
    every message that tells a person to run a task says it through here."""
    return f"{program()} {rest}"


def clip_end(text: str, width: int) -> str:
    """A long line's end in `width` characters, cut at a word boundary and marked (…): the end of a line is what
    changed last (a step, a loss, an error's last words). A line without a space in its end is cut where it must."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    tail = text[-(width - 1):]
    space = tail.find(" ")
    return "…" + (tail[space + 1:] if 0 <= space < len(tail) - 1 else tail)


def console(stderr: bool = False) -> Console:
    """The console every command prints to. Strings are printed as they are, never read as rich markup (a job's
    name, a path or an argument like `files=[model.pt]` or `a[/b]` is data): style goes through `Text`."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, markup=False, soft_wrap=False, width=None if sys.stdout.isatty() else 200)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def status_text(status: str) -> Text:
    from rich.text import Text

    return Text(status, style=STATUS_STYLE.get(status, ""))


def plain(value: Any, style: str = "") -> Text:
    """A cell or title from data (host names, paths, errors): never read as rich markup ("a[/b]", "[bold]x")."""
    from rich.text import Text

    return Text("-" if value is None else str(value), style=style)


def fmt_size(n: int | float) -> str:
    """Bytes for a person: 512 B, 1.5 MiB, 43.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_loss(value) -> str:
    """A loss as text: 4 decimals, or as the recipe wrote it ("nan", "inf": JSON has no NaN), or "-" for none."""
    if isinstance(value, (int, float)):
        return f"{value:.4f}"
    return str(value) if value is not None else "-"
