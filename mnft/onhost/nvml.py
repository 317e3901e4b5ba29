"""NVML through ctypes (read_nvml): the GPUs, their health and compute processes without a process per question;
see the comment below. Standard library only, Python 3.8 syntax.
"""

from .health import THROTTLES
from .smi import SMI_TIMEOUT, StalledRead, stalled_line

# NVML, the driver's own library (libnvidia-ml.so.1), through ctypes: the same facts as nvidia-smi without a
# process per question. Every call runs in a thread the read waits for at most SMI_TIMEOUT: a wedged driver hangs
# that thread, not the look (StalledRead names it, and NVML is not asked again by this process).
NVML_LIB = "libnvidia-ml.so.1"
NVML_LOST, NVML_INSUFFICIENT = 15, 7
_NVML = {}


def read_nvml(seconds=None):
    """The devices, their health and compute processes through NVML; OSError when the library is not there (or
    fails), StalledRead when it does not answer."""
    import threading

    seconds = SMI_TIMEOUT if seconds is None else seconds
    if _NVML.get("hung"):
        raise StalledRead(stalled_line("NVML (%s)" % NVML_LIB, seconds))
    box = {}

    def work():
        try:
            box["devices"] = _nvml_devices()
        except BaseException as exc:  # noqa: BLE001 - given to the reader
            box["error"] = exc

    thread = threading.Thread(target=work, name="nvml")
    thread.daemon = True
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _NVML["hung"] = True
        raise StalledRead(stalled_line("NVML (%s)" % NVML_LIB, seconds))
    if "error" in box:
        raise box["error"]
    return box["devices"]


def _nvml():
    import ctypes

    lib = _NVML.get("lib")
    if lib is None:
        lib = ctypes.CDLL(NVML_LIB)  # OSError where the driver's library is not installed
        lib.nvmlErrorString.restype = ctypes.c_char_p
        code = lib.nvmlInit_v2()
        if code:
            raise OSError("NVML did not start: %s" % lib.nvmlErrorString(code).decode("utf-8", "replace"))
        _NVML["lib"] = lib
    return lib


def _nvml_devices():
    import ctypes

    lib = _nvml()
    uint, ull = ctypes.c_uint, ctypes.c_ulonglong

    class Memory(ctypes.Structure):
        _fields_ = [("total", ull), ("free", ull), ("used", ull)]

    class Utilization(ctypes.Structure):
        _fields_ = [("gpu", uint), ("memory", uint)]

    class Pci(ctypes.Structure):
        _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", uint), ("bus", uint), ("device", uint), ("pciDeviceId", uint),
                    ("pciSubSystemId", uint), ("busId", ctypes.c_char * 32)]

    def ask(name, *args):
        """The call's status: 0 answered; a function this driver lacks counts as not supported (3)."""
        function = getattr(lib, name, None)
        return 3 if function is None else function(*args)

    count = uint(0)
    code = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
    if code:
        raise OSError("NVML: %s" % lib.nvmlErrorString(code).decode("utf-8", "replace"))
    devices = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        code = lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
        if code:
            devices.append({"index": index, "uuid": None, "name": None, "bus_id": None, "processes": [],
                            "health": {"lost": "NVML: GPU %d: %s" % (index, lib.nvmlErrorString(code).decode("utf-8", "replace"))}})
            continue
        text = ctypes.create_string_buffer(96)
        device = {"index": index, "processes": []}
        device["uuid"] = text.value.decode() if ask("nvmlDeviceGetUUID", handle, text, 96) == 0 else None
        device["name"] = text.value.decode() if ask("nvmlDeviceGetName", handle, text, 96) == 0 else None
        pci = Pci()
        device["bus_id"] = pci.busId.decode() if ask("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci)) == 0 else None
        memory = Memory()
        if ask("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(memory)) == 0:
            device.update(memory_total_mib=int(memory.total >> 20), memory_used_mib=int(memory.used >> 20))
        util = Utilization()
        device["utilization"] = int(util.gpu) if ask("nvmlDeviceGetUtilizationRates", handle, ctypes.byref(util)) == 0 else None
        health = {}
        a, b, c, d = uint(0), uint(0), uint(0), uint(0)
        if ask("nvmlDeviceGetPersistenceMode", handle, ctypes.byref(a)) == 0:
            health["persistence"] = a.value == 1
        if ask("nvmlDeviceGetMigMode", handle, ctypes.byref(a), ctypes.byref(b)) == 0:
            health["mig"] = a.value == 1
        for key, counter in (("ecc_volatile", 0), ("ecc_aggregate", 1)):
            value = ull(0)
            if ask("nvmlDeviceGetTotalEccErrors", handle, 1, counter, ctypes.byref(value)) == 0:  # uncorrected
                health[key] = int(value.value)
        if ask("nvmlDeviceGetRetiredPagesPendingStatus", handle, ctypes.byref(a)) == 0:
            health["retired_pending"] = a.value == 1
        if ask("nvmlDeviceGetRemappedRows", handle, ctypes.byref(a), ctypes.byref(b), ctypes.byref(c), ctypes.byref(d)) == 0:
            health["remap_pending"], health["remap_failed"] = c.value != 0, d.value != 0
        reasons = ull(0)
        if ask("nvmlDeviceGetCurrentClocksThrottleReasons", handle, ctypes.byref(reasons)) == 0:
            bits = {"hw_slowdown": 0x8, "sw_thermal_slowdown": 0x20, "hw_thermal_slowdown": 0x40, "hw_power_brake_slowdown": 0x80}
            health["throttle"] = [t for t in THROTTLES if reasons.value & bits[t]]
        device["health"] = health
        device["processes"] = _nvml_processes(lib, ask, handle)
        devices.append(device)
    return devices


def _nvml_processes(lib, ask, handle):
    """[(pid, used MiB)] of the GPU's compute processes, through the newest call the driver offers (_v3, _v2, the
    first: their records differ)."""
    import ctypes

    uint, ull = ctypes.c_uint, ctypes.c_ulonglong

    class V1(ctypes.Structure):
        _fields_ = [("pid", uint), ("usedGpuMemory", ull)]

    class V2(ctypes.Structure):
        _fields_ = [("pid", uint), ("usedGpuMemory", ull), ("gpuInstanceId", uint), ("computeInstanceId", uint)]

    for name, record in (("nvmlDeviceGetComputeRunningProcesses_v3", V2), ("nvmlDeviceGetComputeRunningProcesses_v2", V2),
                         ("nvmlDeviceGetComputeRunningProcesses", V1)):
        if getattr(lib, name, None) is None:
            continue
        for _ in range(3):  # a process may start between asking the count and the list
            count = uint(0)
            code = ask(name, handle, ctypes.byref(count), None)
            if code not in (0, NVML_INSUFFICIENT):
                return []
            size = count.value + 8
            found = (record * size)()
            count = uint(size)
            code = ask(name, handle, ctypes.byref(count), found)
            if code == 0:
                return [(int(p.pid), int(p.usedGpuMemory >> 20) if p.usedGpuMemory < (1 << 62) else None) for p in found[:count.value]]
            if code != NVML_INSUFFICIENT:
                return []
        return []
    return []
