"""A run's processes on this host: the live processes whose environment carries its id (run_processes, /proc read
once per take or look: _one_look), and the processes on a GPU it holds that are not of its run (collisions).
Standard library only, Python 3.8 syntax.
"""

import os

from .procs import RUN_ID_VAR, foreign, process_facts


def _environ(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            return fh.read().split(b"\0")
    except OSError:
        return []


def _zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def run_processes(run_id):
    """Live processes whose environment carries the run's id (any attempt of it). Only the environments this user
    may read are seen: its own processes, or every one as root; another login's run is told by its flock. Inside
    one take (or look) /proc is read once for every run id asked (_RUNS)."""
    if not run_id or not isinstance(run_id, str):
        return []
    runs = _RUNS if _RUNS is not None else _scan_runs()
    found = []
    for value, pids in runs.items():
        if value == run_id or value.startswith(run_id + "-a") and value[len(run_id) + 2:].isdigit():
            found += pids
    return sorted(found)


_RUNS = None  # run id (as in the environment) -> live pids, while one take or look lasts


def _scan_runs():
    """MNFT_RUN_ID value -> pids, of every live process whose environment this user may read."""
    key = (RUN_ID_VAR + "=").encode()
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        for entry in _environ(int(name)):
            if entry.startswith(key):
                if not _zombie(int(name)):
                    out.setdefault(entry[len(key):].decode("utf-8", "replace"), []).append(int(name))
                break
    return out


class _one_look(object):
    """Within the block, /proc is read once for the processes of every run (a take weighs several leases)."""

    def __enter__(self):
        global _RUNS
        _RUNS = _scan_runs()

    def __exit__(self, *exc):
        global _RUNS
        _RUNS = None


# ------------------------------------------------------------------------------------------------ collisions
# A compute process on a GPU that a run or session holds, and that is not of that run (someone ignored
# CUDA_VISIBLE_DEVICES), is a collision. The same judgment (procs.foreign) serves `mnft lab` here and the holder's
# keeper (watches.CollisionWatch).

def locker_pids(who):
    """The pids of lockers' "user pid N" words."""
    out = []
    for word in who or []:
        tail = str(word).rpartition(" pid ")[2]
        if tail.isdigit():
            out.append(int(tail))
    return out


def collisions(device, facts_of=process_facts):
    """The processes on a held device that are not of its holder's run: [{"pid", "user", "used_mib"}]."""
    holder = device.get("holder") or {}
    run_id = holder.get("run_id") if isinstance(holder.get("run_id"), str) else None
    keepers = locker_pids(device.get("lockers"))
    found = []
    for proc in device.get("processes") or []:
        pid = proc.get("pid")
        if isinstance(pid, int) and foreign(facts_of(pid), run_id, keepers, bool(holder.get("image"))):
            found.append(dict(proc))
    return found
