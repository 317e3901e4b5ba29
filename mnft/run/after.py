"""`--after RUN` (`RUN:any`): a run, or a sweep, that starts only once RUN has succeeded (or ended, however). It
holds no place in any host's line meanwhile: it joins the line from then on.

On the controller (`mnft.run.supervisor.judge_after`), RUN's record decides what can be known now: RUN ended already (decided: start, or
`dependency-failed` with the reason); RUN supervised on the lab (its supervisor's host and directory go to the
dependent run's supervisor, which reads RUN's state there: `wait_there`); RUN attached to a terminal here (an
attached dependent run waits here: `wait_for`; a detached one could not see it, and is refused with the fix).
A RUN that does not succeed ends the dependent run `dependency-failed`, naming RUN and its state: never a silent
wait.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable

from mnft.core.errors import ExitCode, MnftError
from mnft.run import records

ENDED = ("succeeded", "failed", "stopped", "resumable", "idle-stopped", "refused", "sync-failed", "interrupted", "supervisor-lost",
         "dependency-failed")
EVERY = 5.0  # seconds between two looks at RUN's state


def verdict(dep: dict, state: str | None) -> tuple[bool, str | None]:
    """(whether the wait is over, why the dependent run may not start: None when it may)."""
    if state not in ENDED:
        return False, None
    if dep.get("any") or state == "succeeded":
        return True, None
    return True, f"--after {dep['run_id']}: run {dep['run_id']} ended {state}, not succeeded (--after {dep['run_id']}:any starts once it ends, however)"


class DependencyFailed(MnftError):
    """RUN ended as the dependent run may not start after: nothing was started."""

    exit_code = ExitCode.FAILED


def refuse_failed(dep: dict | None) -> dict | None:
    """A RUN that has already ended not as asked refuses the dependent run at once, before anything starts."""
    if dep is not None:
        done, why = verdict(dep, dep.get("state"))
        if done and why is not None:
            raise DependencyFailed(why + "; nothing was started")
    return dep


def wait_for(dep: dict, say: Callable[[str], None], every: float = EVERY, sleep=time.sleep) -> str | None:
    """The wait for RUN: None once the dependent run may start, else why not. RUN attached to another terminal here
    is read from its record here (written as it goes); a supervised RUN where its supervisor lives (wait_there)."""
    if dep.get("where"):
        return wait_there(dep, say, every, sleep)
    said = None
    while True:
        state = records.load(dep["run_id"], anywhere=True).data.get("state")
        done, why = verdict(dep, state)
        if done:
            return why
        if state != said:
            say(f"waiting for run {dep['run_id']} to {'end' if dep.get('any') else 'succeed'} (now {state}); in no host's line meanwhile")
            said = state
        sleep(every)


def _read_there(where: dict, run_id: str) -> tuple[str | None, bool | None]:
    """(RUN's state, its supervisor alive) read on this host when RUN's supervisor lives here, else over SSH."""
    from mnft.onhost.superhost import ME, _read_json, state

    folder = str(where.get("dir") or "")
    here = _read_json(os.path.join(folder, ME))
    if isinstance(here, dict) and here.get("pid") == where.get("pid") and here.get("start") == where.get("start") \
            and here.get("host") == socket.gethostname():  # this host's own (a home shared over NFS shows it elsewhere too)

        found = state(os.path.basename(folder.rstrip("/")), 0, run_id if run_id != os.path.basename(folder.rstrip("/")) else None)
        return found.get("run_state"), bool(found.get("alive"))
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.settings import Inventory, validate_host
    from mnft.run.superops import SupervisorError, one

    reach = where.get("reach") if isinstance(where.get("reach"), dict) else {}
    settings = {"address": where.get("address"), **{k: v for k, v in reach.items() if k in ("user", "port", "python", "connection") and v is not None}}
    if reach.get("identity") and os.path.isfile(os.path.expanduser(str(reach["identity"]))):  # the controller's key; on the lab, the mesh's
        settings["identity"] = reach["identity"]
    host = validate_host(str(where.get("host")), 0, settings, {}, "--after")
    name = str(where.get("name"))
    try:
        with Fleet(Inventory(None, "mnft", (host,), host.name)) as fleet:
            found = one(fleet, host, "state", name, "0", *([run_id] if run_id != name else []), timeout=30)
    except SupervisorError:  # not reached now: asked again at the next look
        return None, None
    return found.get("run_state"), bool(found.get("alive"))


def wait_there(dep: dict, say: Callable[[str], None], every: float = EVERY, sleep=time.sleep) -> str | None:
    """A supervisor's wait for RUN (its supervisor's record, read where it lives): None once the dependent run may
    start, else why not. RUN's supervisor gone before RUN ended ends the wait too: RUN will not end by itself."""
    done, why = verdict(dep, dep.get("state"))
    if done:
        return why
    where = dep.get("where") or {}
    said = None
    while True:
        state, alive = _read_there(where, dep["run_id"])
        done, why = verdict(dep, state)
        if done:
            return why
        if alive is False:
            return (f"--after {dep['run_id']}: the supervisor of run {dep['run_id']} on {where.get('host')} is gone while the run had not "
                    f"ended ({state}): it will not end by itself")
        if state != said:
            say(f"waiting for run {dep['run_id']} to {'end' if dep.get('any') else 'succeed'} (now {state or 'not read'}); in no host's line meanwhile")
            said = state
        sleep(every)
