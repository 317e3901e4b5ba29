"""A tar that came from elsewhere (a host's collected logs) unpacked into one folder, on every Python mnft runs on.

tarfile's own "data" filter (`extractall(filter="data")`) exists from Python 3.11.4 and 3.10.12 only, and
`requires-python` allows 3.10.0 up (Debian 12's own Python is 3.11.2). So every member is judged here first, the
same way on every Python, and nothing is written when one is refused: no absolute path, no `..`, no link (hard or
symbolic) that is absolute, climbs with `..` or leaves the folder, no device or pipe; then each member is written
as the filter would, on every Python alike: no set-user/group-id or sticky bit, no write bit for group or others,
owned by whoever unpacks (one path: what is unpacked never depends on the Python's patch release).

Standard library only (tests run it under the system's Python).
"""

from __future__ import annotations

import copy
import os
import stat
import tarfile
from pathlib import Path, PurePosixPath

# Pythons that have extraction filters warn (3.12, 3.13) or filter again (3.14) without one: the members are
# judged and made plain here already, so they are passed through as they are
PASS_THROUGH = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def refusal(member: tarfile.TarInfo) -> str | None:
    """Why this member may not be unpacked into a folder (one phrase naming it), or None."""
    name = member.name
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or PurePosixPath(name).is_absolute() or (parts and parts[0].endswith(":")):
        return f"{name!r} is an absolute path"
    if ".." in parts:
        return f"{name!r} climbs out of the folder (..)"
    if member.ischr() or member.isblk() or member.isfifo():
        return f"{name!r} is a device or a pipe"
    if member.issym() or member.islnk():
        target = PurePosixPath(member.linkname)
        if target.is_absolute() or member.linkname.startswith("\\"):
            return f"{name!r} links to an absolute path ({member.linkname!r})"
        if ".." in target.parts:
            return f"{name!r} links out of the folder ({member.linkname!r})"
        return None
    if not (member.isfile() or member.isdir()):
        return f"{name!r} is not a file, a folder or a link"
    return None


def _as_data(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """The member written as the "data" filter would: plain modes, no owner of the archive's."""
    mode = member.mode & ~(stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH)
    if member.isfile():
        mode |= stat.S_IRUSR | stat.S_IWUSR
    out = copy.copy(member)
    out.mode, out.uid, out.gid, out.uname, out.gname = mode, os.getuid(), os.getgid(), "", ""
    return out


def extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> str | None:
    """Unpack members into dest; or why not (the first member refused), with nothing written."""
    for member in members:
        why = refusal(member)
        if why:
            return why
    tar.extractall(dest, members=[_as_data(m) for m in members], numeric_owner=True, **PASS_THROUGH)
    return None
