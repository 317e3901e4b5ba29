"""The GPUs' health: read (nvidia-smi's GPU_READ, the kernel log's Xids, this boot's earlier looks) and judged
(health_problems, broken), so that every reader says the same words; see the comment below. Standard library only,
Python 3.8 syntax.
"""

import json
import os
import time

from .gpucache import boot_id, save_private
from .leasefiles import MAX_LEASE_BYTES
from .smi import LOST_EXIT, LOST_MARK, _number, run_bounded

# ------------------------------------------------------------------------------------------------ GPU health
# What a GPU server gets wrong, read once per look (mnft lab, a take of devices) and judged here, so that the host
# never leases a GPU that breaks runs and every reader (lab, check, the board, refusals) says the same:
#   the devices and their health from one `nvidia-smi --query-gpu=GPU_READ` (or NVML, where the host has the
#   driver's library: read_nvml), every read bounded by SMI_TIMEOUT and a hung one named (StalledRead);
#   a GPU fallen off the bus ("Unable to determine the device handle for GPU …", exit 15) kept in its place, lost;
#   a GPU seen earlier this boot and gone from the list (this user's record of the boot: seen_path);
#   Xid errors since boot from the kernel log, wherever this user may read it (kernellog.read_xids).
# Judged by health_problems (pure): "broken" (never leased: lost, gone, uncorrectable ECC since boot, a pending
# retirement or row remap, a failed remap, an Xid NVIDIA documents as needing a reset) or "warning" (throttled,
# persistence off, MIG on, an Xid of the application's kind, ECC errors of the GPU's past).

GPU_READ = ("index,uuid,pci.bus_id,memory.total,memory.used,utilization.gpu,persistence_mode,mig.mode.current,"
            "ecc.errors.uncorrected.volatile.total,ecc.errors.uncorrected.aggregate.total,retired_pages.pending,"
            "remapped_rows.pending,remapped_rows.failure,clocks_throttle_reasons.hw_slowdown,"
            "clocks_throttle_reasons.hw_thermal_slowdown,clocks_throttle_reasons.sw_thermal_slowdown,"
            "clocks_throttle_reasons.hw_power_brake_slowdown,name")
GPU_READ_BASIC = "index,uuid,pci.bus_id,memory.total,memory.used,utilization.gpu,name"  # a driver that lacks a field above
THROTTLES = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown")
THROTTLE_NAMES = {"hw_slowdown": "HW slowdown", "hw_thermal_slowdown": "HW thermal slowdown",
                  "sw_thermal_slowdown": "SW thermal slowdown", "hw_power_brake_slowdown": "power brake"}
# Xids NVIDIA's catalogue says need the GPU reset (or the host rebooted); the rest are the application's or passing
RESET_XIDS = {48: "double-bit ECC error", 62: "internal micro-controller halt", 64: "row remapping failure",
              74: "NVLink error", 79: "fallen off the bus", 92: "high single-bit ECC error rate", 95: "uncontained ECC error",
              109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error", 140: "unrecovered ECC error"}
RESET_FIX = "drain it (mnft drain HOST:GPU --reason …) and reset it (nvidia-smi -r -i GPU, with nothing on it) or reboot the host"


def bus_key(bus_id):
    """"00000000:3B:00.0" (nvidia-smi), "0000:3b:00" (the kernel's Xid line) -> "3b:00": the same GPU."""
    parts = str(bus_id or "").lower().split(".")[0].split(":")
    return ":".join(p.lstrip("0").rjust(2, "0") for p in parts[-2:]) if len(parts) >= 2 else None


def _value(text):
    """One cell of nvidia-smi's csv,nounits: an int, True/False for Enabled/Yes/Active, None for [N/A]."""
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "Not Supported"):
        return None
    if text in ("Enabled", "Yes", "Active"):
        return True
    if text in ("Disabled", "No", "Not Active"):
        return False
    number = _number(text)
    return number if number is not None else text


def bus_order(bus_id):
    """A sort key of a PCI bus id ("00000000:3B:00.0", "0000:3b:00.0"): (domain, bus, device, function), the order
    in which the driver numbers its GPUs (nvidia-smi's indices; CUDA's under CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    parts = str(bus_id or "").replace(".", ":").split(":")
    try:
        return tuple(int(p, 16) for p in parts[-4:])
    except ValueError:
        return (1 << 32,)


def parse_lost(line):
    """(index or None, bus id) a handle error names: "… for GPU 0000:AB:00.0: Unknown Error" (the bus id only) or
    the newer drivers' "… for GPU3: 0000:5D:00.0: Unknown Error" (its index too)."""
    import re

    match = re.search(re.escape(LOST_MARK) + r"\s*GPU\s*(?:(\d+):\s+)?([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-9A-Fa-f])?)", line)
    if not match:
        return None, None
    return (int(match.group(1)) if match.group(1) else None), match.group(2)


def place_lost(found):
    """Give each lost GPU its index: the one its line names, else by its bus id, never by where its line came (the
    real tool writes it to stderr, which can arrive before the rows). The driver numbers its GPUs in bus order, so
    the indices the rows do not hold go to the lost GPUs in bus order; a lost GPU that cannot be placed so (its
    bus unknown, or GPUs gone beside it) is placed by its bus among all of them."""
    lost = [d for d in found if d["index"] is None]
    if not lost:
        return found
    held = set(d["index"] for d in found if d["index"] is not None)
    lost.sort(key=lambda d: bus_order(d.get("bus_id")))
    free = [i for i in range(len(found)) if i not in held]
    if len(free) == len(lost):
        for device, index in zip(lost, free):
            device["index"] = index
    else:
        ranked = sorted(found, key=lambda d: bus_order(d.get("bus_id")))
        for device in lost:
            index = next(n for n, d in enumerate(ranked) if d is device)
            while index in held:
                index += 1
            device["index"] = index
            held.add(index)
    return found


def parse_gpu_read(text, query=GPU_READ):
    """nvidia-smi --query-gpu=GPU_READ --format=csv,noheader,nounits (stdout and stderr together): one dict per
    device, a lost one ({"health": {"lost": its line}}) at the index its line or its bus id gives it (place_lost)."""
    fields = query.split(",")
    found = []
    for line in text.splitlines():
        if LOST_MARK in line:
            index, bus = parse_lost(line)
            found.append({"index": index, "uuid": None, "name": None, "bus_id": bus, "processes": [], "health": {"lost": line.strip()[:300]}})
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < len(fields) or _number(parts[0]) is None:
            continue
        cells = dict(zip(fields[:-1], parts[:len(fields) - 1]))
        name = ", ".join(parts[len(fields) - 1:])
        health = {"persistence": _value(cells.get("persistence_mode", "")), "mig": _value(cells.get("mig.mode.current", "")),
                  "ecc_volatile": _value(cells.get("ecc.errors.uncorrected.volatile.total", "")),
                  "ecc_aggregate": _value(cells.get("ecc.errors.uncorrected.aggregate.total", "")),
                  "retired_pending": _value(cells.get("retired_pages.pending", "")),
                  "remap_pending": _value(cells.get("remapped_rows.pending", "")),
                  "remap_failed": _value(cells.get("remapped_rows.failure", "")),
                  "throttle": [t for t in THROTTLES if _value(cells.get("clocks_throttle_reasons." + t, "")) is True]}
        found.append({"index": _number(parts[0]), "uuid": parts[1], "name": name, "bus_id": parts[2],
                      "memory_total_mib": _number(parts[3]), "memory_used_mib": _number(parts[4]), "utilization": _number(parts[5]),
                      "processes": [], "health": dict((k, v) for k, v in health.items() if v is not None)})
    return sorted(place_lost(found), key=lambda d: d["index"])


def smi_gpus(exe, seconds=None):
    """The devices and their health through nvidia-smi; OSError when it fails for another reason than a lost GPU."""
    code, out = run_bounded([exe, "--query-gpu=" + GPU_READ, "--format=csv,noheader,nounits"], seconds)
    query = GPU_READ
    if code == 2 and "is not a valid field" in out:  # an older driver: the devices without their health
        code, out = run_bounded([exe, "--query-gpu=" + GPU_READ_BASIC, "--format=csv,noheader,nounits"], seconds)
        query = GPU_READ_BASIC
    if code not in (0, LOST_EXIT) or code == LOST_EXIT and LOST_MARK not in out:
        raise OSError("nvidia-smi exited %d: %s" % (code, " ".join(out.split())[:300]))
    return parse_gpu_read(out, query)


def seen_path():
    """This user's record of the GPUs the host had at its last look this boot (by UUID): a GPU gone since is seen."""
    boot = boot_id()
    return os.path.expanduser("~/.cache/mnft/gpus-seen-%s.json" % boot) if boot else None


def remember_seen(devices):
    """{uuid: device} of this boot's earlier looks, updated with this one's (best effort)."""
    path = seen_path()
    if path is None:
        return {}
    try:
        with open(path) as fh:
            seen = json.loads(fh.read(MAX_LEASE_BYTES))
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    before = dict(seen)
    for d in devices:
        if d.get("uuid"):
            seen[d["uuid"]] = {"index": d.get("index"), "bus_id": d.get("bus_id"), "name": d.get("name")}
    if seen != before:
        save_private(path, seen)
    return before


def add_health(devices, xids, kmsg_error=None, seen=None):
    """The devices of one read with what the host knows beside them: each GPU's Xids (by its bus), a lost GPU's
    UUID and name from this boot's earlier looks, and a GPU seen earlier this boot and missing now (gone). A GPU is
    who its UUID and bus say, never its index: when one falls off the bus the driver numbers the rest 0..n-2, so a
    gone GPU has no index now ("index": None, "gone_index": the one it had), and its Xids stay with it (its bus)."""
    seen = seen or {}
    by_bus = dict((bus_key(v.get("bus_id")), (uuid, v)) for uuid, v in seen.items())
    for d in devices:
        health = d.setdefault("health", {})
        if health.get("lost") and not d.get("uuid") and bus_key(d.get("bus_id")) in by_bus:
            uuid, known = by_bus[bus_key(d.get("bus_id"))]
            d.update(uuid=uuid, name=known.get("name"))
        found = xids.get(bus_key(d.get("bus_id"))) or []
        if found:
            health["xids"] = found[-20:]
        if kmsg_error:
            health["kmsg"] = kmsg_error
    present = set(d.get("uuid") for d in devices if d.get("uuid"))
    buses = set(bus_key(d.get("bus_id")) for d in devices if d.get("bus_id"))
    for uuid, known in sorted(seen.items(), key=lambda item: bus_order(item[1].get("bus_id"))):
        if uuid in present or bus_key(known.get("bus_id")) in buses:
            continue
        health = {"gone": True}
        found = xids.get(bus_key(known.get("bus_id"))) or []
        if found:
            health["xids"] = found[-20:]
        devices.append({"index": None, "gone_index": known.get("index"), "uuid": uuid, "name": known.get("name"),
                        "bus_id": known.get("bus_id"), "processes": [], "health": health})
    devices.sort(key=lambda d: (d.get("index") is None, d.get("index") or 0, bus_order(d.get("bus_id"))))
    return devices


def gone(device):
    return bool((device.get("health") or {}).get("gone"))


def device_label(device):
    """"GPU 3", "the host's CPUs", or a GPU gone from the bus by what it was: "the GPU gone from bus 0000:2A:00.0
    (GPU 1 earlier this boot)"."""
    if gone(device):
        was = device.get("gone_index")
        return "the GPU gone from bus %s%s" % (device.get("bus_id") or "?", " (GPU %s earlier this boot)" % was if was is not None else "")
    return "the host's CPUs" if device.get("index") is None else "GPU %s" % device["index"]


def health_problems(device):
    """What is wrong with one GPU, judged from its health: [{"level": "broken"|"warning", "what", "fix"}]. A
    "broken" GPU is never leased (it breaks runs); a warning is said (lab, check) and the GPU still leased."""
    h = device.get("health") or {}
    out = []

    def say(level, what, fix):
        out.append({"level": level, "what": what, "fix": fix})

    if h.get("lost"):
        say("broken", "lost from the bus (%s)" % h["lost"], RESET_FIX)
    if h.get("gone"):
        was = device.get("gone_index")
        say("broken", "gone: the host had it earlier this boot (%s%s, bus %s), nvidia-smi no longer lists it: the GPUs after it "
            "are numbered one lower now" % ("GPU %s, " % was if was is not None else "", device.get("uuid") or "?", device.get("bus_id") or "?"),
            "reboot the host (or reload the driver) once it is mended; drain the host meanwhile if its GPUs' numbers matter to anyone")
    volatile, aggregate = h.get("ecc_volatile"), h.get("ecc_aggregate")
    if isinstance(volatile, int) and volatile > 0:
        say("broken", "%d uncorrectable ECC error(s) since the driver loaded" % volatile, RESET_FIX)
    elif isinstance(aggregate, int) and aggregate > 0:
        say("warning", "%d uncorrectable ECC error(s) in its life (none since boot)" % aggregate,
            "watch it (nvidia-smi -q -d ECC); a count that grows: have it serviced")
    if h.get("remap_failed"):
        say("broken", "row remapping failed", "drain it and have it serviced (RMA): its memory cannot be repaired")
    if h.get("remap_pending") or h.get("retired_pending"):
        say("broken", "a %s is pending" % ("row remap" if h.get("remap_pending") else "page retirement"), RESET_FIX)
    reset = [x for x in h.get("xids") or [] if x.get("xid") in RESET_XIDS]
    if reset:
        x = reset[-1]
        say("broken", "Xid %d (%s) at %s" % (x["xid"], RESET_XIDS[x["xid"]], time.strftime("%H:%M:%S", time.localtime(x.get("at") or 0))), RESET_FIX)
    other = [x for x in h.get("xids") or [] if x.get("xid") not in RESET_XIDS]
    if other:
        say("warning", "Xid %s in the kernel log since boot" % ", ".join(sorted(set(str(x["xid"]) for x in other))),
            "usually the application's fault (a bad address, an illegal instruction): see dmesg; drain it if it recurs")
    if h.get("throttle"):
        say("warning", "clocks throttled (%s): the likely straggler of any gang it joins" % ", ".join(THROTTLE_NAMES.get(t, t) for t in h["throttle"]),
            "check its cooling and power (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER)")
    if h.get("persistence") is False:
        say("warning", "persistence mode off: every CUDA or nvidia-smi start re-initialises the driver (seconds on NVSwitch servers)",
            "nvidia-smi -pm 1, or enable nvidia-persistenced")
    if h.get("mig"):
        say("warning", "MIG mode on: CUDA sees only the MIG instances, a run takes whole GPUs",
            "nvidia-smi -i GPU -mig 0 (and reset it) for whole-GPU runs")
    return out


def broken(device):
    """Why the GPU is never leased (its broken health problems' words, joined), or None."""
    words = [p["what"] for p in health_problems(device) if p["level"] == "broken"]
    return "; ".join(words) or None
