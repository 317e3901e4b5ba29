"""Run a stdlib-only Python script on a host in one round-trip, leaving the script's stdin free.

The host's Python gets a one-line bootstrap on its command line; the script follows on stdin, length-prefixed.
After the script is read, stdin stays open: a script can watch it and stop when the controller closes it
(which also happens when the SSH connection drops).
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import Any, Mapping, Sequence

from mnft.hosts.command import Command
from mnft.hosts.fleet import HostResult, Status
from mnft.hosts.settings import Host

BOOTSTRAP = (
    "import sys;n=int(sys.stdin.buffer.readline());s=sys.stdin.buffer.read(n);"
    "exec(compile(s,'mnft-script','exec'),{'__name__':'__main__','__source__':s})"
)
# compiled_payload's reader: the source, then its bytecode compiled on the controller, run as it is where this Python
# reads the same bytecode (its magic number: the same minor version), the source compiled here otherwise
COMPILED_BOOTSTRAP = (
    "import sys,marshal;i=sys.stdin.buffer;h=i.readline().split();s=i.read(int(h[0]));c=i.read(int(h[1]));"
    "m=getattr(sys.modules.get('_frozen_importlib_external'),'MAGIC_NUMBER',b'').hex();"
    "exec(marshal.loads(c) if m==h[2].decode() else compile(s,'mnft-script','exec'),{'__name__':'__main__','__source__':s})"
)


def command(host: Host, *args: str, cwd: str | None = None, env: Mapping[str, str] | None = None,
            python: str | Sequence[str] | None = None, site: bool = True, compiled: bool = False) -> Command:
    """`python -c BOOTSTRAP ARGS…`: sys.argv[1:] of the script is ARGS. python: another interpreter than the
    host's (provision runs on the base Python), or a command prefix that ends in one (`podman run -i … IMAGE
    python3`: check's probe inside an image; the script still arrives on stdin). site=False (`python -S`) for a
    script that needs nothing beyond the standard library: the `site` import is most of an interpreter's start
    (its .pth files; 8 ms instead of 39 ms of CPU on the test bed's Python), paid once per host per round-trip.
    compiled=True: the script comes as compiled_payload makes it."""
    python = python or host.python
    prefix = [python] if isinstance(python, str) else list(python)
    bootstrap = COMPILED_BOOTSTRAP if compiled else BOOTSTRAP
    return Command(tuple([*prefix, *([] if site else ["-S"]), "-c", bootstrap, *args]), tuple((env or {}).items()), cwd)


def payload(source: str) -> bytes:
    data = source.encode()
    return b"%d\n" % len(data) + data


_compiling = threading.Lock()


def compiled(source: str) -> tuple[str, bytes]:
    """The source compiled here as a host's `python` compiles it (no -O, no future flags but its own) and
    marshalled, with this Python's bytecode magic number (hex): what a host whose Python has the same number runs
    instead of compiling the source itself. Compiled once per command, however many hosts (and host threads) ask."""
    with _compiling:
        return _compiled(source)


@lru_cache(maxsize=16)
def _compiled(source: str) -> tuple[str, bytes]:
    import importlib.util
    import marshal

    code = compile(source, "mnft-script", "exec", dont_inherit=True, optimize=0)
    return importlib.util.MAGIC_NUMBER.hex(), marshal.dumps(code)


def module_payload(module: Any) -> bytes:
    """compiled_payload of a host script that is also a module of mnft's (mnft.hosts.leasehost): its source, and its
    bytecode as this interpreter imported it — from the module's own cache (__pycache__, kept valid by the source's
    mtime and size) where there is one, instead of compiling it once more on every command (~19 ms of CPU for the
    lease script, before any host is asked). Where no cache is kept (PYTHONDONTWRITEBYTECODE) it is compiled."""
    with _compiling:
        return _module_payload(module.__name__, module.__file__)


@lru_cache(maxsize=16)
def _module_payload(name: str, path: str) -> bytes:
    import importlib.machinery
    import importlib.util
    import marshal

    with open(path, encoding="utf-8") as f:
        data = f.read().encode()
    code = importlib.machinery.SourceFileLoader(name, path).get_code(name)
    code_bytes = marshal.dumps(code)
    return b"%d %d %s\n" % (len(data), len(code_bytes), importlib.util.MAGIC_NUMBER.hex().encode()) + data + code_bytes


def compiled_payload(source: str) -> bytes:
    """payload's counterpart for COMPILED_BOOTSTRAP (command(..., compiled=True)): the source and its bytecode
    (compiled). A host whose Python reads that bytecode runs it; any other compiles the source, as from payload. A
    script run on every host each time pays its compiling there (the check probe's 47 kB: 12-15 ms of CPU per host
    on the test bed's cores; reading the bytecode: 0.2 ms)."""
    magic, code = compiled(source)
    data = source.encode()
    return b"%d %d %s\n" % (len(data), len(code), magic.encode()) + data + code


def last_json(stdout: str) -> Any:
    """The JSON value of a script's last line of output (what `stdout.strip().splitlines()[-1]` is, found without
    splitting the whole output: a host may have printed up to limits.HOST_OUTPUT_BYTES); ValueError when there is
    none or it is not JSON (nested past Python's recursion limit, a thousands-digit integer included). The output
    itself was bounded as it was read (mnft.hosts.connection.Process)."""
    text = stdout.rstrip()
    tail = text[text.rfind("\n") + 1 :].strip().splitlines()
    if not tail:
        raise ValueError("no output")
    try:
        return json.loads(tail[-1])
    except RecursionError:
        raise ValueError("nested too deep") from None


def reply(result: HostResult, what: str) -> dict | None:
    """The JSON object a script printed as its last line, or None: a host that failed stays failed, and one that
    printed no JSON object is marked failed with `what` ("the probe") and its last line as the reason, one line."""
    if not result.ok:
        return None
    try:
        data = last_json(result.stdout)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        result.status = Status.FAILED
        result.error = f"{what} printed no JSON: " + (result.tail(1) or "no output")
        return None
    return data
