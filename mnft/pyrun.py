"""Run a stdlib-only Python script on a host in one round-trip, leaving the script's stdin free.

The host's Python gets a one-line bootstrap on its command line; the script follows on stdin, length-prefixed.
After the script is read, stdin stays open: a script can watch it and stop when the controller closes it
(which also happens when the SSH connection drops).
"""

from __future__ import annotations

from typing import Mapping

from mnft.command import Command
from mnft.inventory import Host

BOOTSTRAP = (
    "import sys;n=int(sys.stdin.buffer.readline());s=sys.stdin.buffer.read(n);"
    "exec(compile(s,'mnft-script','exec'),{'__name__':'__main__','__source__':s})"
)


def command(host: Host, *args: str, cwd: str | None = None, env: Mapping[str, str] | None = None, python: str | None = None) -> Command:
    """`python -c BOOTSTRAP ARGS…`: sys.argv[1:] of the script is ARGS. python: another interpreter than the
    host's (provision runs on the base Python)."""
    return Command(tuple([python or host.python, "-c", BOOTSTRAP, *args]), tuple((env or {}).items()), cwd)


def payload(source: str) -> bytes:
    data = source.encode()
    return b"%d\n" % len(data) + data
