"""The payload a host command runs: an entry module of mnft.onhost with every module it imports, in one piece.

As Ansible's AnsiballZ ships a module with the module_utils it imports, a host command ships its entry module (the
lease script, the agent, the probe …) with the host modules that entry imports, found by reading their imports
(relative imports inside mnft.onhost, at the top or inside a function), never listed by hand. Each module goes as
its source and as the bytecode this controller's Python has for it (its own __pycache__, kept valid by the source's
mtime and size), so that a host whose Python has the same magic number runs it without compiling, and any other
compiles the source; the whole is zlib-compressed (about a third of its size: docs/architecture.md has each entry's
bytes, against the single scripts shipped before). mnft.onhost.boot is the host's reader; its BOOTSTRAP is what mnft.hosts.pyrun puts on the host
Python's command line. One payload is built once per entry and reused for every host and command until a module's
file changes.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import marshal
import re
import threading
import time
import types
import zlib
from functools import lru_cache
from pathlib import Path

from mnft import onhost
from mnft.onhost import boot

HOST_PACKAGE = Path(onhost.__file__).resolve().parent
BOOT = "boot"


def _file(name: str) -> Path:
    return HOST_PACKAGE / f"{name}.py"


# a relative import statement at the start of a line: `from . import a, b`, `from .x import (y,\n z)`
RELATIVE = re.compile(r"^[ \t]*from[ \t]+\.([A-Za-z_]\w*)?[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)", re.M)


def imported(name: str) -> set[str]:
    """The host modules `name` imports (short names): its relative imports, at the top or inside a function, read
    from the source's text (host modules import only this way: tests/test_architecture.py; the AST's answer is the
    same, tests/test_payload.py, at a tenth of the time: a command pays it once per entry)."""
    out = set()
    for match in RELATIVE.finditer(_file(name).read_text(encoding="utf-8")):
        if match.group(1):
            out.add(match.group(1))
        else:
            out.update(word.strip().split(" as ")[0].strip() for word in match.group(2).strip("()").split(","))
    return {n for n in out if n and _file(n).is_file()}



def closure(entry: str) -> tuple[str, ...]:
    """Every host module the entry needs, in a stable order: the package, boot, the entry and what it imports, on."""
    if not _file(entry).is_file():
        raise ValueError(f"no host module {entry!r} in {HOST_PACKAGE}")
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(sorted(imported(name) - seen))
    return ("__init__", BOOT, *sorted(seen - {BOOT}))


_building = threading.Lock()


def build(entry: str) -> bytes:
    """The payload of `entry`: `<bytes> <magic> <entry>\\n` and the marshalled {name: (source, bytecode)}. Built once
    while the package's files stay as they are, however many hosts and host threads ask (the files looked at once
    a second at most: a 64-host command asks 64 times in a breath)."""
    with _building:
        return _build(entry, _stamp())


_stamped: list = [0.0, ()]  # when the package's files were last looked at, and what they were


def _stamp() -> tuple:
    now = time.monotonic()
    if now - _stamped[0] > STAMP_EVERY:
        _stamped[:] = [now, tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(HOST_PACKAGE.glob("*.py")))]
    return _stamped[1]


STAMP_EVERY = 1.0  # seconds


@lru_cache(maxsize=64)
def _build(entry: str, stamp: tuple) -> bytes:
    modules = {}
    for name in closure(entry):
        if name == "__init__":
            continue  # the package's docstring is the controller's to read: the host gets an empty package (pack's)
        path = str(_file(name))
        full = f"{onhost.__name__}.{name}"
        code = importlib.machinery.SourceFileLoader(full, path).get_code(full)
        modules[name] = (Path(path).read_bytes(), marshal.dumps(_named(code, boot.filename(name))))
    return pack(entry, modules)


def _named(code: types.CodeType, filename: str) -> types.CodeType:
    """The module's code (from this controller's __pycache__) with the file name a host's own compile gives it: a
    host's traceback names the payload's module, never a path of this machine's."""
    consts = tuple(_named(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def pack(entry: str, modules: dict[str, tuple[bytes, bytes]], magic: str | None = None) -> bytes:
    """The payload's bytes: its header line and the marshalled modules (boot's source is added where missing).
    magic: the bytecode's magic number (this Python's by default)."""
    modules = dict(modules)
    modules.setdefault("__init__", (b"", b""))
    modules.setdefault(BOOT, (_file(BOOT).read_bytes(), b""))
    body = zlib.compress(marshal.dumps(modules), 6)
    magic = magic or importlib.util.MAGIC_NUMBER.hex()
    return b"%d %s %s\n" % (len(body), magic.encode(), entry.encode()) + body


def standalone(name: str) -> str:
    """The text of a host module that runs as a file of its own, outside any payload (mnft.onhost.entry: written
    into a run directory, run by each rank's Python): it imports nothing of the package
    (tests/test_architecture.py)."""
    return _file(name).read_text(encoding="utf-8")


def size(entry: str) -> int:
    """Bytes a command of this entry sends before its own input (bench: the payload's cost per command)."""
    return len(build(entry))


BOOTSTRAP = boot.BOOTSTRAP
