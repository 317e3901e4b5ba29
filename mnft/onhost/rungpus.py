"""What nvidia-smi says of this host's GPUs, for the run agent (mnft.onhost.agent): which processes hold them (a stop's
report), how busy they are (a run's samples, the idle watch), which compute process is on which of them (the
collision watch). Standard library only.
"""

import os


def parse_compute_apps(text):
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` -> [{pid, memory_mib}]."""
    apps = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if not parts or not parts[0].isdigit():
            continue
        memory = parts[1] if len(parts) > 1 else ""
        apps.append({"pid": int(parts[0]), "memory_mib": int(memory) if memory.isdigit() else None})
    return apps


def gpu_apps():
    """The processes holding a GPU on this host ([] without nvidia-smi), or None if nvidia-smi failed."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001
        return None
    return parse_compute_apps(done.stdout) if done.returncode == 0 else None


def gpu_report(apps, run_pids_seen, owner=None):
    """Split GPU holders into the run's (a failed stop) and this user's others (a warning: a leftover keeps GPUs
    from the next run). Another user's processes are their work on a shared host, not this stop's business."""
    if apps is None:
        return {"gpus_held": [], "gpus_other": [], "gpu_error": "nvidia-smi failed"}
    mine = set(run_pids_seen)
    owner = owner or _uid_of

    def show(app):
        return "pid %d (%s MiB)" % (app["pid"], app["memory_mib"] if app["memory_mib"] is not None else "?")

    return {
        "gpus_held": [show(a) for a in apps if a["pid"] in mine],
        "gpus_other": [show(a) for a in apps if a["pid"] not in mine and owner(a["pid"]) == os.getuid()],
    }


def _uid_of(pid):
    try:
        return os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None


def parse_gpu_util(text):
    """`nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits` -> [{index, util, mem_mib}]."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            try:
                out.append({"index": int(parts[0]), "util": float(parts[1]), "mem_mib": float(parts[2])})
            except ValueError:
                continue
    return out


def gpu_util():
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=5)
    except Exception:  # noqa: BLE001
        return []
    return parse_gpu_util(done.stdout) if done.returncode == 0 else []


def parse_gpu_buses(text):
    """`nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader` -> {bus id (upper case): index}."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            out[parts[1].upper()] = int(parts[0])
    return out


def parse_bus_apps(text):
    """`nvidia-smi --query-compute-apps=gpu_bus_id,pid --format=csv,noheader` -> [(bus id, pid)]."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].isdigit():
            out.append((parts[0].upper(), int(parts[1])))
    return out


def _smi(query):
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return ""
    try:
        done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=5)
    except Exception:  # noqa: BLE001
        return ""
    return done.stdout if done.returncode == 0 else ""


def gpu_processes():
    """[(GPU index, pid)] of every compute process on this host's GPUs ([] when nvidia-smi cannot tell)."""
    buses = parse_gpu_buses(_smi("--query-gpu=index,pci.bus_id"))
    return [(buses[bus], pid) for bus, pid in parse_bus_apps(_smi("--query-compute-apps=gpu_bus_id,pid")) if bus in buses]


def _user_of(pid):
    import pwd

    try:
        uid = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
