"""What a signal to mnft does: SIGINT (Ctrl-C) and SIGTERM alike end every child mnft started here, then unwind.

`handling()` is installed by the command line around every task. On the first SIGINT or SIGTERM it signals the
process group of every child registered with `track()` (SIGTERM; the ones left get SIGKILL as the task unwinds)
and raises `Interrupted` (a KeyboardInterrupt carrying the signal) in the main thread, so every phase unwinds as
it does for Ctrl-C: the gang is torn down on the hosts, connections close, the run record says `interrupted`.
A child registered after that is refused (killed at once, Interrupted raised in its thread): a pool of rsyncs
does not start its next one. A second signal while unwinding kills the children again and does not cut the
teardown short. The exit code is 128 + the first signal's number: 130 for SIGINT, 143 for SIGTERM.

Why children need this: rsync runs in its own session (so that a terminal's Ctrl-C reaches mnft alone and mnft
decides what to stop), and SIGTERM sent to mnft's pid reaches nobody else; without this, both would go on after
mnft is gone (or mnft would wait for them to finish).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
KILL_AFTER = 3.0  # seconds a signalled child gets before SIGKILL when the task unwinds


class Interrupted(KeyboardInterrupt):
    """mnft was told to stop by a signal: unwind as for Ctrl-C; exit 128 + signum."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(f"interrupted ({NAMES.get(signum, f'signal {signum}')})")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_lock = threading.Lock()
_children: set[subprocess.Popen] = set()
_signalled: list[int] = []  # the signals received while handling, in order


def received() -> int | None:
    """The first signal received in the current `handling()` block (None: none)."""
    return _signalled[0] if _signalled else None


def describe() -> str:
    """"Ctrl-C" or "SIGTERM": how the interrupt in progress came, for messages and records."""
    return NAMES.get(received() or signal.SIGINT, f"signal {received()}")


def _signal_children(sig: int) -> None:
    with _lock:
        children = list(_children)
    for child in children:
        if child.returncode is None:  # our own child, not reaped: its pid, and the group it leads, are still its
            try:
                os.killpg(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _on_signal(signum: int, frame) -> None:
    first = not _signalled
    _signalled.append(signum)
    _signal_children(signal.SIGTERM if first else signal.SIGKILL)
    if first:
        raise Interrupted(signum)


def end_children(grace: float = KILL_AFTER) -> None:
    """SIGKILL what is left of the registered children `grace` seconds after the interrupt's SIGTERM."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with _lock:
            if all(c.poll() is not None for c in _children):
                return
        time.sleep(0.05)
    _signal_children(signal.SIGKILL)


@contextmanager
def handling() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted after signalling the children (main thread only; elsewhere a no-op).
    Whatever ends the block after a signal (a KeyboardInterrupt re-raised bare, an expected error a killed child
    caused) leaves it as Interrupted with the first signal: the exit code is the interrupt's. A bug keeps its
    traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from mnft.core.errors import MnftError

    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    _signalled.clear()
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    try:
        yield
    except (KeyboardInterrupt, MnftError) as exc:
        if not isinstance(exc, KeyboardInterrupt) and not _signalled:
            raise
        signum = _signalled[0] if _signalled else signal.SIGINT  # Python's own Ctrl-C handler: SIGINT
        _signal_children(signal.SIGTERM)
        end_children()
        if isinstance(exc, Interrupted) and exc.signum == signum:
            raise
        raise Interrupted(signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _signalled.clear()  # the next block (a test, a library caller) starts afresh


def check() -> None:
    """Raise Interrupted if mnft is being interrupted (for work about to start in another thread)."""
    if _signalled:
        raise Interrupted(_signalled[0])


@contextmanager
def track(child: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Register a child that leads its own process group (start_new_session=True) for the time it runs: an
    interrupt signals its whole group (rsync and the ssh it started). Registered after the interrupt: killed at
    once, and Interrupted raised."""
    with _lock:
        _children.add(child)
    try:
        if _signalled:
            _signal_children(signal.SIGKILL)
            child.wait()
            raise Interrupted(_signalled[0])
        yield child
    finally:
        with _lock:
            _children.discard(child)
