"""Run a host module of mnft.onhost on a host in one round-trip, leaving its stdin free.

The host's Python gets a one-line bootstrap on its command line; the payload (the entry module and the host modules
it imports: mnft.hosts.payload) follows on stdin. After the payload is read, stdin stays open: an entry can read its
request there, watch it and stop when the controller closes it (which also happens when the SSH connection drops).
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping, Sequence

from mnft.hosts import payload as payload_builder
from mnft.hosts.command import Command
from mnft.hosts.fleet import HostResult, Status
from mnft.hosts.settings import Host

BOOTSTRAP = payload_builder.BOOTSTRAP  # mnft.onhost.boot's: reads a payload from stdin, serves its modules, runs its entry


def command(host: Host, *args: str, cwd: str | None = None, env: Mapping[str, str] | None = None,
            python: str | Sequence[str] | None = None, site: bool = True) -> Command:
    """`python -c BOOTSTRAP ARGS…`, the payload (`payload(entry)`) first on its stdin: sys.argv[1:] of the entry's
    main is ARGS. python: another interpreter than the host's (provision runs on the base Python), or a command
    prefix that ends in one (`podman run -i … IMAGE python3`: check's probe inside an image; the payload still arrives
    on stdin). site=False (`python -S`) for an entry that needs nothing beyond the standard library: the `site` import
    is most of an interpreter's start (its .pth files; 8 ms instead of 39 ms of CPU on the test bed's Python), paid
    once per host per round-trip."""
    python = python or host.python
    prefix = [python] if isinstance(python, str) else list(python)
    return Command(tuple([*prefix, *([] if site else ["-S"]), "-c", BOOTSTRAP, *args]), tuple((env or {}).items()), cwd)


def payload(entry: str) -> bytes:
    """What a host command of mnft.onhost.<entry> reads first on its stdin (mnft.hosts.payload.build): the entry and
    every host module it imports, each as its source and its bytecode."""
    return payload_builder.build(entry)


def text(data: str) -> bytes:
    """A text behind a payload on a host script's stdin, as `<bytes>\n<text>` (the all_reduce script torchlaunch
    writes for torchrun)."""
    raw = data.encode()
    return b"%d\n" % len(raw) + raw


def run_request(entry: str, args: Sequence[str], stdin: str = "") -> dict:
    """A host entry for a host process that is already running to run in itself (a lease's `hold`, check's probe
    session): its payload (base64), its arguments and its standard input."""
    return {"payload": base64.b64encode(payload(entry)).decode(), "argv": list(args), "stdin": stdin}


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
