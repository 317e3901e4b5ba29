"""mnft host probe, its output: one JSON line at a time, and an exception as the one line a user reads.

Shared by the probe's modes (mnft.onhost.probe), its facts (mnft.onhost.facts) and its network tests
(mnft.onhost.nettest). Python >= 3.8 and the standard library only.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys


# ------------------------------------------------------------------------------------------------ helpers


def _message(exc: BaseException) -> str:
    """One line for an exception; the wording the controller shows to a user."""
    if isinstance(exc, socket.timeout):  # an alias of TimeoutError since 3.10, an OSError subclass before
        return "timed out"
    if isinstance(exc, socket.gaierror):
        return "cannot resolve the address: %s" % (exc.strerror or exc)
    if isinstance(exc, OSError):
        if exc.errno == errno.EADDRINUSE:
            return "address in use"
        if exc.errno == errno.ECONNREFUSED:
            return "connection refused"
        if exc.strerror:
            return exc.strerror[0].lower() + exc.strerror[1:]
    text = str(exc).strip().splitlines()
    if type(exc) is RuntimeError:  # raised here with a message meant for the user
        return text[0] if text else "failed"
    return "%s: %s" % (type(exc).__name__, text[0]) if text else type(exc).__name__



def _emit(obj: dict) -> None:
    """Print one JSON line and flush; if the reader is gone, stay quiet (also at interpreter exit)."""
    try:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError, OSError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
