"""The host's leases taken, held, shown and let go: the host's own lease and each device's and workdir's (take,
release, show, held_leases, device_states), the host as `mnft lab` shows it (lab), and the run directories of the
keepers that hold a run's leases (run_dirs). The lease model: mnft.onhost.leasehost's docstring. Standard library
only, Python 3.8 syntax.
"""

import fcntl
import json
import os
import time

from .drain import drain_marks, drain_of
from .gpuread import pick, read_devices
from .health import broken
from .leasefiles import (LEASE_MODE, LEASE_NAME, Refused, _check_lease, _existing, _free, _lock_mutex, _login, _read, _text,
                         _write, lease_dir, lease_path, lockers, open_shared, update_in_place)
from .labpolicy import lab_policy
from .line import ahead_of, placed, tickets
from .procs import RUN_ID_VAR
from .runs import _environ, _one_look, collisions, run_processes

# ------------------------------------------------------------------------------------------------ devices
# A run takes devices, not the host: each device (a GPU by its nvidia-smi index; on a host without nvidia-smi the
# host's CPUs as one device, "cpu") has a lease file of its own, mnft-dev-<key>.json, and the run's workdir one,
# mnft-work-<hash of its path>.json, both taken, held and let go exactly as the host's (same files rules, same
# flocks, same critical section). The host's lease is for operations that change the whole host (setup,
# provision): taken only while no device or workdir lease is held, and while it is held no device is taken.

DEVICE_PREFIX, WORK_PREFIX = "mnft-dev-", "mnft-work-"


def device_key(device):
    """The device's lease key: "gpu<N>" by its index now, "cpu" for a host without nvidia-smi; a GPU gone from the bus
    has no index and never a lease: "gone-<its UUID>" names no file anyone takes."""
    if device.get("index") is None and device.get("uuid"):
        return "gone-" + "".join(c for c in str(device["uuid"]) if c.isalnum() or c == "-")[:64]
    return "cpu" if device.get("index") is None else "gpu%d" % device["index"]


def device_name(device):
    return DEVICE_PREFIX + device_key(device) + ".json"


def work_name(workdir):
    """The workdir's lease file: one per directory of the host, whoever syncs or runs there."""
    import hashlib

    path = os.path.abspath(os.path.expanduser(workdir))
    return WORK_PREFIX + hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:16] + ".json"


def _held_by(name, op=None):
    """(held, holder, lockers) of a lease file without keeping anything: held when somebody holds its flock (or its
    run's processes live), unless `op` holds it (this operation, through another name for the machine)."""
    fd = _existing(name)
    if fd is None:
        return False, None, []
    try:
        holder = _read(fd)
        if _free(fd, holder):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False, holder, []
        return not (op and holder and holder.get("op") == op), holder, lockers(fd)
    finally:
        os.close(fd)


RUN_COMMANDS = ("train", "shell")  # the holders that run a program from the login's environment


def held_leases(prefixes=(DEVICE_PREFIX, WORK_PREFIX), op=None):
    """[(file name, holder, lockers)] of every device and workdir lease held now (whole-host operations wait for none)."""
    try:
        names = sorted(n for n in os.listdir(lease_dir()) if n.startswith(prefixes) and n.endswith(".json"))
    except OSError:
        return []
    found = []
    for name in names:
        held, holder, who = _held_by(name, op)
        if held:
            found.append((name, holder, who))
    return found


def device_states(devices, op=None):
    """Each device with its lease's state: "free", "held" (holder, lockers: what /proc/locks says), "outside" (free
    of leases but a compute process uses it: someone ran a program by hand), "drained" (an admin took it out of
    service: its mark in "drain") or "unhealthy" (its health breaks runs: why in "broken"). Drained and unhealthy
    devices are never taken; a held one stays held (its run goes on), its drain mark and health shown beside."""
    marks, _ = drain_marks()
    out = []
    for device in devices:
        state = dict(device)
        held, holder, who = _held_by(device_name(device), op)
        mark, why = drain_of(marks, device), broken(device)
        if mark:
            state["drain"] = mark
        if why:
            state["broken"] = why
        if held:
            state.update(state="held", holder=holder, lockers=who)
        elif device.get("processes"):
            state.update(state="outside")
        elif mark:
            state.update(state="drained")
        elif why:
            state.update(state="unhealthy")
        else:
            state.update(state="free")
        out.append(state)
    return out


def _take_file(name, holder, extra=None):
    """Take one lease file (the caller holds the critical section and knows it is free): (fd with a shared flock,
    the holder it named before, unless released), or (None, its holder) when it is held after all."""
    path = os.path.join(lease_dir(), name)
    fd = open_shared(path, True, LEASE_MODE)
    try:
        previous = _read(fd)
        if not _free(fd, previous, holder.get("op")):
            os.close(fd)
            return None, previous
        _check_lease(fd, path)
    except BaseException:
        os.close(fd)
        raise
    _write(fd, dict(holder, taken=time.time(), **dict(_login(), **(extra or {}))))
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd, (previous if previous and not previous.get("released") else None)


def take_devices(holder, devices, links):
    """Take what a run (or a sync: no devices) asks of this host, all or nothing: ({"taken": True, "devices": [the
    ones taken], "paths": [every lease file held]}, fds) or ({"busy": True, ...why}, [])."""
    scope = holder.get("scope") or {}
    want = scope.get("gpus")  # None: every device (a run without --gpus); 0: none (a sync)
    host_held, host_holder, _ = _held_by(LEASE_NAME)
    if host_held:
        same = isinstance(host_holder, dict) and host_holder.get("uid") == os.getuid()
        return {"busy": True, "what": "host", "holder": host_holder, "same_login": same}, []
    workdir = scope.get("workdir")
    if workdir:
        held, previous, who = _held_by(work_name(workdir), holder.get("op"))
        if held:
            return {"busy": True, "what": "workdir", "workdir": workdir, "holder": previous, "lockers": who,
                    "run_processes": len(run_processes(_text(previous, "run_id")))}, []
    if scope.get("own"):  # this login's environment: its own runs and sessions use it, another login's never do
        mine = [dict(h, file=n, lockers=w) for n, h, w in held_leases(op=holder.get("op"))
                if isinstance(h, dict) and h.get("uid") == os.getuid() and h.get("command") in RUN_COMMANDS]
        if mine:
            return {"busy": True, "what": "own-runs", "workdir": workdir, "held": mine}, []
    chosen = []
    if want != 0:
        states = device_states(devices, holder.get("op"))
        ahead = ahead_of(holder, states)  # the line's fair order: what each user holds here is read from the states
        free = [s for s in states if s["state"] == "free"]
        out = [s for s in states if s["state"] in ("drained", "unhealthy")]
        if want is None and out or want is not None and len(states) - len(out) < want and devices and devices[0].get("index") is not None:
            # never to be had by waiting: a device out of service (drained, or its health breaks runs)
            return {"busy": True, "what": "unavailable", "want": want, "devices": states, "count": len(states)}, []
        if want is None:
            picked = [s["index"] for s in states] if len(free) == len(states) else None
        elif devices and devices[0].get("index") is None:
            return {"busy": True, "what": "no-gpus", "want": want}, []
        else:
            picked = pick([s["index"] for s in free], want, links)
        if picked is None or ahead:
            return {"busy": True, "what": "devices", "want": want, "devices": states, "ahead": ahead, "count": len(states)}, []
        chosen = [s for s in states if s["index"] in picked]
    fds, took_over, paths = [], [], []
    try:
        names = [(device_name(s), {"device": {"index": s["index"], "uuid": s.get("uuid"), "name": s.get("name")}}) for s in chosen]
        if workdir:
            names.append((work_name(workdir), {"workdir": workdir}))
        for name, extra in names:
            fd, previous = _take_file(name, holder, extra)
            if fd is None:  # held after all (a keeper sharing it without the critical section): let go of the rest
                for other in fds:
                    os.close(other)
                return {"busy": True, "what": "devices", "want": want, "devices": device_states(devices, holder.get("op")), "ahead": []}, []
            fds.append(fd)
            paths.append(os.path.join(lease_dir(), name))
            if previous:
                took_over.append(previous)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    taken = [dict({"index": s["index"], "uuid": s.get("uuid"), "name": s.get("name")}, **({"bus_id": s["bus_id"]} if s.get("bus_id") else {}))
             for s in chosen]  # a GPU's bus too: who it is, whatever its index becomes (mnft.run.recover.new_xids)
    return {"taken": True, "devices": taken, "count": len(devices), "paths": paths, "took_over": took_over[0] if took_over else None}, fds


def take(holder, devices=None, links=None):
    """(reply, fds): the lease taken (each fd keeps its shared flock) or who holds it (no fds). A holder with a
    "scope" takes devices and a workdir (take_devices, with the devices read before); without one, the host."""
    mutex = _lock_mutex()
    try:
        with _one_look():
            if holder.get("scope") is not None:
                return take_devices(holder, devices or [], links or {})
            return _take_host(holder)
    finally:
        os.close(mutex)


def _take_host(holder):
    path = lease_path()
    fd = open_shared(path, True, LEASE_MODE)
    try:
        previous = _read(fd)
        if not _free(fd, previous, holder.get("op")):
            if previous and previous.get("op") == holder.get("op"):  # the same operation through another name
                fcntl.flock(fd, fcntl.LOCK_SH)
                return {"taken": True, "shared": True, "path": path, "paths": [path]}, [fd]
            os.close(fd)
            alive = run_processes(_text(previous, "run_id"))
            same = isinstance(previous, dict) and previous.get("uid") == os.getuid()
            return {"busy": True, "holder": previous, "run_processes": len(alive), "same_login": same, "path": path}, []
        runs = held_leases(op=holder.get("op"))
        if runs:  # a run holds devices (or a sync a workdir) here: the whole host is not to be changed under it
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return {"busy": True, "what": "runs", "held": [dict(h or {}, file=n, lockers=w) for n, h, w in runs], "path": path}, []
        _check_lease(fd, path)
    except BaseException:
        os.close(fd)
        raise
    took_over = previous if previous and not previous.get("released") else None
    _write(fd, dict(holder, taken=time.time(), **_login()))
    fcntl.flock(fd, fcntl.LOCK_SH)  # others may share it (a run's keeper), nobody may take it
    return {"taken": True, "took_over": took_over, "path": path, "paths": [path]}, [fd]


def release(fd, holder):
    """Let go of the lease; marked released only if nobody else holds it (a detached run's keeper may)."""
    try:
        mutex = _lock_mutex()
    except (OSError, Refused):
        os.close(fd)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            current = _read(fd)
            if current and current.get("op") == holder.get("op"):
                _write(fd, dict(current, released=time.time()))
                os.close(fd)
                return current  # the last holder let go: the lease ended (its usage line is this one's to write)
        except BlockingIOError:
            pass
        os.close(fd)
    finally:
        os.close(mutex)
    return None


def progress_numbers(seen):
    """A run's last step ({"step", "loss", "at"}) as numbers only, nothing a reader could take for text, or None:
    what the controller tells, what the host writes into a lease, and what a reader takes from one (anyone may write
    a lease file)."""
    if not isinstance(seen, dict):
        return None
    out = {}
    for key in ("step", "loss", "at"):
        value = seen.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e15:  # NaN fails the test too
            out[key] = int(value) if key == "step" else float(value)
    return out if "step" in out or "loss" in out else None


def progress_of(raw):
    """The `progress {…}` a controller sent on its lease's channel, as progress_numbers, or None."""
    try:
        return progress_numbers(json.loads(raw.decode("utf-8")))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def note_progress(fds, progress):
    """The run's last step written into its lease files (in place, as the keeper's idle marks are: a reader never
    finds one empty): the lab's other members see how far a run is (mnft lab --json, the board), never more than
    these numbers."""
    for fd in fds:
        update_in_place(fd, {"progress": progress})


def show():
    """Who holds the lease now: {"held": bool, "holder": {...} or None, "path": ...}."""
    path = lease_path()
    if not os.path.lexists(path):
        return {"held": False, "holder": None, "path": path}
    mutex = _lock_mutex()
    try:
        fd = open_shared(path, False, LEASE_MODE)
        try:
            holder = _read(fd)
            free = _free(fd, holder)
            return {"held": not free, "holder": holder, "path": path}
        finally:
            os.close(fd)
    finally:
        os.close(mutex)


def lab():
    """The host as `mnft lab` shows it: the host's lease, each device with its state (free, held by whom as the
    lease names it and as /proc/locks proves it, in use outside mnft), the workdirs held, the line of waiting runs in
    its fair order (each ticket's "fair": {"over_limit", "held", "holds"}: mnft.onhost.line.placed) and the lab's rules here
    ("policy": mnft.onhost.labpolicy.lab_policy's)."""
    out = {"host": os.uname()[1], "now": time.time()}
    try:
        devices, _ = read_devices()
    except OSError as exc:
        devices, out["devices_error"] = [], str(exc)
    out.update(show())
    mutex = _lock_mutex()
    try:
        if out.get("held"):
            fd = _existing(LEASE_NAME)
            if fd is not None:
                out["lockers"] = lockers(fd)
                os.close(fd)
        with _one_look():
            out["devices"] = device_states(devices)
            out["drain"], problem = drain_marks()
            if problem:
                out["drain_problem"] = problem
            out["workdirs"] = [dict(h or {}, lockers=w) for n, h, w in held_leases((WORK_PREFIX,))]
            out["policy"] = lab_policy()
            out["line"] = placed([h for _, h in tickets()], out["devices"], out["policy"])
            for device in out["devices"]:
                if device.get("state") == "held" and device.get("processes"):
                    device["collisions"] = collisions(device)
                holder = device.get("holder") if device.get("state") == "held" else None
                if isinstance(holder, dict) and holder.get("wait"):  # taken by a run that waited in line: started here yet?
                    device["run_started"] = bool(run_processes(_text(holder, "run_id")))
    finally:
        os.close(mutex)
    return out


def run_dirs(run_id):
    """The run directories of the keepers holding the run's leases here (a keeper works in its run directory):
    those processes are the run's (their environment carries its id), found through /proc/locks, not by name."""
    found = []
    for name, holder, who in held_leases((DEVICE_PREFIX, WORK_PREFIX, LEASE_NAME[:-5])):
        named = _text(holder, "run_id")
        if not named or not (run_id == named or run_id.startswith(named + "-a")):
            continue
        for locker in who:
            pid = int(locker.rsplit(" ", 1)[1])
            if not any(e.startswith((RUN_ID_VAR + "=" + named).encode()) for e in _environ(pid)):
                continue
            try:
                cwd = os.readlink("/proc/%d/cwd" % pid)
            except OSError:
                continue
            if os.path.isfile(os.path.join(cwd, "spec.json")) and cwd not in found:
                found.append(cwd)
    return found
