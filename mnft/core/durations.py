"""A duration as a person writes it on the command line or in a file: `90` or `90s` (seconds), `15m`, `2h`, `7d`,
or several together (`1h30m`)."""

from __future__ import annotations

import re

from mnft.core.errors import InputError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")


def parse(text: object, where: str) -> float:
    """Seconds (> 0); InputError naming `where` and the forms it takes otherwise."""
    value = str(text).strip().lower()
    pos, total, parts = 0, 0.0, 0
    while pos < len(value):
        match = _PART.match(value, pos)
        if not match or (not match.group(2) and match.end() != len(value)):
            break
        total += float(match.group(1)) * UNITS[match.group(2) or "s"]
        pos, parts = match.end(), parts + 1
    if not parts or pos != len(value) or not 0 < total < 10 * 365 * 86400:
        raise InputError(f"{where} {str(text)[:40]!r}: give a duration such as 90s, 15m, 2h, 7d or 1h30m (more than 0)")
    return total


def shown(seconds: float) -> str:
    """`2h10m`, `5m`, `40s`: as `mnft lab` shows how long a GPU has been idle."""
    seconds = int(round(max(0.0, seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
