"""One op of a supervisor's host side (mnft.onhost.superhost: look, unpack, prepare, state, stop, reach) run on a
host over the fleet: its JSON answer, or a one-line SupervisorError naming the host and the op."""

from __future__ import annotations

from mnft.core.errors import ExitCode, MnftError
from mnft.hosts import pyrun
from mnft.hosts.fleet import Fleet
from mnft.hosts.settings import Host

ENTRY = "superhost"


class SupervisorError(MnftError):
    exit_code = ExitCode.FAILED


def one(fleet: Fleet, host: Host, *args: str, stdin: bytes = b"", timeout: float = 60.0) -> dict:
    result = fleet.run_one(host, pyrun.command(host, *args, site=False), stdin=pyrun.payload(ENTRY) + stdin, timeout=timeout)
    data = pyrun.reply(result, f"the supervisor's host ({args[0]})")
    if data is None:
        raise SupervisorError(f"{host.name}: {args[0]}: {result.error or result.tail(1)}")
    if data.get("error"):
        raise SupervisorError(f"{host.name}: {data['error']}" + (f"\n{data['log']}" if data.get("log") else ""))
    return data
