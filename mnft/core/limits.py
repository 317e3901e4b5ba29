"""Limits of input: the most any file mnft reads may hold, in one place, so that no input (careless or hostile)
makes a parser hang, exhaust memory or end in a traceback. Past a limit the reader raises `InputError` (exit 2)
with one line naming the file and the limit; nothing is read or allocated beyond it.

Every value is generous for a real lab (64 hosts is the size on the label; a lock of torch with every wheel's
hash is a few hundred KiB) and small enough that the worst input within it is parsed in well under a second.
docs/security.md ("Limits of input") has the same table; tests/test_hostile_input.py holds each limit.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from mnft.core.errors import InputError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# ---- file size: bytes read at most (a reader reads one more byte to know the file is larger, never the rest)
INVENTORY_BYTES = 1 * MiB  # an inventory (mnft YAML, Ansible YAML or INI, DeepSpeed hostfile)
JOB_BYTES = 1 * MiB  # a job file (--job), a setup playbook
LOCK_BYTES = 16 * MiB  # a lock file (requirements.lock, pylock.toml)
ENV_FILE_BYTES = 256 * KiB  # an --env-file
RECORD_BYTES = 64 * MiB  # a run record runs/<id>/run.json mnft reads back
KNOWN_HOSTS_BYTES = 16 * MiB  # one known_hosts file (~50 000 hashed lines)
PUBLIC_KEY_BYTES = 64 * KiB  # a public key file (one line; an RSA-16384 key is 3 KiB)
HOST_FILE_BYTES = 4 * MiB  # a file setup reads on a host to edit it (authorized_keys, known_hosts, ~/.ssh/config)
HOST_OUTPUT_BYTES = 256 * MiB  # what one command on a host prints on stdout (and on stderr), kept by the controller
COLLECTED_BYTES = 4 * GiB  # one host's logs (and the job's metrics files) unpacked on the controller by `logs`
COLLECTED_FILES = 100_000  # files (and directories) in one host's collected logs
STATE_BYTES = 256 * MiB  # a state file mnft writes and reads back (live.json, stop-requested, provision record, wheelhouse index, step times)
METRICS_FILE_BYTES = 256 * MiB  # a job's metrics file read whole (trainer_state.json, one TensorBoard event file)
RUN_VALUE_BYTES = 4 * KiB  # a run's file that holds one value, collected from a host (exit_code, ended)
IGNORE_FILE_BYTES = 16 * MiB  # one ignore file sync reads (.gitignore, .git/info/exclude, core.excludesFile)
SOURCE_BYTES = 4 * MiB  # one source file the job preflight reads for its imports (a larger one is not read, and said)
WHEEL_METADATA_BYTES = 16 * MiB  # a wheel's .dist-info/METADATA (its long description included)
BUNDLE_BYTES = 256 * MiB  # the supervisor's bundle (mnft and the controller's libraries, a tar.gz of ~10 MiB) sent to a host

# ---- structure
LINE_CHARS = 64 * KiB  # one line of an inventory, job, playbook or lock file
YAML_DEPTH = 64  # nesting of YAML collections (an Ansible inventory nests groups: ~3 levels per group)
YAML_ALIASES = 10_000  # alias uses (*name, <<: *name) in one YAML document
YAML_NODES = 100_000  # nodes of a YAML document, and with every alias expanded (an alias bomb expands to billions)
NUMBER_CHARS = 32  # characters of one integer (a port, slots, an exit code; a 64-bit integer has 20)
HOSTS = 4096  # hosts of one inventory, after host ranges (node[1:1000000000] is refused before allocating)
HOST_PATTERN_CHARS = 1024  # characters of one host name or range pattern (a name is at most 253)
GROUP_VISITS = 100_000  # (group, parent path) pairs walked in an Ansible inventory (groups reached by many paths)

TABLE = (  # (limit, value, what it bounds) for docs and messages
    ("INVENTORY_BYTES", INVENTORY_BYTES, "bytes of an inventory"),
    ("JOB_BYTES", JOB_BYTES, "bytes of a job file or playbook"),
    ("LOCK_BYTES", LOCK_BYTES, "bytes of a lock file"),
    ("ENV_FILE_BYTES", ENV_FILE_BYTES, "bytes of an --env-file"),
    ("RECORD_BYTES", RECORD_BYTES, "bytes of a run record read back"),
    ("KNOWN_HOSTS_BYTES", KNOWN_HOSTS_BYTES, "bytes of a known_hosts file"),
    ("BUNDLE_BYTES", BUNDLE_BYTES, "bytes of the supervisor's bundle sent to a host"),
    ("PUBLIC_KEY_BYTES", PUBLIC_KEY_BYTES, "bytes of a public key file"),
    ("HOST_FILE_BYTES", HOST_FILE_BYTES, "bytes of a file setup edits on a host"),
    ("HOST_OUTPUT_BYTES", HOST_OUTPUT_BYTES, "bytes a command on a host prints, kept"),
    ("COLLECTED_BYTES", COLLECTED_BYTES, "bytes of a host's logs unpacked"),
    ("COLLECTED_FILES", COLLECTED_FILES, "files of a host's logs unpacked"),
    ("STATE_BYTES", STATE_BYTES, "bytes of a state file of mnft's read back"),
    ("METRICS_FILE_BYTES", METRICS_FILE_BYTES, "bytes of a job's metrics file read whole"),
    ("RUN_VALUE_BYTES", RUN_VALUE_BYTES, "bytes of a run's one-value file"),
    ("IGNORE_FILE_BYTES", IGNORE_FILE_BYTES, "bytes of an ignore file"),
    ("SOURCE_BYTES", SOURCE_BYTES, "bytes of a source file the preflight reads"),
    ("WHEEL_METADATA_BYTES", WHEEL_METADATA_BYTES, "bytes of a wheel's METADATA"),
    ("LINE_CHARS", LINE_CHARS, "characters of one line"),
    ("YAML_DEPTH", YAML_DEPTH, "levels of YAML nesting"),
    ("YAML_ALIASES", YAML_ALIASES, "YAML alias uses"),
    ("YAML_NODES", YAML_NODES, "YAML nodes with aliases expanded"),
    ("NUMBER_CHARS", NUMBER_CHARS, "characters of an integer"),
    ("HOSTS", HOSTS, "hosts of an inventory, ranges expanded"),
    ("HOST_PATTERN_CHARS", HOST_PATTERN_CHARS, "characters of a host pattern"),
    ("GROUP_VISITS", GROUP_VISITS, "group visits of an Ansible inventory"),
)


def size(n: int) -> str:
    """A byte count as a person writes it: 256 KiB, 1 MiB, 4 GiB."""
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    return f"{n // MiB} MiB" if n >= MiB and n % MiB == 0 else f"{n // KiB} KiB" if n % KiB == 0 else f"{n} bytes"


class TooLarge(InputError):
    """A file past its limit (a reader that forgives a damaged file still refuses one too large)."""


def too_large(where: Any, what: str, limit: int, name: str) -> TooLarge:
    """The one line for a file past its limit: the file, what it is, the limit by value and by name."""
    return TooLarge(f"{where}: the {what} is larger than {size(limit)} ({name}, a limit of mnft's input, see docs/security.md)")


def read_bytes(path: str | os.PathLike[str], limit: int, what: str, flag: str) -> bytes:
    """At most `limit` bytes of a file (one more is read to tell that it is larger, nothing beyond), or a one-line
    InputError: missing, unreadable, a directory, or larger than the limit."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:  # a regular file's size: refused without reading it
                raise InputError(f"{path}: the {what} is larger than {size(limit)} (a limit of mnft's input, see docs/security.md)")
            data = read_at_most(f, limit)  # a pipe or device: one byte more than the limit, never the rest
    except FileNotFoundError:
        raise InputError(f"{path}: {what} not found (pass {flag} with an existing file)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what}: {exc.__class__.__name__}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise InputError(f"{path}: the {what} is larger than {size(limit)} (a limit of mnft's input, see docs/security.md)")
    return data


def read_at_most(f: Any, limit: int) -> bytes:
    """At most limit + 1 bytes of an open binary file, in chunks: memory follows what the file holds, not the
    limit (f.read(n) allocates n bytes up front)."""
    chunks, total = [], 0
    while total <= limit:
        chunk = f.read(min(64 * KiB, limit + 1 - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def text_of(data: bytes, where: str, what: str) -> str:
    """UTF-8 text whose every line is at most LINE_CHARS long, or a one-line InputError naming the line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise InputError(f"{where}:{line}: the {what} is not UTF-8 text") from None
    check_lines(text, where)
    return text


def check_lines(text: str, where: str) -> None:
    if len(text) <= LINE_CHARS:
        return
    for number, line in enumerate(text.split("\n"), 1):
        if len(line) > LINE_CHARS:
            raise InputError(f"{where}:{number}: line longer than {LINE_CHARS} characters (a limit of mnft's input)")


def integer_text(text: str, where: str) -> None:
    """An integer written with more than NUMBER_CHARS characters is refused before it is converted (converting
    thousands of digits is quadratic, and Python refuses more than 4300)."""
    if len(text) > NUMBER_CHARS:
        raise InputError(f"{where}: an integer of {len(text)} characters: longer than {NUMBER_CHARS} (a limit of mnft's input)")


_BIG = 10**NUMBER_CHARS


def integer(value: Any, where: str) -> None:
    """A parsed integer (INI values, JSON) no longer than NUMBER_CHARS digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _BIG:
        raise InputError(f"{where}: an integer longer than {NUMBER_CHARS} characters (a limit of mnft's input)")


def shown(value: Any, width: int = 80) -> str:
    """repr(value) for a one-line message, cut to `width` characters (a value may be a megabyte long)."""
    if isinstance(value, (str, bytes)) and len(value) > width:
        value = value[:width]
        return repr(value)[:-1] + "…" + repr(value)[-1]
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _BIG:
        return f"an integer longer than {NUMBER_CHARS} digits"
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def read_file(path: str | os.PathLike[str], limit: int, what: str, name: str, *, missing: Any = ...) -> bytes:
    """At most `limit` bytes of a file mnft reads back (a record, a state file, a collected file): measured by
    fstat before it is read, a pipe read one byte past the limit, never more. Past the limit, or unreadable: a
    one-line InputError naming the file, the limit's value and its name. A missing file gives `missing` when
    one is given (else it is an error too)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > limit:
                raise too_large(path, what, limit, name)
            data = read_at_most(f, limit)
    except FileNotFoundError:
        if missing is not ...:
            return missing
        raise InputError(f"{path}: the {what} is missing") from None
    except IsADirectoryError:
        raise InputError(f"{path}: the {what} is a directory") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what}: {exc.strerror or exc.__class__.__name__}") from None
    if len(data) > limit:
        raise too_large(path, what, limit, name)
    return data


def read_json(path: str | os.PathLike[str], limit: int, what: str, name: str, *, missing: Any = ...) -> Any:
    """A JSON file within `limit` bytes (read_file), parsed; malformed (not UTF-8, not JSON, nested past Python's
    recursion limit, an integer of thousands of digits) is one line naming it. A missing one gives `missing`."""
    if missing is ...:
        data = read_file(path, limit, what, name)
    else:
        data = read_file(path, limit, what, name, missing=None)
        if data is None:
            return missing
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: the {what} is not JSON ({exc.__class__.__name__})") from None


CUT = "…"  # ends a line cut by lines(): a cut line is longer than its width, so a bounded parser never reads it as a record


def lines(path: str | os.PathLike[str], width: int = LINE_CHARS, chunk: int = 1 * MiB):
    """The lines of a text file (a log, a metrics file) as `Path.read_text(errors="replace").splitlines()` gives
    them, read in chunks: memory follows the width, not the file. A line longer than `width` characters is given
    cut to its first `width` and CUT (so still longer than `width`), the rest of it skipped unread into memory."""
    with (open(path, "rb") if isinstance(path, (str, os.PathLike)) else nullcontext(path)) as f:
        pending, skipping = b"", False
        while True:
            data = f.read(chunk)
            if not data:
                break
            pending += data
            while True:
                end = pending.find(b"\n")
                if end < 0:
                    break
                line, pending = pending[:end], pending[end + 1 :]
                if skipping:
                    skipping = False
                    continue
                yield from _pieces(line, width)
            if len(pending) > 4 * width and not skipping:  # a line past its width: give its head, skip the rest
                yield from _pieces(pending[: 4 * width], width, cut=True)
                pending, skipping = b"", True
            elif skipping:
                pending = b""
        if pending and not skipping:
            yield from _pieces(pending, width)


def _pieces(line: bytes, width: int, cut: bool = False):
    text = line.decode("utf-8", "replace")
    pieces = text.splitlines() or [""]
    if cut:
        pieces = pieces[:1]
    for piece in pieces:
        yield piece[:width] + CUT if cut or len(piece) > width else piece


def last_lines(path: str | os.PathLike[str], n: int, width: int = LINE_CHARS) -> list[str]:
    """The last n lines of a text file as lines() gives them, reading only its end (at most n lines of 4 bytes a
    character, plus one): a log of gigabytes costs what its tail does."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - (n + 1) * (4 * width + 1))
        f.seek(start)
        data = read_at_most(f, size - start)
    if start > 0:  # the first line read is a part of one: dropped
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    import io

    out: list[str] = []
    for line in lines(io.BytesIO(data), width):
        out.append(line)
        del out[:-n]
    return out if n > 0 else []
