"""The host's GPUs as a take or a look reads them (read_devices, read_health): NVML or nvidia-smi, with their
health and compute processes, their links (`nvidia-smi topo -m`), and which of the free ones a run is given (pick).
Standard library only, Python 3.8 syntax.
"""

import itertools
import os
import time

from .gpucache import load_static, save_static
from .health import add_health, remember_seen, smi_gpus
from .kernellog import read_xids
from .nvml import read_nvml
from .procs import user_name
from .smi import SMI_TIMEOUT, StalledRead, _number, _smi_output, _spawn_smi

SMI_QUERY = "index,uuid,name,memory.total,memory.used,utilization.gpu"
SMI_APPS = "gpu_uuid,pid,used_memory"
MAX_COMBINATIONS = 20000  # device sets weighed for their links; beyond, the lowest free indices


def parse_devices(text):
    """nvidia-smi --query-gpu=SMI_QUERY --format=csv,noheader,nounits: one dict per device."""
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6 or _number(parts[0]) is None:
            continue
        found.append({"index": _number(parts[0]), "uuid": parts[1], "name": ", ".join(parts[2:-3]), "memory_total_mib": _number(parts[-3]),
                      "memory_used_mib": _number(parts[-2]), "utilization": _number(parts[-1]), "processes": []})
    return found


def parse_apps(text):
    """nvidia-smi --query-compute-apps=SMI_APPS: (uuid, pid, used MiB) per compute process."""
    found = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and _number(parts[1]) is not None:
            found.append((parts[0], _number(parts[1]), _number(parts[2])))
    return found


LINKS = (("NV", 100), ("PIX", 50), ("PXB", 40), ("PHB", 30), ("NODE", 20), ("SYS", 10))


def link_score(word):
    """How fast a link of `nvidia-smi topo -m` is, higher faster: NV<n> (n bonded NVLinks) > PIX > PXB > PHB > NODE > SYS."""
    word = word.strip()
    if word.startswith("NV") and word[2:].isdigit():
        return 100 + int(word[2:])
    return dict(LINKS[1:]).get(word, 0)


def parse_topology(text):
    """{(i, j): score} for every pair of GPUs `nvidia-smi topo -m` prints a link for."""
    links, columns = {}, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("\t")]
        if columns is None:
            if any(c.startswith("GPU") for c in cells):
                columns = [int(c[3:]) if c.startswith("GPU") and c[3:].isdigit() else None for c in cells]
            continue
        if not cells or not cells[0].startswith("GPU") or not cells[0][3:].isdigit():
            if cells and cells[0].startswith("Legend"):
                break
            continue
        row = int(cells[0][3:])
        for column, cell in zip(columns[1:], cells[1:]):
            if column is not None and column != row:
                links[(row, column)] = link_score(cell)
    return links


def pick(free, want, links):
    """The `want` devices of `free` (indices) whose slowest link between two of them is fastest (then the fastest
    links in all, then the lowest indices): two GPUs of one NVLink pair rather than two across sockets. None when
    fewer are free."""
    free = sorted(free)
    if want > len(free):
        return None
    if want <= 1 or want == len(free) or not links:
        return free[:want]
    best = None
    for n, combo in enumerate(itertools.combinations(free, want)):
        if n >= MAX_COMBINATIONS:
            break
        scores = [links.get((a, b), links.get((b, a), 0)) for a, b in itertools.combinations(combo, 2)]
        key = (min(scores), sum(scores))
        if best is None or key > best[0]:
            best = (key, list(combo))
    return best[1]


IDLE_MIB = 0  # memory.used of a GPU no process uses: a compute process's CUDA context alone takes tens of MiB or more


def may_have_processes(devices):
    """Whether `nvidia-smi --query-compute-apps` may list anything, from the devices just read: some GPU in service
    reports memory in use (above IDLE_MIB), or no memory figure, or runs MIG (its slices' use is theirs). False only
    when every answering GPU says 0 MiB used: no process has a context on any of them, so the question is not asked
    (a lost GPU is not asked about either way: nvidia-smi cannot reach it)."""
    for d in devices:
        h = d.get("health") or {}
        if h.get("lost"):
            continue
        used = d.get("memory_used_mib")
        if not isinstance(used, int) or isinstance(used, bool) or used > IDLE_MIB or h.get("mig"):
            return True
    return False


def _process_owner(pid):
    try:
        return user_name(os.stat("/proc/%d" % pid).st_uid)
    except OSError:
        return None


def cache_fits(cached, devices):
    """Whether this user's cache of the boot's GPUs and links (load_static) knows every GPU in service now, each at
    the index it has now: a GPU that was lost when the cache was written and is back, or GPUs renumbered since one
    fell off the bus, are not in it, and their links would be read as none (an NVLink pair passed over)."""
    known = set((d.get("index"), d.get("uuid")) for d in cached.get("devices") or [])
    return all((d.get("index"), d.get("uuid")) in known for d in devices
               if d.get("uuid") and d.get("index") is not None and not (d.get("health") or {}).get("lost"))


def read_devices(topology=False, live=True):
    """(devices, links): the host's GPUs (index, uuid, name, bus id, memory, utilisation, their health: see "GPU
    health" below, and the compute processes on each: pid, user, MiB), and their links when asked; ([{"index":
    None, "name": "cpu"}], {}) on a host without nvidia-smi (its CPUs are one device). OSError when the GPUs do
    not answer (StalledRead: not within SMI_TIMEOUT).

    Through NVML where the driver's library is there (no process at all), else nvidia-smi: the devices and their
    health, then the compute processes only when some GPU may have one (may_have_processes: on a host whose GPUs
    are all idle, one nvidia-smi instead of two). The links (`nvidia-smi topo -m`) do not change
    while the machine is up: kept per boot and nvidia-smi in the user's cache (load_static, save_static) by a take
    (live=False), which asks them the first time, and again whenever a GPU in service is one the cache does not
    know at its index (cache_fits)."""
    import shutil

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [{"index": None, "uuid": None, "name": "cpu", "processes": []}], {}
    fmt = "--format=csv,noheader,nounits"
    cached = load_static(exe) if topology or not live else None
    devices, how = None, "nvidia-smi"
    if os.environ.get("MNFT_NVML", "1") != "0":
        try:
            devices, how = read_nvml(), "nvml"
        except StalledRead:
            raise
        except (OSError, AttributeError):
            devices = None  # no libnvidia-ml here, or one that fails: nvidia-smi answers
    topo = (topology or not live) and cached is None  # a take asks the links too, to cache them
    deadline = time.time() + SMI_TIMEOUT
    procs = [_spawn_smi([exe, "topo", "-m"])] if topo else []
    apps = topo_text = ""
    try:
        if devices is None:
            devices = smi_gpus(exe)
            if may_have_processes(devices):  # the compute processes, within what is left of the same bound
                procs.append(_spawn_smi([exe, "--query-compute-apps=" + SMI_APPS, fmt]))
                apps = _smi_output(procs[-1], deadline)
        if cached is not None and not cache_fits(cached, devices):  # a GPU the cache does not know: asked afresh
            cached, topo = None, True
            procs.insert(0, _spawn_smi([exe, "topo", "-m"]))
        if topo:
            topo_text = _smi_output(procs[0], deadline)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if how == "nvml":
        for d in devices:
            d["processes"] = [{"pid": pid, "user": _process_owner(pid), "used_mib": mib} for pid, mib in d.get("processes") or []]
    else:
        by_uuid = dict((d["uuid"], d) for d in devices if d.get("uuid"))
        for uuid, pid, mib in parse_apps(apps):
            if uuid in by_uuid:
                by_uuid[uuid]["processes"].append({"pid": pid, "user": _process_owner(pid), "used_mib": mib})
    if cached is not None:
        links = dict(((a, b), score) for a, b, score in cached["links"])
    else:
        links = parse_topology(topo_text) if (topology or not live) else {}
        if not live or topology:
            save_static(exe, [d for d in devices if d.get("uuid")], links)
    xids, why = read_xids()
    for d in devices:
        d["read"] = how
    devices = add_health(devices, xids, why, remember_seen(devices))
    return devices, (links if topology else {})


def read_health(exe, seconds=None):
    """The host's GPUs with their health, as one look reads them: NVML where the driver's library is there, else
    nvidia-smi; the kernel log's Xids; this boot's earlier looks. OSError (StalledRead) when the GPUs did not answer."""
    devices, how = None, "nvidia-smi"
    if os.environ.get("MNFT_NVML", "1") != "0":
        try:
            devices, how = read_nvml(seconds), "nvml"
        except StalledRead:
            raise
        except (OSError, AttributeError):
            devices = None  # no libnvidia-ml here, or an older one: nvidia-smi reads them
    if devices is None:
        if exe is None:
            raise OSError("no nvidia-smi")
        devices = smi_gpus(exe, seconds)
    xids, why = read_xids()
    seen = remember_seen(devices)
    for d in devices:
        d["read"] = how
    return add_health(devices, xids, why, seen)
