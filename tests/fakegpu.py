#!/usr/bin/python3
"""A stand-in for `nvidia-smi` on the simulated cluster's hosts (`Cluster.create(..., gpus=N)` in tests/testbed.py):
GPUs that are not there, answering the way the real nvidia-smi formats its answers, so that the suite can test GPU
servers shared between users (device leases, who uses which GPU) on a machine without any.

One file, standard library only, run by Debian's /usr/bin/python3 as any user. Its state is the host's
STATE_DIR (/run/mnft-fake-gpu, the host's private /run; MNFT_FAKE_GPU_DIR overrides it for unit tests):

    config.json         written by the test bed: {"count": 4, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                        "driver": "550.54.15", "cuda": "12.4", "links": [[0, 1, "NV18"], [2, 3, "NV18"]]}
                        (pairs not listed are "SYS"); `default_config(count)` makes it. What a GPU server gets
                        wrong, each optional (keys are device indices, as strings in JSON):
                          "lost": [0]                  fallen off the bus, still enumerated: every query prints
                                                       "Unable to determine the device handle for GPU 0000:18:00.0:
                                                       Unknown Error" on stderr, before the rows (the real tool's
                                                       stderr is unbuffered, its rows are written at exit), and
                                                       exits 15; `topo -m` answers without it
                          "lost_spelling": "index"     the newer drivers' line, naming the index too: "… for
                                                       GPU0: 0000:18:00.0: Unknown Error" (default "bus")
                          "lost_where": "inline"       the line on stdout in the device's place instead
                          "lost_exit": 0               --query-gpu's exit status with a lost GPU (default 15: the
                                                       real tool's is not settled, mnft accepts both)
                          "gone": [1]                  fallen off the bus and no longer enumerated (the driver
                                                       reloaded without it): not listed at all, and the devices
                                                       after it renumbered 0..n-2, as the real driver does. Keys
                                                       of this config (and the used/ registries) stay the slots:
                                                       the indices the devices had with none gone
                          "ecc": {"1": [2, 5]}         uncorrectable ECC errors, volatile and aggregate
                          "remap": {"1": ["Yes", "No"]}  remapped rows pending, failed
                          "retired_pending": [1]       retired pages pending
                          "throttle": {"2": ["hw_thermal_slowdown", …]}  clock throttle reasons active
                          "persistence": false         persistence mode off (with "stall": the driver's start)
                          "stall": 15                  every query answers only after that many seconds
                          "latency_ms": 40             every query takes that long (a real 8-GPU host's driver)
                          "mig": [3]                   MIG mode on
    util/<index>        (optional) the utilization.gpu device <index> reports, whoever uses it (`set_utilization`):
                        a test's idle or busy GPU
    used/<index>/<pid>  a process uses device <index> while this file exists, holds "<starttime> <used_mib>"
                        (starttime: field 22 of /proc/<pid>/stat, so a reused pid is not counted) and that pid is
                        alive and not a zombie. The directories are mode 1777: every user can register; a stale
                        file is ignored (and removed when the caller may remove it)

Without STATE_DIR/config.json it answers as nvidia-smi does on a host whose driver is not loaded (exit 9).

Answers: `--query-gpu=FIELDS` and `--query-compute-apps=FIELDS` with `--format=csv[,noheader][,nounits]` (and
`-i/--id`), `topo -m`, `-L`, `--version`, `-h`, and no argument at all (the banner and its table). Anything else
exits 2 with a message on stderr, as the real one refuses an invalid combination of arguments.

Test-only parts:

    nvidia-smi --fake-xid INDEX CODE
        writes the kernel's Xid line for that device ("NVRM: Xid (PCI:0000:18:00): 79, pid=…, GPU has fallen off
        the bus.") to /dev/kmsg, only where /dev/kmsg is a regular file (the test bed binds one there in each host:
        the real kernel log is never written); FAKE_KMSG_ENV names another file for unit tests.

    nvidia-smi --fake-use 1[,2…] [--mib N] -- COMMAND ARGS…
        registers its own pid on those devices, then execs COMMAND (which keeps the pid): "someone ran python by
        hand on GPU 1", as `nvidia-smi` shows it, using N MiB (default 1024; at least 1: a CUDA context takes
        memory, and mnft asks for the processes only when some GPU has memory in use).
    RANK_SNIPPET
        Python source (standard library only) for a test's training script, at its top level: a torchrun worker
        registers itself on device CUDA_VISIBLE_DEVICES.split(",")[LOCAL_RANK] (indices, as mnft sets them; every
        device when the variable is unset, none when it is empty; a device the host lacks ends the worker as CUDA's
        "invalid device ordinal" would) and prints one line "mnft-test: rank R local L sees CUDA_VISIBLE_DEVICES=…"
        (R: $RANK; "(unset)" when unset). Where STATE_DIR does not exist it only prints. It leaves no name behind.
"""

from __future__ import annotations

import os
import sys
import time

# A real nvidia-smi's time is the driver's (latency_ms below: a sleep), not CPU on the host's cores. So that the
# stand-in's own work stays small, the test bed runs it from bytecode compiled once (STUB), under `python3 -S`,
# and it imports neither json nor hashlib (their `re`, `enum` and OpenSSL were 13 of its 26 ms of CPU per
# question): config.json is read with json's own C scanner (parse_json), the UUIDs hashed with the built-in sha256.

STATE_DIR = "/run/mnft-fake-gpu"
STATE_ENV = "MNFT_FAKE_GPU_DIR"
DEFAULT_MIB = 1024  # what --fake-use and RANK_SNIPPET register when not told otherwise
BUSY_UTILIZATION = 97  # utilization.gpu of a device someone uses (0 otherwise)
USAGE_EXIT = 2  # an invalid combination of arguments, as the real one
LOST_EXIT = 15  # "GPU has fallen off the bus or has otherwise become inaccessible"
KMSG, FAKE_KMSG_ENV = "/dev/kmsg", "MNFT_FAKE_KMSG"
XID_TEXT = {13: "Graphics Engine Exception", 31: "MMU Fault", 48: "DBE (Double Bit Error) ECC Error",
            63: "ECC page retirement or row remapping recording event", 64: "ECC page retirement or row remapper recording failure",
            74: "NVLink Error", 79: "GPU has fallen off the bus.", 94: "Contained ECC error", 95: "Uncontained ECC error",
            119: "Timeout after 6s of waiting for RPC response from GPU0 GSP!"}
NO_DRIVER_EXIT = 9  # "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
INVALID = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
             "NVIDIA driver is installed and running.")
# DGX H100's bus ids; a device beyond them gets a made-up one of the same form
BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")


class Refused(Exception):
    """A request the real nvidia-smi refuses: the message goes to stderr, the exit status is `code`."""

    def __init__(self, message: str, code: int = USAGE_EXIT):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------------- the devices


def default_config(count: int) -> dict:
    """config.json of a host with `count` H100s, NVLinked in consecutive pairs (0-1, 2-3, …): what the test bed writes."""
    return {"count": count, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "driver": "550.54.15", "cuda": "12.4",
            "links": [[i, i + 1, "NV18"] for i in range(0, count - 1, 2)]}


def state_dir() -> str:
    return os.environ.get(STATE_ENV) or STATE_DIR


def parse_json(text: str):
    """json.loads(text), through the C scanner the json module itself uses (importing json costs this stand-in 9 ms
    of CPU per question); json.loads where that scanner is not there. ValueError for anything that is not JSON."""
    try:
        from _json import make_scanner
    except ImportError:
        import json

        return json.loads(text)

    class Context:
        strict, object_hook, object_pairs_hook = True, None, None
        parse_float, parse_int, parse_constant, memo = float, int, float, {}

    text = text.strip(" \t\n\r")
    try:
        value, end = make_scanner(Context())(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return value


def _sha256(data: bytes):
    """hashlib.sha256 without hashlib's OpenSSL (4 ms of CPU per question): the interpreter's built-in one."""
    for name in ("_sha256", "_sha2"):  # 3.11's name, 3.12's
        try:
            return __import__(name).sha256(data)
        except (ImportError, AttributeError):
            pass
    import hashlib

    return hashlib.sha256(data)


def load_config(state: str) -> dict | None:
    """The host's config.json with its defaults filled in, or None when the host has no (fake) driver."""
    try:
        with open(os.path.join(state, "config.json"), encoding="utf-8") as f:
            given = parse_json(f.read())
    except (OSError, ValueError):
        return None
    config = default_config(int(given.get("count", 0)))
    config.update(given)
    return config


def gpu_uuid(hostname: str, index: int) -> str:
    """The device's UUID, the same every time for one host and index: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    h = _sha256(("%s:%d" % (hostname, index)).encode()).hexdigest()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:32])


def bus_id(index: int) -> str:
    bus = BUS_IDS[index] if index < len(BUS_IDS) else "%02X" % (0x18 + 0x10 * index % 0xE0)
    return "00000000:%s:00.0" % bus


def link(config: dict, a: int, b: int) -> str:
    """What `topo -m` prints between two devices: " X " for itself, the configured link, else SYS."""
    if a == b:
        return " X "
    for x, y, kind in config.get("links", ()):
        if {int(x), int(y)} == {a, b}:
            return str(kind)
    return "SYS"


# --------------------------------------------------------------------------------------------------- who uses them


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (when the process started, in clock ticks), None when the pid is gone or a zombie."""
    try:
        with open("/proc/%d/stat" % pid, encoding="utf-8", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def register(state: str, index: int, pid: int | None = None, mib: int = DEFAULT_MIB) -> str:
    """Record that `pid` (default: this process) uses device `index`; returns the file. Written whole, then renamed
    into place, so a reader never sees it half written."""
    pid = os.getpid() if pid is None else pid
    began = start_time(pid)
    if began is None:
        raise Refused("no such process: %d" % pid)
    directory = os.path.join(state, "used", str(index))
    path = os.path.join(directory, str(pid))
    partial = os.path.join(directory, ".%d.%d" % (pid, os.getpid()))
    with open(partial, "w", encoding="utf-8") as f:
        f.write("%d %d\n" % (began, mib))
    try:
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    except OSError:
        os.unlink(partial)
        raise
    return path


def set_utilization(state: str, index: int, percent: int | None) -> None:
    """What utilization.gpu says of device `index` from now on, whoever uses it (None: as its use says again)."""
    path = os.path.join(state, "util", str(index))
    if percent is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".partial", "w", encoding="utf-8") as f:
        f.write("%d\n" % percent)
    os.replace(path + ".partial", path)


def uses(state: str, count: int) -> dict[int, list[tuple[int, int]]]:
    """{index: [(pid, used MiB), …]} of every device, by pid: only live registrations count. Stale files are
    removed where the caller may (its own, or any for root); the rest are ignored."""
    found: dict[int, list[tuple[int, int]]] = {}
    for index in range(count):
        directory = os.path.join(state, "used", str(index))
        try:
            names = os.listdir(directory)
        except OSError:
            names = []
        live = []
        for name in names:
            if not name.isdigit():
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    began, mib = (int(word) for word in f.read().split())
            except (OSError, ValueError):
                began, mib = None, 0
            if began is not None and start_time(int(name)) == began:
                live.append((int(name), mib))
                continue
            try:
                os.unlink(path)
            except OSError:
                pass  # another user's stale file: ignored all the same
        found[index] = sorted(live)
    return found


def process_name(pid: int) -> str:
    """What nvidia-smi names a process: its executable's path, else its argv[0], else its comm."""
    try:
        return os.readlink("/proc/%d/exe" % pid)
    except OSError:
        pass
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            first = f.read().split(b"\0")[0].decode(errors="replace")
        if first:
            return first
    except OSError:
        pass
    try:
        with open("/proc/%d/comm" % pid, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "[Not Found]"


# --------------------------------------------------------------------------------------------------- queries


class Host:
    """One look at the host: its config, name and who uses which device, read once per invocation."""

    def __init__(self, config: dict, hostname: str, used: dict[int, list[tuple[int, int]]]):
        self.config, self.hostname, self.used = config, hostname, used
        self.count = int(config["count"])
        self.errors: list[str] = []  # what goes to stderr, before the answer

    def lost_out(self, lines: list[str], slot: int) -> None:
        """A lost device's line: on stderr (self.errors, written before the rows), or in its place ("lost_where":
        "inline")."""
        (lines if self.config.get("lost_where") == "inline" else self.errors).append(self.lost_line(slot))

    def used_mib(self, index: int) -> int:
        return sum(mib for _, mib in self.used.get(index, ()))

    def busy(self, index: int) -> bool:
        return bool(self.used.get(index))

    def indices(self, key: str) -> set[int]:
        return {int(i) for i in self.config.get(key) or ()}

    def per(self, key: str, index: int, default):
        return (self.config.get(key) or {}).get(str(index), default)

    def throttled(self, index: int, reason: str) -> str:
        return "Active" if reason in self.per("throttle", index, []) else "Not Active"

    def slots(self) -> list[int]:
        """The devices the driver enumerates, by slot (their indices with none gone): every one but the gone."""
        return [i for i in range(self.count) if i not in self.indices("gone")]

    def index_of(self, slot: int) -> int:
        """The device's index now, as nvidia-smi and CUDA number it: the ones after a gone device one lower."""
        return self.slots().index(slot)

    def slot_of(self, index: int) -> int | None:
        slots = self.slots()
        return slots[index] if 0 <= index < len(slots) else None

    def lost(self) -> list[int]:
        return sorted(i for i in self.indices("lost") if i in self.slots())

    def lost_line(self, slot: int) -> str:
        """What the real nvidia-smi prints for a device that fell off the bus (older drivers name its bus id,
        newer ones its index too)."""
        if self.config.get("lost_spelling") == "index":
            return "Unable to determine the device handle for GPU%d: %s: Unknown Error" % (self.index_of(slot), bus_id(slot)[4:])
        return lost_line(slot)

    def utilization(self, index: int) -> int:
        """util/<index> when a test set it (set_utilization), else BUSY_UTILIZATION while a process uses it, else 0."""
        try:
            with open(os.path.join(state_dir(), "util", str(index)), encoding="utf-8") as f:
                return max(0, min(100, int(f.read().strip())))
        except (OSError, ValueError):
            return BUSY_UTILIZATION if self.busy(index) else 0


# nvmlClocksThrottleReasons bits
THROTTLE_BITS = {"gpu_idle": 0x1, "applications_clocks_setting": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sync_boost": 0x10,
                 "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80}


def lost_line(index: int) -> str:
    """What the real nvidia-smi prints in place of a device that fell off the bus."""
    return "Unable to determine the device handle for GPU %s: Unknown Error" % bus_id(index)[4:]


def write_xid(index: int, code: int, path: str | None = None) -> str:
    """Append the kernel's Xid line for device `index` to the kernel log stand-in (a regular file only); returns it."""
    path = path or os.environ.get(FAKE_KMSG_ENV) or KMSG
    try:
        st = os.stat(path)
    except OSError:
        st = None
    import stat as stat_

    if st is None or not stat_.S_ISREG(st.st_mode):
        raise Refused("--fake-xid: %s is not a stand-in kernel log (a regular file): the real kernel log is never written" % path)
    with open("/proc/uptime", encoding="utf-8") as f:
        usec = int(float(f.read().split()[0]) * 1e6)
    pci = bus_id(index)[4:].lower().rsplit(".", 1)[0]
    line = "4,%d,%d,-;NVRM: Xid (PCI:%s): %d, pid=%d, name=python3, %s\n" % (
        int(time.time() * 1000) % 10 ** 9, usec, pci, code, os.getpid(), XID_TEXT.get(code, "Unknown Error"))
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
    return line
# field -> (unit shown in a header and after a value, or "", and the value)
GPU_FIELDS = {
    "timestamp": ("", lambda h, i: time.strftime("%Y/%m/%d %H:%M:%S.000")),
    "driver_version": ("", lambda h, i: h.config["driver"]),
    "count": ("", lambda h, i: str(len(h.slots()))),
    "index": ("", lambda h, i: str(h.index_of(i))),
    "name": ("", lambda h, i: h.config["name"]),
    "gpu_name": ("", lambda h, i: h.config["name"]),
    "uuid": ("", lambda h, i: gpu_uuid(h.hostname, i)),
    "gpu_uuid": ("", lambda h, i: gpu_uuid(h.hostname, i)),
    "serial": ("", lambda h, i: str(1650923000000 + int(gpu_uuid(h.hostname, i)[4:12], 16) % 1000000)),
    "pci.bus_id": ("", lambda h, i: bus_id(i)),
    "gpu_bus_id": ("", lambda h, i: bus_id(i)),
    "vbios_version": ("", lambda h, i: "96.00.74.00.01"),
    "persistence_mode": ("", lambda h, i: "Enabled" if h.config.get("persistence", True) else "Disabled"),
    "compute_mode": ("", lambda h, i: "Default"),
    "mig.mode.current": ("", lambda h, i: "Enabled" if i in h.indices("mig") else "Disabled"),
    "ecc.errors.uncorrected.volatile.total": ("", lambda h, i: str(h.per("ecc", i, [0, 0])[0])),
    "ecc.errors.uncorrected.aggregate.total": ("", lambda h, i: str(h.per("ecc", i, [0, 0])[1])),
    "retired_pages.pending": ("", lambda h, i: "Yes" if i in h.indices("retired_pending") else "No"),
    "remapped_rows.pending": ("", lambda h, i: h.per("remap", i, ["No", "No"])[0]),
    "remapped_rows.failure": ("", lambda h, i: h.per("remap", i, ["No", "No"])[1]),
    "clocks_throttle_reasons.active": ("", lambda h, i: "0x%016X" % sum(THROTTLE_BITS[r] for r in h.per("throttle", i, []) if r in THROTTLE_BITS)),
    "clocks_throttle_reasons.hw_slowdown": ("", lambda h, i: h.throttled(i, "hw_slowdown")),
    "clocks_throttle_reasons.hw_thermal_slowdown": ("", lambda h, i: h.throttled(i, "hw_thermal_slowdown")),
    "clocks_throttle_reasons.sw_thermal_slowdown": ("", lambda h, i: h.throttled(i, "sw_thermal_slowdown")),
    "clocks_throttle_reasons.hw_power_brake_slowdown": ("", lambda h, i: h.throttled(i, "hw_power_brake_slowdown")),
    "clocks_throttle_reasons.sw_power_cap": ("", lambda h, i: h.throttled(i, "sw_power_cap")),
    "pstate": ("", lambda h, i: "P0"),
    "temperature.gpu": ("", lambda h, i: "58" if h.busy(i) else "31"),
    "fan.speed": ("%", lambda h, i: "[N/A]"),
    "memory.total": ("MiB", lambda h, i: str(h.config["memory_mib"])),
    "memory.used": ("MiB", lambda h, i: str(h.used_mib(i))),
    "memory.free": ("MiB", lambda h, i: str(max(0, int(h.config["memory_mib"]) - h.used_mib(i)))),
    "utilization.gpu": ("%", lambda h, i: str(h.utilization(i))),
    "utilization.memory": ("%", lambda h, i: str(41 if h.busy(i) else 0)),
    "power.draw": ("W", lambda h, i: "512.37" if h.busy(i) else "69.52"),
    "power.limit": ("W", lambda h, i: "700.00"),
    "clocks.sm": ("MHz", lambda h, i: "1980" if h.busy(i) else "345"),
    "clocks.max.sm": ("MHz", lambda h, i: "1980"),
}

# field -> (unit, header, value from (host, index, pid, MiB))
APP_FIELDS = {
    "timestamp": ("", "timestamp", lambda h, i, pid, mib: time.strftime("%Y/%m/%d %H:%M:%S.000")),
    "gpu_name": ("", "gpu_name", lambda h, i, pid, mib: h.config["name"]),
    "gpu_uuid": ("", "gpu_uuid", lambda h, i, pid, mib: gpu_uuid(h.hostname, i)),
    "gpu_bus_id": ("", "gpu_bus_id", lambda h, i, pid, mib: bus_id(i)),
    "gpu_serial": ("", "gpu_serial", lambda h, i, pid, mib: GPU_FIELDS["serial"][1](h, i)),
    "pid": ("", "pid", lambda h, i, pid, mib: str(pid)),
    "process_name": ("", "process_name", lambda h, i, pid, mib: process_name(pid)),
    "name": ("", "process_name", lambda h, i, pid, mib: process_name(pid)),
    "used_memory": ("MiB", "used_gpu_memory", lambda h, i, pid, mib: str(mib)),
    "used_gpu_memory": ("MiB", "used_gpu_memory", lambda h, i, pid, mib: str(mib)),
}


def parse_format(text: str | None) -> tuple[bool, bool]:
    """--format=csv[,noheader][,nounits] -> (header, units)."""
    if text is None:
        raise Refused("Format must be specified: use --format=csv[,noheader][,nounits]")
    words = [w.strip() for w in text.split(",")]
    if "csv" not in words or set(words) - {"csv", "noheader", "nounits"}:
        raise Refused('"%s" is not a valid format: use --format=csv[,noheader][,nounits]' % text)
    return "noheader" not in words, "nounits" not in words


def _fields(text: str, table: dict) -> list[str]:
    fields = [f.strip() for f in text.split(",") if f.strip()]
    for field in fields:
        if field not in table:
            raise Refused('Field "%s" is not a valid field to query.' % field)
    if not fields:
        raise Refused(INVALID)
    return fields


def _chosen(host: Host, ids: str | None) -> list[int]:
    """The devices -i/--id names (indices or UUIDs), all by default."""
    if ids is None:
        return host.slots()
    chosen = []
    for word in (w.strip() for w in ids.split(",")):
        match = [i for i in host.slots() if word in (str(host.index_of(i)), gpu_uuid(host.hostname, i), bus_id(i))]
        if not match:
            raise Refused("No devices were found", code=6)
        chosen += match
    return chosen


def _with_unit(value: str, unit: str, units: bool) -> str:
    if not units or not unit or value.startswith("["):
        return value
    return value + (" %" if unit == "%" else " " + unit)


def query_gpu(host: Host, fields_text: str, fmt: str | None, ids: str | None = None) -> str:
    fields = _fields(fields_text, GPU_FIELDS)
    header, units = parse_format(fmt)
    lines = []
    if header:
        lines.append(", ".join(f + (" [%s]" % GPU_FIELDS[f][0] if units and GPU_FIELDS[f][0] else "") for f in fields))
    for index in _chosen(host, ids):
        if index in host.lost():
            host.lost_out(lines, index)
            continue
        lines.append(", ".join(_with_unit(GPU_FIELDS[f][1](host, index), GPU_FIELDS[f][0], units) for f in fields))
    return "".join(line + "\n" for line in lines)


def query_apps(host: Host, fields_text: str, fmt: str | None, ids: str | None = None) -> str:
    fields = _fields(fields_text, APP_FIELDS)
    header, units = parse_format(fmt)
    lines = []
    if header:
        lines.append(", ".join(APP_FIELDS[f][1] + (" [%s]" % APP_FIELDS[f][0] if units and APP_FIELDS[f][0] else "")
                               for f in fields))
    for index in _chosen(host, ids):
        if index in host.lost():
            host.lost_out(lines, index)
            continue
        for pid, mib in host.used.get(index, ()):
            lines.append(", ".join(_with_unit(APP_FIELDS[f][2](host, index, pid, mib), APP_FIELDS[f][0], units) for f in fields))
    return "".join(line + "\n" for line in lines)


LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def topology(host: Host, cpus: int | None = None) -> str:
    """`nvidia-smi topo -m`: the tab-separated matrix (the first half of the devices on NUMA node 0 with the first half
    of the CPUs, the rest on node 1), then the legend."""
    shown = [i for i in host.slots() if i not in host.lost()]  # a lost device is not in the matrix
    n = len(shown)
    cpus = cpus or os.cpu_count() or 1
    nodes = 2 if n > 1 and cpus > 1 else 1
    per_node = -(-n // nodes) if n else 1

    def affinity(node: int) -> str:
        first, last = cpus * node // nodes, cpus * (node + 1) // nodes - 1
        return str(first) if first == last else "%d-%d" % (first, last)

    lines = ["\t" + "".join("GPU%d\t" % host.index_of(i) for i in shown) + "CPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for row, a in enumerate(shown):
        node = row // per_node
        lines.append("GPU%d\t" % host.index_of(a) + "".join(link(host.config, a, b) + "\t" for b in shown)
                     + "%s\t%d\t\tN/A" % (affinity(node), node))
    return "\n".join(lines) + "\n" + LEGEND


def list_gpus(host: Host) -> str:
    lines: list[str] = []
    for i in host.slots():
        if i in host.lost():
            host.lost_out(lines, i)
        else:
            lines.append("GPU %d: %s (UUID: %s)" % (host.index_of(i), host.config["name"], gpu_uuid(host.hostname, i)))
    return "".join(line + "\n" for line in lines)


def version(host: Host) -> str:
    driver = host.config["driver"]
    return ("\nNVIDIA-SMI version  : %s\nNVML version        : %s\nDRIVER version      : %s\nCUDA Version        : %s\n"
            % (driver, driver.rsplit(".", 1)[0], driver, host.config["cuda"]))


def banner(host: Host) -> str:
    """What a bare `nvidia-smi` prints: the date, driver and CUDA versions, a box per device, the processes."""
    a, b, c = 41, 24, 22
    rule = "+" + "-" * a + "+" + "-" * b + "+" + "-" * c + "+"
    wide = 2 + a + b + c

    def row(x: str, y: str, z: str) -> str:
        return "|" + x.ljust(a)[:a] + "|" + y.rjust(b)[:b] + "|" + z.rjust(c)[:c] + "|"

    def full(text: str) -> str:
        return "|" + text.ljust(wide)[:wide] + "|"

    top = "+" + "-" * wide + "+"
    lines = [time.strftime("%a %b %d %H:%M:%S %Y") + "       ", top,
             full(" NVIDIA-SMI %-22s Driver Version: %s     CUDA Version: %s" % (host.config["driver"], host.config["driver"],
                                                                                  host.config["cuda"])),
             "|" + "-" * a + "+" + "-" * b + "+" + "-" * c + "+",
             "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
             "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
             "|                                         |                        |               MIG M. |",
             "|" + "=" * a + "+" + "=" * b + "+" + "=" * c + "|"]
    for i in host.slots():
        watts = GPU_FIELDS["power.draw"][1](host, i).split(".")[0]
        lines += [
            row(" %3d  %-30s On  " % (host.index_of(i), host.config["name"][:30]), "%s Off " % bus_id(i), "0 "),
            row(" N/A   %sC    P0 %14sW /  700W " % (GPU_FIELDS["temperature.gpu"][1](host, i), watts),
                "%dMiB / %6dMiB " % (host.used_mib(i), int(host.config["memory_mib"])),
                "%3d%%      Default " % (BUSY_UTILIZATION if host.busy(i) else 0)),
            row("", "", "Disabled "),
            rule,
        ]
    lines += [" " * (wide + 2), top, full(" Processes:"),
              full("  GPU   GI   CI        PID   Type   Process name                              GPU Memory"),
              full("        ID   ID                                                               Usage"),
              "|" + "=" * wide + "|"]
    apps = [(i, pid, mib) for i in host.slots() for pid, mib in host.used.get(i, ())]
    for i, pid, mib in apps:
        name = process_name(pid)
        name = name if len(name) <= 38 else "..." + name[-35:]
        lines.append(full(" %4d   N/A  N/A  %8d      C   %-38s %10dMiB" % (host.index_of(i), pid, name, mib)))
    if not apps:
        lines.append(full("  No running processes found"))
    lines.append(top)
    return "\n".join(lines) + "\n"


HELP = """NVIDIA System Management Interface -- v{driver} (a stand-in of the mnft test bed: no GPU is there)

    nvidia-smi                                       the banner: driver, CUDA, each device and its processes
    nvidia-smi -L, --list-gpus                       each device and its UUID
    nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits] [-i IDS]
    nvidia-smi --query-compute-apps=FIELDS --format=csv[,noheader][,nounits] [-i IDS]
    nvidia-smi topo -m                               the links between devices
    nvidia-smi --version
    nvidia-smi --fake-use INDEX[,INDEX…] [--mib N] -- COMMAND ARGS…   (tests: COMMAND uses those devices)

--query-gpu fields: {gpu_fields}
--query-compute-apps fields: {app_fields}
"""


# --------------------------------------------------------------------------------------------------- command line


def _options(argv: list[str]) -> dict[str, str]:
    """The query options as {name: value}; Refused for anything this stand-in (and mostly the real one) refuses."""
    takes_value = {"--query-gpu", "--query-compute-apps", "--format", "-i", "--id"}
    flags = {"-L": "--list-gpus", "--list-gpus": "--list-gpus", "-h": "--help", "--help": "--help", "--version": "--version"}
    found: dict[str, str] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        name, eq, value = word.partition("=")
        if name in takes_value:
            if not eq:
                if i + 1 >= len(argv):
                    raise Refused(INVALID)
                i, value = i + 1, argv[i + 1]
            found["--id" if name == "-i" else name] = value
        elif word in flags:
            found[flags[word]] = ""
        else:
            raise Refused(INVALID)
        i += 1
    return found


def _fake_use(argv: list[str]) -> tuple[list[int], int, list[str]]:
    """--fake-use 1,2 [--mib N] -- COMMAND… -> (indices, MiB, command)."""
    if "--" not in argv:
        raise Refused("usage: nvidia-smi --fake-use INDEX[,INDEX…] [--mib N] -- COMMAND ARGS…")
    cut = argv.index("--")
    options, command = argv[:cut], argv[cut + 1:]
    indices, mib = None, DEFAULT_MIB
    i = 0
    try:
        while i < len(options):
            name, eq, value = options[i].partition("=")
            if not eq:
                i, value = i + 1, options[i + 1]
            if name == "--fake-use":
                indices = [int(w) for w in value.split(",")]
            elif name == "--mib":
                mib = int(value)
            else:
                raise ValueError(name)
            i += 1
    except (IndexError, ValueError):
        indices = None
    if not indices or not command or mib < 1:  # a CUDA context takes memory: no compute process uses none
        raise Refused("usage: nvidia-smi --fake-use INDEX[,INDEX…] [--mib N] -- COMMAND ARGS…")
    return indices, mib, command


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    state = state_dir()
    try:
        config = load_config(state)
        if argv[:1] in (["-h"], ["--help"]) and len(argv) == 1:
            driver = config["driver"] if config else default_config(0)["driver"]
            sys.stdout.write(HELP.format(driver=driver, gpu_fields=", ".join(GPU_FIELDS), app_fields=", ".join(APP_FIELDS)))
            return 0
        if config is None:
            print(NO_DRIVER)
            return NO_DRIVER_EXIT
        if argv and argv[0].partition("=")[0] == "--fake-use":
            indices, mib, command = _fake_use(argv)
            now = Host(config, "", {})  # the indices as nvidia-smi numbers the devices now; registered by slot
            bad = [i for i in indices if now.slot_of(i) is None]
            if bad:
                raise Refused("--fake-use: no device %d on this host (it has %d)" % (bad[0], len(now.slots())))
            indices = [now.slot_of(i) for i in indices]
            paths = []
            for index in indices:
                try:
                    paths.append(register(state, index, mib=mib))
                except OSError as exc:
                    raise Refused("--fake-use: cannot register on device %d: %s" % (index, exc)) from None
            try:
                os.execvp(command[0], command)
            except OSError as exc:
                for path in paths:
                    os.unlink(path)
                raise Refused("--fake-use: cannot run %s: %s" % (command[0], exc.strerror), code=127) from None
        if argv[:1] == ["--fake-xid"]:
            now = Host(config, "", {})
            if len(argv) != 3 or not argv[1].isdigit() or not argv[2].isdigit() or now.slot_of(int(argv[1])) is None:
                raise Refused("usage: nvidia-smi --fake-xid INDEX CODE (INDEX a device of this host)")
            write_xid(now.slot_of(int(argv[1])), int(argv[2]))
            return 0
        delay = float(config.get("stall") or 0) + float(config.get("latency_ms") or 0) / 1000.0
        if delay > 0:  # persistence off: the driver starts up for every query; a real host's driver time
            time.sleep(delay)
        host = Host(config, os.uname()[1], uses(state, int(config["count"])))
        if argv[:1] == ["topo"]:
            if argv[1:] not in (["-m"], ["--matrix"]):
                raise Refused(INVALID)
            sys.stdout.write(topology(host))
            return 0
        options = _options(argv)
        queries = [k for k in ("--query-gpu", "--query-compute-apps", "--list-gpus", "--version", "--help") if k in options]
        if len(queries) > 1 or (not queries and options.keys() - {"--id"}):
            raise Refused(INVALID)
        if not queries:
            out = banner(host)
        elif queries[0] == "--query-gpu":
            out = query_gpu(host, options["--query-gpu"], options.get("--format"), options.get("--id"))
        elif queries[0] == "--query-compute-apps":
            out = query_apps(host, options["--query-compute-apps"], options.get("--format"), options.get("--id"))
        elif queries[0] == "--list-gpus":
            out = list_gpus(host)
        elif queries[0] == "--version":
            out = version(host)
        else:
            raise Refused(INVALID)
        if host.errors:  # the real tool's stderr comes first: its rows are written at its end
            sys.stderr.write("".join(line + "\n" for line in host.errors))
            sys.stderr.flush()
        sys.stdout.write(out)
        if not host.lost() or queries[:1] == ["--version"]:
            return 0
        return int(config.get("lost_exit", LOST_EXIT)) if queries[:1] == ["--query-gpu"] else LOST_EXIT
    except Refused as exc:
        print(str(exc), file=sys.stderr)
        return exc.code


# --------------------------------------------------------------------------------------------------- for tests

CODE_NAME = "nvidia-smi.code"  # in STATE_DIR: this file's bytecode, as the host's /usr/bin/python3 compiled it
# A host's nvidia-smi (tests/testbed.py writes it): runs this file's bytecode from the host's STATE_DIR without the
# `site` import; a host whose state is gone has no driver, as this file says without its config.json.
STUB = """#!/usr/bin/python3 -S
# the mnft test bed's stand-in nvidia-smi: tests/fakegpu.py, compiled once when the host was made (CODE)
import marshal, os, sys
try:
    with open(os.path.join(os.environ.get("@ENV@") or "@STATE@", "@CODE@"), "rb") as f:
        code = marshal.loads(f.read())
except (OSError, ValueError, EOFError):
    print(@NO_DRIVER@)
    sys.exit(@EXIT@)
exec(code, {"__name__": "__main__"})
""".replace("@ENV@", STATE_ENV).replace("@STATE@", STATE_DIR).replace("@CODE@", CODE_NAME).replace(
    "@NO_DRIVER@", repr(NO_DRIVER)).replace("@EXIT@", str(NO_DRIVER_EXIT))


def compiled(python: str = "/usr/bin/python3") -> bytes:
    """This file's bytecode as `python` (the hosts' interpreter) compiles it, marshalled: STATE_DIR/CODE_NAME."""
    import subprocess

    with open(os.path.abspath(__file__), "rb") as f:
        source = f.read()
    program = ("import marshal,sys;sys.stdout.buffer.write(marshal.dumps(compile(sys.stdin.buffer.read(),"
               "'/usr/local/bin/nvidia-smi','exec',dont_inherit=True)))")
    return subprocess.run([python, "-S", "-c", program], input=source, capture_output=True, check=True).stdout


RANK_SNIPPET = """
def _mnft_fake_gpu_rank():
    \"\"\"mnft test: this torchrun worker uses its GPU (tests/fakegpu.py) and says what it was given.\"\"\"
    import json
    import os
    import sys

    rank, local = os.environ.get("RANK", "?"), int(os.environ.get("LOCAL_RANK", "0"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # one write(2) of the whole line: ranks share the pipe, and print() under PYTHONUNBUFFERED writes the text and
    # its newline apart (two ranks' lines were seen run together)
    os.write(1, ("mnft-test: rank %s local %d sees CUDA_VISIBLE_DEVICES=%s\\n" % (rank, local, "(unset)" if visible is None else visible)).encode())
    state = os.environ.get("@ENV@") or "@STATE@"
    if not os.path.isdir(state) or visible == "":
        return
    with open(os.path.join(state, "config.json")) as f:
        config = json.load(f)
    slots = [i for i in range(int(config["count"])) if i not in set(int(g) for g in config.get("gone") or ())]
    count = len(slots)  # the devices CUDA numbers now (one gone from the bus: the ones after it one lower)
    devices = [d.strip() for d in visible.split(",")] if visible is not None else [str(i) for i in range(count)]
    if local >= len(devices) or not devices[local].isdigit() or int(devices[local]) >= count:
        sys.exit("CUDA error: invalid device ordinal (LOCAL_RANK %d, CUDA_VISIBLE_DEVICES=%s)" % (local, visible))
    devices = [str(slots[int(d)]) if d.isdigit() and int(d) < count else d for d in devices]  # registered by slot
    with open("/proc/self/stat") as f:
        began = f.read().rsplit(")", 1)[1].split()[19]
    directory = os.path.join(state, "used", devices[local])
    partial = os.path.join(directory, ".%d.partial" % os.getpid())
    with open(partial, "w") as f:
        f.write("%s @MIB@\\n" % began)
    os.chmod(partial, 0o644)
    os.replace(partial, os.path.join(directory, str(os.getpid())))


_mnft_fake_gpu_rank()
del _mnft_fake_gpu_rank
""".replace("@ENV@", STATE_ENV).replace("@STATE@", STATE_DIR).replace("@MIB@", str(DEFAULT_MIB))


if __name__ == "__main__":
    sys.exit(main())


# A rank that uses its GPU and ends when the test says so: a file /tmp/mnft-test-end-<its first argument> on its
# host (or after 300 s), so a test decides when each run ends.
HOLD_UNTIL_TOLD = RANK_SNIPPET + '''
import os, sys, time

end = "/tmp/mnft-test-end-" + sys.argv[1]
deadline = time.time() + 300
while not os.path.exists(end) and time.time() < deadline:
    time.sleep(0.2)
print("done", flush=True)
'''
