"""mnft host probe, the facts: what a host has (OS, Python, torch/CUDA/NCCL, GPUs, memory, disk, NICs), or only what
its Python has (inside a container image), read without importing torch and without ever raising (a sub-probe
that fails yields null plus an entry in "errors"). The probe's `facts`, `python`, `image-facts` and `session`
modes print them (mnft.onhost.probe).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time

from .probeout import _message

# Imported where used, not here: ast, re, shlex, shutil, subprocess, tempfile, threading. A `connect` or
# `listen` starts without them (a third of its start-up); `facts` needs most of them and imports them then.

PROBE_VERSION = 1

NVIDIA_SMI_TIMEOUT = 5.0  # nvidia-smi can hang on a wedged driver
IP_TIMEOUT = 2.0
FQDN_TIMEOUT = 2.0  # getfqdn() asks DNS, which can hang on a badly configured host

GPU_QUERY = "index,name,uuid,memory.total,memory.used,driver_version"
APP_QUERY = "gpu_uuid,pid,process_name,used_memory"


# ------------------------------------------------------------------------------------------------ helpers


HEADER_CHARS = 65536  # characters read of a small text file (os-release, a distribution's METADATA headers)
SOURCE_CHARS = 1 << 20  # characters of torch's version.py read at most (it is a few lines)


def _guard(errors: dict, field: str, fn, *args, default=None):
    """fn(*args), or `default` with errors[field] set if it raised."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a probe records failures, it never raises
        errors[field] = _message(exc)
        return default


def _int_or_none(text):
    try:
        return int(str(text).strip())
    except ValueError:
        return None


def _spawn(argv: list):  # -> subprocess.Popen
    # stdin is the controller's channel (listen watches it): children must not read it.
    import subprocess

    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True, env=dict(os.environ, LC_ALL="C"),
    )


def _finish(proc, deadline: float, what: str, ok=(0,)) -> str:  # proc: subprocess.Popen
    """The stdout of a spawned command; raises with a readable message if it failed (an exit status not in `ok`) or
    overran `deadline`."""
    import subprocess

    try:
        out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        if what == "nvidia-smi":  # named as smi.stalled_line names it
            raise RuntimeError("nvidia-smi did not answer in %g s: is persistence mode off? a wedged driver?" % NVIDIA_SMI_TIMEOUT) from None
        raise RuntimeError("%s timed out" % what) from None
    if proc.returncode not in ok:
        lines = (err.strip() or out.strip()).splitlines()
        raise RuntimeError("%s exited with %d: %s" % (what, proc.returncode, lines[0] if lines else "no output"))
    return out


# ------------------------------------------------------------------------------------------------ facts


def _os_release() -> dict:
    import shlex

    for path in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(HEADER_CHARS)  # a few lines; a larger file is read no further
        except FileNotFoundError:
            continue
        values = {}
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if not sep or key.startswith("#"):
                continue
            try:
                values[key] = " ".join(shlex.split(value))
            except ValueError:  # unbalanced quotes
                values[key] = value.strip("\"'")
        return {"id": values.get("ID"), "version": values.get("VERSION_ID"), "pretty": values.get("PRETTY_NAME")}
    raise FileNotFoundError(errno.ENOENT, "no /etc/os-release or /usr/lib/os-release")


def _assignments(path: str) -> dict:
    """Literal top-level assignments of a Python file, read as text (never executed)."""
    import ast

    with open(path, encoding="utf-8") as f:
        text = f.read(SOURCE_CHARS + 1)
    if len(text) > SOURCE_CHARS:
        raise ValueError("%s is larger than %d characters: not read" % (path, SOURCE_CHARS))
    tree = ast.parse(text, path)
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:  # `cuda: Optional[str] = None`
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                try:
                    values[target.id] = ast.literal_eval(value)
                except ValueError:
                    pass
    return values


def _torch(errors: dict) -> dict:
    """torch's version as `import torch` would report it, read without importing it (importing costs seconds).

    find_spec locates the package `import torch` would load (without executing its __init__); its version.py
    (generated at build time: __version__, cuda, git_version, hip) is read as text. Only when that file says
    nothing is the version taken from installed metadata, which may describe another copy of torch earlier on
    sys.path."""
    import importlib.util

    result = {"version": None, "cuda": None, "git_version": None, "location": None, "source": None}
    spec = _guard(errors, "torch.location", importlib.util.find_spec, "torch")
    if spec is not None and spec.submodule_search_locations:
        result["location"] = list(spec.submodule_search_locations)[0]
    if result["location"]:
        version_py = os.path.join(result["location"], "version.py")
        values = _guard(errors, "torch.version_py", _assignments, version_py, default={}) if os.path.isfile(version_py) else {}
        for key, name in (("version", "__version__"), ("cuda", "cuda"), ("git_version", "git_version")):
            if isinstance(values.get(name), str):
                result[key] = values[name]
        if result["version"] is not None:
            result["source"] = "version.py"
    if result["version"] is None and (spec is not None or result["location"]):
        try:
            import importlib.metadata as metadata

            result["version"] = metadata.version("torch")
            result["source"] = "metadata"
        except ImportError:  # PackageNotFoundError too: e.g. a source checkout on PYTHONPATH
            pass
        except Exception as exc:  # noqa: BLE001
            errors["torch.version"] = _message(exc)
    return result


# `nvidia_nccl_cu12-2.21.5.dist-info`: pip's CUDA builds of torch ship NCCL and cuDNN as these distributions.
NVIDIA_DIST = r"^nvidia[-_.]+(nccl|cudnn)[-_.]+cu(\d+)-([^-]+?)(?:-py[\d.]+)?\.(dist-info|egg-info)$"


def _dist_version(path: str, fallback: str) -> str:
    name = "METADATA" if path.endswith(".dist-info") else "PKG-INFO"
    try:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            for line in f.read(HEADER_CHARS).splitlines():  # the headers come first: Name, Version
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
                if not line.strip():  # end of the headers
                    break
    except OSError:
        pass
    return fallback


def _nvidia_libs(torch_cuda) -> dict:
    """{"nccl": version|None, "cudnn": version|None} from nvidia-*-cuNN distributions on sys.path.

    Scans directory names instead of importlib.metadata.distributions(), which reads every installed
    distribution's metadata. Several candidates (cu11 and cu12): the one matching torch's CUDA major wins, then
    the first on sys.path (the one that would be imported).
    """
    import re

    pattern = re.compile(NVIDIA_DIST, re.I)
    major = _int_or_none(torch_cuda.split(".")[0]) if torch_cuda else None
    found = {"nccl": [], "cudnn": []}
    for order, entry in enumerate(sys.path):
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:  # zip files, missing directories
            continue
        for name in names:
            match = pattern.match(name)
            if match:
                cu = int(match.group(2))
                found[match.group(1).lower()].append((cu != major, order, os.path.join(entry or ".", name), match.group(3)))
    return {lib: (_dist_version(*min(c)[2:]) if c else None) for lib, c in found.items()}


def _libcuda_version():
    """The CUDA version the driver supports, asked from libcuda itself (no CUDA context is created)."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(value)) != 0 or value.value <= 0:
        return None
    return "%d.%d" % (value.value // 1000, (value.value % 1000) // 10)


def _parse_gpus(text: str) -> list:
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6 or _int_or_none(parts[0]) is None:
            continue
        gpus.append({
            "index": int(parts[0]),
            "name": ", ".join(parts[1:-4]),  # the only field that could hold a comma
            "uuid": parts[-4],
            "memory_total_mib": _int_or_none(parts[-3]),
            "memory_used_mib": _int_or_none(parts[-2]),
            "driver": parts[-1],
            "processes": [],
        })
    return gpus


def _parse_apps(text: str) -> list:
    apps = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or _int_or_none(parts[1]) is None:
            continue
        pid = int(parts[1])
        apps.append((parts[0], {"pid": pid, "name": ", ".join(parts[2:-1]), "used_mib": _int_or_none(parts[-1]), **_owner(pid)}))
    return apps


def _owner(pid: int) -> dict:
    """{"user": who runs the process, "mine": whether the probe's user does} ({} when /proc does not say)."""
    try:
        uid = os.stat("/proc/%d" % pid).st_uid
    except OSError:
        return {}
    try:
        import pwd

        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = "uid %d" % uid
    return {"user": user, "mine": uid == os.getuid()}


class _Nvidia:
    """nvidia-smi queries, started first and collected last so they run while the rest is read."""

    def __init__(self, errors: dict):
        import shutil

        self.errors = errors
        self.exe = shutil.which("nvidia-smi")
        self.procs = {}
        self.cuda_driver = None
        self.deadline = time.monotonic() + NVIDIA_SMI_TIMEOUT
        if self.exe is None:  # no NVIDIA driver here: not an error
            return
        fmt = "--format=csv,noheader,nounits"
        commands = {"gpus": [self.exe, "--query-gpu=" + GPU_QUERY, fmt], "apps": [self.exe, "--query-compute-apps=" + APP_QUERY, fmt]}
        try:
            self.cuda_driver = _libcuda_version()
        except Exception:  # noqa: BLE001 - no libcuda on the loader path: read nvidia-smi's banner instead
            commands["banner"] = [self.exe]
        for key, argv in commands.items():
            proc = _guard(errors, "nvidia" if key == "gpus" else "nvidia." + key, _spawn, argv)
            if proc is not None:
                self.procs[key] = proc

    def result(self) -> dict:
        result = {"driver": None, "cuda_driver": self.cuda_driver, "gpus": []}
        outputs = {}
        for key, proc in self.procs.items():
            field = "nvidia" if key == "gpus" else "nvidia.processes" if key == "apps" else "nvidia.cuda_driver"
            # 15: a GPU fell off the bus; the others answered (its health is the lease script's to judge)
            outputs[key] = _guard(self.errors, field, _finish, proc, self.deadline, "nvidia-smi", (0, 15))
        if outputs.get("gpus") is None:
            return result
        gpus = _parse_gpus(outputs["gpus"])
        drivers = [g.pop("driver") for g in gpus]
        result["driver"] = next((d for d in drivers if _int_or_none(d.split(".")[0]) is not None), None)
        result["gpus"] = gpus
        if outputs.get("apps") is None:
            for gpu in gpus:
                gpu["processes"] = None
        else:
            by_uuid = {g["uuid"]: g for g in gpus}
            for uuid, app in _parse_apps(outputs["apps"]):
                if uuid in by_uuid:
                    by_uuid[uuid]["processes"].append(app)
        if outputs.get("banner"):
            import re

            match = re.search(r"CUDA Version:\s*([0-9.]+)", outputs["banner"])
            result["cuda_driver"] = match.group(1) if match else None
        return result


def _distributions() -> dict:
    """name -> version of every distribution the interpreter sees (first on sys.path wins, as for imports), from
    the Name/Version headers of each .dist-info/METADATA or .egg-info/PKG-INFO: nothing is imported or fully parsed.
    For the check's "environment identical across hosts" rule."""
    import re

    found = {}
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            if not name.endswith((".dist-info", ".egg-info")):
                continue
            path = os.path.join(entry or ".", name)
            meta = os.path.join(path, "METADATA" if name.endswith(".dist-info") else "PKG-INFO")
            dist_name = version = None
            try:
                with open(meta, encoding="utf-8", errors="replace") as f:
                    left = HEADER_CHARS  # the headers come first (Name, Version): read line by line until both, at most this
                    while left > 0:
                        line = f.readline(left)
                        left -= len(line)
                        if line.startswith("Name:"):
                            dist_name = line.split(":", 1)[1].strip()
                        elif line.startswith("Version:"):
                            version = line.split(":", 1)[1].strip()
                        if not line.strip() or (dist_name and version):
                            break
            except OSError:
                continue
            if dist_name and version:
                found.setdefault(re.sub(r"[-_.]+", "-", dist_name).lower(), version)
    return found


def _memory() -> dict:
    values = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                values[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    available = values.get("MemAvailable", values.get("MemFree"))  # MemAvailable: Linux >= 3.14
    return {"total_bytes": values["MemTotal"], "available_bytes": available}


def _disk(workdir: str) -> dict:
    import shutil

    wanted = os.path.abspath(os.path.expanduser(workdir))
    path = wanted
    while not os.path.isdir(path):  # not created yet: measure where it will be created
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    usage = shutil.disk_usage(path)
    return {"path": path, "workdir": wanted, "free_bytes": usage.free, "total_bytes": usage.total}


def _parse_ip_json(text: str) -> list:
    interfaces = []
    for link in json.loads(text):
        if not isinstance(link, dict) or "ifname" not in link:  # old iproute2 emits {} for filtered links
            continue
        flags = link.get("flags") or []
        interfaces.append({
            "name": link["ifname"],
            "up": "UP" in flags and "LOWER_UP" in flags,  # administratively up and has a carrier
            "ipv4": ["%s/%s" % (a["local"], a["prefixlen"]) for a in link.get("addr_info") or []
                     if a.get("family") == "inet" and "local" in a],
        })
    return interfaces


def _interfaces_ioctl() -> list:
    """Fallback without iproute2: one (the primary) IPv4 address per interface."""
    import fcntl
    import struct

    siocgifflags, siocgifaddr, siocgifnetmask = 0x8913, 0x8915, 0x891B
    iff_up, iff_running = 0x1, 0x40
    interfaces = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            flags = struct.unpack("H", fcntl.ioctl(sock.fileno(), siocgifflags, request)[16:18])[0]
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), siocgifaddr, request)[20:24])
                mask = fcntl.ioctl(sock.fileno(), siocgifnetmask, request)[20:24]
                ipv4 = ["%s/%d" % (addr, bin(int.from_bytes(mask, "big")).count("1"))]
            except OSError:  # EADDRNOTAVAIL: no IPv4 address
                ipv4 = []
            interfaces.append({"name": name, "up": bool(flags & iff_up and flags & iff_running), "ipv4": ipv4})
    return interfaces


def _interfaces(ip_proc, deadline: float) -> list:
    if ip_proc is not None:
        try:
            return _parse_ip_json(_finish(ip_proc, deadline, "ip"))
        except Exception:  # noqa: BLE001 - iproute2 without -j (< 4.14) or broken: ask the kernel directly
            pass
    return _interfaces_ioctl()


def _start_fqdn() -> tuple:
    import threading

    box = {}

    def work():
        try:
            box["fqdn"] = socket.getfqdn()
        except Exception as exc:  # noqa: BLE001
            box["error"] = _message(exc)

    thread = threading.Thread(target=work, name="fqdn", daemon=True)  # daemon: a hung DNS query can't block exit
    thread.start()
    return thread, box


def _fqdn(thread, box: dict, deadline: float) -> str:  # thread: threading.Thread
    thread.join(max(0.0, deadline - time.monotonic()))
    if "error" in box:
        raise RuntimeError(box["error"])
    if "fqdn" not in box:
        raise RuntimeError("DNS lookup timed out")
    return box["fqdn"]


def modules(names: list) -> dict:
    """Which top-level modules this Python would import, found as `import` finds them (sys.path, the meta path)
    without importing any: name -> true/false. A finder that fails counts as not found."""
    import importlib.util

    out = {}
    saved = list(sys.path)
    sys.path.insert(0, "")  # as a job's `python` finds them: its working directory first (the bootstrap took it off)
    try:
        for name in names:
            try:
                out[name] = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError, AttributeError):
                out[name] = False
    finally:
        sys.path[:] = saved
    return out


def _packages(out: dict, errors: dict, wanted: list) -> float:
    """What this Python has into `out`: torch (read, never imported), NCCL/cuDNN, every distribution, and which of
    the `wanted` modules it resolves. Returns the seconds reading torch took."""
    torch_start = time.monotonic()
    out["torch"] = _guard(errors, "torch", _torch, errors)
    torch_s = time.monotonic() - torch_start
    libs = _guard(errors, "nccl", _nvidia_libs, (out["torch"] or {}).get("cuda"), default={})
    out["nccl"] = libs.get("nccl")
    out["cudnn"] = libs.get("cudnn")
    out["dists"] = _guard(errors, "dists", _distributions)
    if wanted:
        out["modules"] = _guard(errors, "modules", modules, list(wanted))
    return torch_s


def _python_version() -> str:
    """platform.python_version() ("3.11.7", "3.13.0rc1"): the first word of sys.version, without importing platform."""
    return sys.version.split()[0]


def python_facts(wanted: list = ()) -> dict:
    """Only what this Python has (inside a container image: the Python the job runs in)."""
    start = time.monotonic()
    errors = {}
    out = {"probe_version": PROBE_VERSION, "python": {"executable": sys.executable, "version": _python_version()}}
    torch_s = _packages(out, errors, wanted)
    out["timings"] = {"total_s": round(time.monotonic() - start, 4), "torch_s": round(torch_s, 4)}
    out["errors"] = errors
    return out


def facts(workdir: str = "~", wanted: list = (), packages: bool = True) -> dict:
    """Everything the controller plans from. Slow parts (nvidia-smi, ip, DNS) run concurrently. packages=False:
    not this Python's packages (torch, NCCL, distributions, modules): an image brings the job's own."""
    import shutil

    start = time.monotonic()
    errors = {}
    nvidia = _Nvidia(errors)
    ip_exe = shutil.which("ip")
    ip_proc = _guard({}, "ip", _spawn, [ip_exe, "-j", "addr", "show"]) if ip_exe else None
    ip_deadline = time.monotonic() + IP_TIMEOUT
    fqdn_thread, fqdn_box = _start_fqdn()
    fqdn_deadline = time.monotonic() + FQDN_TIMEOUT

    out = {"probe_version": PROBE_VERSION}
    out["hostname"] = _guard(errors, "hostname", socket.gethostname)
    out["fqdn"] = None
    out["os"] = _guard(errors, "os", _os_release)
    out["kernel"] = _guard(errors, "kernel", lambda: os.uname().release)  # what platform.release() and machine() say
    out["arch"] = _guard(errors, "arch", lambda: os.uname().machine)
    out["python"] = {"executable": sys.executable, "version": _python_version()}
    torch_s = _packages(out, errors, wanted) if packages else None
    out["nvidia"] = None
    out["cpu_count"] = _guard(errors, "cpu_count", os.cpu_count)
    out["memory"] = _guard(errors, "memory", _memory)
    out["disk"] = _guard(errors, "disk", _disk, workdir)
    out["interfaces"] = _guard(errors, "interfaces", _interfaces, ip_proc, ip_deadline)
    out["fqdn"] = _guard(errors, "fqdn", _fqdn, fqdn_thread, fqdn_box, fqdn_deadline)
    out["nvidia"] = _guard(errors, "nvidia", nvidia.result)
    out["clock"] = None
    out["rsync"] = _guard(errors, "rsync", shutil.which, "rsync")
    out["timings"] = {"total_s": None, "torch_s": None if torch_s is None else round(torch_s, 4)}
    out["errors"] = errors
    out["clock"] = time.time()
    out["timings"]["total_s"] = round(time.monotonic() - start, 4)
    return out
