"""`mnft wait RUN`: block until a run (a detached one, or another terminal's, or a session) has ended, and exit
with its outcome. (`--notify CMD` is not done yet.)"""

from __future__ import annotations

import time
from typing import Callable

from mnft.core.errors import ExitCode
from mnft.run import records

GOING = ("waiting", "checking", "syncing", "starting", "running")  # a run not ended yet
WAIT_EVERY = 5.0  # seconds between two looks at the hosts


def exit_code(state: str | None) -> int:
    """A run's end as an exit status: 0 for a run that succeeded (or a session that ended by itself), 130 for one
    stopped or interrupted, 1 for anything else (failed, resumable, timed out, idle-stopped, lost, refused)."""
    if state in ("succeeded", "ended"):
        return ExitCode.OK
    if state in ("stopped", "interrupted"):
        return 130
    return ExitCode.FAILED


def wait(record: records.RunRecord, look: Callable[[records.RunRecord], None], every: float = WAIT_EVERY, sleep=time.sleep) -> str:
    """Look (status on the hosts, which writes a detached run's end into its record; or the record another
    controller keeps) until the run has ended; its final state."""
    while True:
        fresh = records.read_record(record.path / "run.json")
        record.data.update(fresh)
        if record.data.get("state") not in GOING:
            return record.data.get("state")
        look(record)
        if record.data.get("state") not in GOING:
            return record.data.get("state")
        sleep(every)
