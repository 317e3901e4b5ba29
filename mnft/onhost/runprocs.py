"""The run's processes (mnft.onhost.agent): found, proved the run's, signalled and ended (`stop`). Standard library
only.

Processes are found by the recorded process group and by MNFT_RUN_ID in their environment, never by name.

Only what is provably the run's is signalled. The process group is signalled only while its leader still is the
run's keeper: its start time (/proc/<pid>/stat field 22) is the one recorded in pgid_start at launch, and the run's
tag is in its environment (readable by root and by its own user) or the run directory on its command line; or
while a process carrying the run's tag is still a member of that group (it holds the number: no other group can
have it). Any other process is signalled only if its own environment carries the tag, checked through a pidfd
where the kernel has them (no pid reuse between the check and the signal). A process of another user is never
signalled (and never a PermissionError).
"""

import json
import os
import signal
import time

from .containers import remove_container
from .rungpus import gpu_apps, gpu_report
from .runfiles import TAG_VAR, _read


def _environ_has(pid, tag):
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return (TAG_VAR + "=" + tag).encode() in env


def run_pids(tag):
    """Every live process whose environment carries this run id (this agent excluded)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid() and _environ_has(int(name), tag):
            try:
                with open("/proc/%s/stat" % name) as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue  # a zombie holds nothing
            except OSError:
                continue
            pids.append(int(name))
    return sorted(pids)


def _stat(pid):
    """/proc/<pid>/stat from field 3 (state) on: field N is item N - 3; None if the process is gone."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid):
    """When the process started (clock ticks after boot: /proc/<pid>/stat field 22), or None if it is gone or a
    zombie. A pid number is reused; a pid and its start time together name one process."""
    fields = _stat(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _pgid_of(pid):
    fields = _stat(pid)
    try:
        return int(fields[2]) if fields else None
    except (IndexError, ValueError):
        return None


def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0")]
    except OSError:
        return []


def is_run_process(pid, start, tag, run_dir=None):
    """Whether pid still is the run's process that started at `start`: the same start time, and the run's tag in
    its environment (readable by root or its own user) or, for the keeper, `keep <run_dir>` on its command line.
    The start time is read again after the rest, so a process that ended meanwhile is not taken for ours."""
    if not pid or pid <= 0 or start is None or start_time(pid) != start:
        return False
    argv = _cmdline(pid)
    named = bool(tag) and _environ_has(pid, tag) or bool(run_dir) and "keep" in argv and run_dir in argv
    return named and start_time(pid) == start


def _recorded_start(run_dir):
    text = _read(os.path.join(run_dir, "pgid_start"))
    return int(text) if text and text.isdigit() else None


def group_is_ours(run_dir, pgid, tag, keeper=None):
    """Whether the process group numbered pgid still is the run's (see the module's docstring)."""
    if not pgid or pgid <= 1:
        return False
    if keeper is not None and keeper.pid == pgid and keeper.returncode is None and keeper.poll() is None:
        return True  # our own child, not reaped: its pid (and so its group's number) cannot have been reused
    if is_run_process(pgid, _recorded_start(run_dir), tag, run_dir):
        return True
    return bool(tag) and any(_pgid_of(pid) == pgid for pid in run_pids(tag))


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_tagged(pid, tag, sig):
    """Signal one process if its environment carries the run's tag. With a pidfd the check and the signal are on
    the same process even if the pid is reused in between."""
    opener = getattr(os, "pidfd_open", None)
    sender = getattr(signal, "pidfd_send_signal", None)
    fd = None
    if opener is not None and sender is not None:
        try:
            fd = opener(pid)
        except OSError:
            fd = None  # gone, or a kernel without pidfds: the plain check below
    try:
        if not _environ_has(pid, tag):
            return False
        if fd is not None:
            sender(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def terminate(run_dir, grace=10.0, keeper=None):
    """SIGTERM the run's process group, SIGKILL after `grace`, then any leftover carrying the run id; each only
    while it is provably the run's. Nothing of the run alive: {"ended": true}, nothing signalled."""
    spec = json.loads(_read(os.path.join(run_dir, "spec.json"), "{}") or "{}")
    tag = spec.get("tag")
    text = _read(os.path.join(run_dir, "pgid"), "0") or "0"
    pgid = int(text) if text.isdigit() else 0
    killed = []
    seen = run_pids(tag) if tag else []  # the run's processes before the kill: a GPU one of them still holds is ours
    if not seen and not group_is_ours(run_dir, pgid, tag, keeper):
        if keeper is not None:
            keeper.poll()
        remove_container(spec, grace=0)  # a container left behind with nothing of the run in it (created, never started)
        result = {"killed": [], "remaining": [], "ended": True, "exit_code": _read(os.path.join(run_dir, "exit_code"))}
        return dict(result, **gpu_report(gpu_apps(), set()))
    if group_is_ours(run_dir, pgid, tag, keeper) and _signal_group(pgid, signal.SIGTERM):
        killed.append(pgid)
    deadline = time.time() + grace
    while time.time() < deadline:
        if keeper is not None:
            keeper.poll()
        if not (pgid and group_is_ours(run_dir, pgid, tag, keeper) and _group_alive(pgid)) and not (tag and run_pids(tag)):
            break
        time.sleep(0.1)
    if group_is_ours(run_dir, pgid, tag, keeper):
        _signal_group(pgid, signal.SIGKILL)
    if tag:
        for pid in run_pids(tag):
            if _signal_tagged(pid, tag, signal.SIGKILL):
                killed.append(pid)
    remove_container(spec, grace=0)  # podman's/docker's container outlives its client (conmon, the daemon): by its name
    if keeper is not None:
        try:
            keeper.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass
    remaining = _after_kill(tag, killed)
    return dict({"killed": killed, "remaining": remaining}, **gpu_report(gpu_apps(), set(killed) | set(remaining) | set(seen)))


KILL_SETTLE = 5.0  # seconds a SIGKILLed process may take to be gone (a loaded host frees a large process slowly)


def _after_kill(tag, killed=None, settle=KILL_SETTLE):
    """The run's processes still alive once SIGKILL has had time to work: a killed process lingers while the
    kernel frees its memory (64 torchrun trees on 2 busy cores took more than the 0.1 s this once allowed, and
    `stop` said they remained although nothing was left a moment later). One the run forked after the kill's
    scan is killed too (by its tag, as every kill here); `killed` collects whom this signalled."""
    if not tag:
        return []
    deadline = time.time() + settle
    while True:
        remaining = run_pids(tag)
        if not remaining or time.time() >= deadline:
            return remaining
        for pid in remaining:
            if _signal_tagged(pid, tag, signal.SIGKILL) and killed is not None and pid not in killed:
                killed.append(pid)
        time.sleep(0.05)
