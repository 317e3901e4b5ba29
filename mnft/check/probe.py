#!/usr/bin/env python3
"""mnft host probe: read one host's facts, or test its network, in one SSH round-trip.

The controller ships this file's source (see `source()`) to each host's Python and reads exactly one JSON
object from stdout. It also runs as `python3 mnft/check/probe.py MODE ...`.

    facts [--workdir PATH] [--modules A,B]  what the host has: OS, Python, torch/CUDA/NCCL, GPUs, memory, disk, NICs;
                                            with --modules, which of those top-level modules this Python resolves
    python [--modules A,B]                  only what this Python has (torch/CUDA/NCCL, distributions, the modules):
                                            the probe inside a container image, where the job's Python is
    image-facts [--workdir PATH]            with an image: the image's facts (imagehost's, its source in the
                                            controller's request on stdin), the host's facts without its Python's
                                            packages, and each command the controller sends meanwhile (the probe
                                            inside the image): one line each, as each is ready
    session [--workdir PATH] [--modules A,B]
                                            the facts at once ({"facts": …}), then each request the controller sends on
                                            stdin, one JSON line each, answered with one line: a host script to run
                                            (check's code hash and marks), listen, connect; until stdin ends. check's
                                            one command per host
    listen PORT SECONDS [--bind ADDR]       accept TCP connections (reply b"mnft\\n") until SECONDS pass or stdin closes
    connect HOST PORT TIMEOUT [--bind ADDR] connect (from source address ADDR) and read the listener's reply
    free-port PORT [--bind ADDR]            can PORT be bound right now (SO_REUSEADDR off)?

Constraints, because this runs on hosts mnft does not control:
- Python >= 3.8 and the standard library only.
- Never imports torch (that costs seconds): its version comes from the installed distribution's metadata and
  its CUDA version from torch/version.py parsed as text.
- Never raises: a sub-probe that fails yields null plus an entry in "errors" ({"field": "message"}).
- Exit status 0, except 2 for a malformed command line (message on stderr, nothing on stdout).
"""

from __future__ import annotations

import errno
import json
import math
import os
import select
import socket
import sys
import time

# Imported where used, not here: ast, re, shlex, shutil, subprocess, tempfile, threading. A `connect` or
# `listen` starts without them (a third of its start-up); `facts` needs most of them and imports them then.

PROBE_VERSION = 1
REPLY = b"mnft\n"

NVIDIA_SMI_TIMEOUT = 5.0  # nvidia-smi can hang on a wedged driver
IP_TIMEOUT = 2.0
FQDN_TIMEOUT = 2.0  # getfqdn() asks DNS, which can hang on a badly configured host
HANGUP_GRACE = 2.0  # listen: how long to wait for a client to close after the reply

GPU_QUERY = "index,name,uuid,memory.total,memory.used,driver_version"
APP_QUERY = "gpu_uuid,pid,process_name,used_memory"

USAGE = """usage: probe.py facts [--workdir PATH] [--modules A,B]
       probe.py python [--modules A,B]
       probe.py image-facts [--workdir PATH]
       probe.py session [--workdir PATH] [--modules A,B]
       probe.py listen PORT SECONDS [--bind ADDR]
       probe.py connect HOST PORT TIMEOUT [--bind ADDR]
       probe.py free-port PORT [--bind ADDR]"""


def source() -> str:
    """This file's source text, for the controller to ship to a host (only meaningful where the file exists)."""
    with open(__file__, encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------------------------------------ helpers


def _message(exc: BaseException) -> str:
    """One line for an exception; the wording the controller shows to a user."""
    if isinstance(exc, socket.timeout):  # an alias of TimeoutError since 3.10, an OSError subclass before
        return "timed out"
    if isinstance(exc, socket.gaierror):
        return "cannot resolve the address: %s" % (exc.strerror or exc)
    if isinstance(exc, OSError):
        if exc.errno == errno.EADDRINUSE:
            return "address in use"
        if exc.errno == errno.ECONNREFUSED:
            return "connection refused"
        if exc.strerror:
            return exc.strerror[0].lower() + exc.strerror[1:]
    text = str(exc).strip().splitlines()
    if type(exc) is RuntimeError:  # raised here with a message meant for the user
        return text[0] if text else "failed"
    return "%s: %s" % (type(exc).__name__, text[0]) if text else type(exc).__name__


HEADER_CHARS = 65536  # characters read of a small text file (os-release, a distribution's METADATA headers)
SOURCE_CHARS = 1 << 20  # characters of torch's version.py read at most (it is a few lines)


def _guard(errors: dict, field: str, fn, *args, default=None):
    """fn(*args), or `default` with errors[field] set if it raised."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a probe records failures, it never raises
        errors[field] = _message(exc)
        return default


def _emit(obj: dict) -> None:
    """Print one JSON line and flush; if the reader is gone, stay quiet (also at interpreter exit)."""
    try:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError, OSError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass


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
        if what == "nvidia-smi":  # named as leasehost.stalled_line names it
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
    for name in names:
        try:
            out[name] = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError, AttributeError):
            out[name] = False
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


# ------------------------------------------------------------------------------------------------ an image

REQUEST_BYTES = 16 << 20  # one request line of the controller's, at most (a script's source is in it)
STDOUT_KEPT = 4 << 20  # a command's stdout kept (its end: its reply is its last line)
STDERR_KEPT = 65536  # a command's stderr kept (its end)


def _request():
    """The controller's next request: one JSON object on a line of stdin; None at its end."""
    line = sys.stdin.buffer.readline(REQUEST_BYTES + 1)
    if not line.strip():
        return None
    if len(line) > REQUEST_BYTES:
        raise ValueError("a request longer than %d bytes" % REQUEST_BYTES)
    request = json.loads(line.decode("utf-8"))
    if not isinstance(request, dict):
        raise ValueError("a request that is not a JSON object")
    return request


def _image_host_facts(request: dict) -> dict:
    """imagehost's facts (its source, the runtime setting and the image come in the request), computed in this
    process as imagehost.py says another host script may: its source run in a namespace of its own."""
    namespace = {"__name__": "mnft_imagehost"}
    exec(compile(request["imagehost"], "imagehost", "exec"), namespace)
    return namespace["facts"](request["runtime"], request["image"])


def _end(f, kept: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - kept))
    return f.read(kept).decode("utf-8", "replace")


def run_command(request: dict) -> dict:
    """A command the controller sent: `argv` (run as it is, no shell), `input` on its stdin, `timeout` seconds.
    Its exit code (None: it did not end or could not start, `error` says why) and the ends of its output."""
    import subprocess
    import tempfile

    start = time.monotonic()
    argv = [str(a) for a in request.get("argv") or []]
    timeout = float(request.get("timeout") or 60)
    out = {"exit_code": None, "stdout": "", "stderr": "", "error": None, "seconds": None}
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        try:
            out["exit_code"] = subprocess.run(argv, input=(request.get("input") or "").encode("utf-8"), stdout=stdout,
                                              stderr=stderr, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out["error"] = "no answer within %gs" % timeout
        except (OSError, ValueError) as exc:  # ValueError: an empty argv
            out["error"] = "%s: %s" % (argv[0] if argv else "no command", _message(exc))
        out["stdout"] = _end(stdout, STDOUT_KEPT)
        out["stderr"] = _end(stderr, STDERR_KEPT)
    out["seconds"] = round(time.monotonic() - start, 4)
    return out


def _image_side(request: dict, emit) -> None:
    """The image's facts as soon as they are known (one line), then each command the controller sends (the probe
    inside the image, whose command line it builds from those facts), one line each, until stdin ends: all while
    the host's own facts are still being read."""
    try:
        emit({"container": _image_host_facts(request), "container_error": None})
    except Exception as exc:  # noqa: BLE001 - the probe never raises
        emit({"container": None, "container_error": _message(exc)})
    while True:
        try:
            request = _request()
        except Exception as exc:  # noqa: BLE001
            emit({"ran": {"exit_code": None, "error": "a request the probe cannot read: %s" % _message(exc)}})
            return
        if request is None:
            return
        emit({"ran": run_command(request)})


def image_facts(workdir: str) -> None:
    """With an image, three lines in the order they are ready: the image's facts (imagehost's, read in a thread of
    this process), the host's facts without its Python's packages (its clock read last, as `facts` does), and the
    result of the command the controller sends once it has the image's facts (the probe inside the image). Ends
    when stdin ends."""
    import threading

    start = time.monotonic()
    request = _request() or {}
    lock = threading.Lock()

    def emit(obj: dict) -> None:
        with lock:
            _emit(obj)

    side = threading.Thread(target=_image_side, args=(request, emit), name="image", daemon=True)
    side.start()
    host = facts(workdir, packages=False)
    host["clock"] = time.time()
    host["timings"]["total_s"] = round(time.monotonic() - start, 4)
    emit({"facts": host})
    side.join()  # until stdin ends (the controller closes it, or its connection goes)


# ------------------------------------------------------------------------------------------------ network


def _bound_socket(bind: str, port: int, reuse: bool) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(bind, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1 if reuse else 0)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _stdin_is_a_channel() -> bool:
    """Can the controller stop us by closing stdin? Not if stdin is already at EOF (`python3 - < probe.py`
    consumed it, or </dev/null): then only SECONDS, or the stdout reader going away, ends `listen`."""
    try:
        readable, _, _ = select.select([0], [], [], 0)
        if not readable:
            return True
        return os.read(0, 65536) != b""
    except (OSError, ValueError):
        return False


LISTEN_BACKLOG = 128  # connections the listener's kernel queue holds before accept(): the check's fan-in limit


def _listening(port: int, bind: str) -> tuple:
    """(a socket listening on PORT, None), or (None, why not)."""
    try:
        server = _bound_socket(bind, port, reuse=True)  # as torch's TCPStore does
    except Exception as exc:  # noqa: BLE001
        return None, _message(exc)
    try:
        server.listen(LISTEN_BACKLOG)
    except Exception as exc:  # noqa: BLE001
        server.close()
        return None, _message(exc)
    return server, None


def listen(port: int, seconds: float, bind: str) -> None:
    """Print {"ok": true, "port": N} at once, then serve until `seconds` pass, stdin reaches EOF or the stdout
    reader hangs up. Each connection gets REPLY; the server then waits for the client to close first, so no
    TIME_WAIT is left on PORT (a rerun, or torchrun right after, can bind it again)."""
    server, why = _listening(port, bind)
    if server is None:
        _emit({"ok": False, "error": why})
        return
    _emit({"ok": True, "port": server.getsockname()[1]})
    _serve(server, time.monotonic() + seconds, 0 if _stdin_is_a_channel() else None)


def _serve(server: socket.socket, deadline: float, stop_fd) -> None:
    """Answer every connection to `server` until `deadline`, until `stop_fd` (stdin, or a session's stop pipe;
    None: none) reaches EOF, or until the stdout reader hangs up; then close it."""
    poller = select.poll()
    poller.register(server.fileno(), select.POLLIN)
    if stop_fd is not None:
        poller.register(stop_fd, select.POLLIN)
    poller.register(sys.stdout.fileno(), select.POLLERR | select.POLLHUP)  # only reports a vanished reader
    clients = {}  # fd -> (socket, close-by time)
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            wake = min([deadline] + [until for _, until in clients.values()])
            for fd, event in poller.poll(max(0, math.ceil((wake - now) * 1000))):
                if event & select.POLLNVAL:
                    poller.unregister(fd)
                elif fd == server.fileno():
                    _accept(server, poller, clients)
                elif fd == stop_fd:
                    if os.read(fd, 65536) == b"":
                        return
                elif fd == sys.stdout.fileno():
                    return
                elif fd in clients:
                    _drain(fd, poller, clients)
            now = time.monotonic()
            for fd in [fd for fd, (_, until) in clients.items() if until <= now]:
                _drop(fd, poller, clients)
    finally:
        for fd in list(clients):
            _drop(fd, poller, clients)
        server.close()


def _accept(server: socket.socket, poller, clients: dict) -> None:
    try:
        conn, _ = server.accept()
    except OSError:
        return
    try:
        conn.settimeout(1.0)
        conn.sendall(REPLY)  # no FIN yet: whoever closes first keeps the TIME_WAIT, so let the client
    except OSError:
        conn.close()
        return
    poller.register(conn.fileno(), select.POLLIN)
    clients[conn.fileno()] = (conn, time.monotonic() + HANGUP_GRACE)


def _drain(fd: int, poller, clients: dict) -> None:
    conn, _ = clients[fd]
    try:
        closed = conn.recv(4096) == b""
    except OSError:
        closed = True
    if closed:
        _drop(fd, poller, clients)


def _drop(fd: int, poller, clients: dict) -> None:
    conn, _ = clients.pop(fd)
    try:
        poller.unregister(fd)
    except (KeyError, ValueError):
        pass
    conn.close()


def connect(host: str, port: int, timeout: float, bind) -> dict:
    """Connect (from source address `bind`) and read the reply, all within `timeout` seconds.

    ok: the TCP connection was established; reply_ok: the peer answered REPLY (an mnft listener);
    local: the source address actually used; seconds: the whole attempt, connect plus reply."""
    start = time.monotonic()
    result = {"ok": False, "seconds": None, "error": None, "reply_ok": False, "local": None}
    conn = None
    try:
        conn = socket.create_connection((host, port), timeout=timeout, source_address=(bind, 0) if bind else None)
        result["ok"] = True
        result["local"] = conn.getsockname()[0]
        data = b""
        while not data.endswith(b"\n") and len(data) < 64:
            conn.settimeout(max(0.001, timeout - (time.monotonic() - start)))
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
        result["reply_ok"] = data == REPLY
        if not result["reply_ok"]:
            result["error"] = "unexpected reply %r: not an mnft listener" % data[:32] if data else "no reply"
    except Exception as exc:  # noqa: BLE001
        result["error"] = ("no reply: " if result["ok"] else "") + _message(exc)
    finally:
        if conn is not None:
            conn.close()
    result["seconds"] = round(time.monotonic() - start, 4)
    return result


def free_port(port: int, bind: str) -> dict:
    try:
        _bound_socket(bind, port, reuse=False).close()
    except Exception as exc:  # noqa: BLE001
        return {"free": False, "error": _message(exc)}
    return {"free": True, "error": None}


# ------------------------------------------------------------------------------------------------ a session

RUN_STDOUT_CHARS = 128 << 20  # what a script run in a session may print (a tree hash lists every file); past it, an error


def _magic() -> str:
    """This Python's bytecode magic number, hex (importlib.util.MAGIC_NUMBER, without importing importlib.util)."""
    return getattr(sys.modules.get("_frozen_importlib_external"), "MAGIC_NUMBER", b"").hex()


def run_script(request: dict) -> dict:
    """A standard-library host script the controller sent, run in this process as mnft.hosts.pyrun runs one:
    `source` as __main__, sys.argv[1:] = `argv`, `stdin` as its standard input; where `magic` is this Python's
    bytecode magic number, `code` (base64 of the source compiled by the controller, marshalled) is run instead
    of compiling the source here, as pyrun's COMPILED_BOOTSTRAP does. Its exit code (None: it could not be run,
    `error` says why; 1 and `error`: it raised), what it printed and how long it took. It runs after the facts are
    out, with stdin, stdout and stderr its own while it runs (nothing else of the probe prints then)."""
    import io

    start = time.monotonic()
    out = {"exit_code": None, "stdout": "", "stderr": "", "error": None, "seconds": None}
    stdout, stderr = io.StringIO(), io.StringIO()
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr
    try:
        source, argv = request["source"], request.get("argv") or []
        if not isinstance(source, str) or not isinstance(argv, list):
            raise ValueError("a run needs a source text and an argv list")
        if request.get("code") and request.get("magic") == _magic():
            import binascii
            import marshal

            code = marshal.loads(binascii.a2b_base64(request["code"]))
        else:
            code = compile(source, "mnft-script", "exec")
        sys.argv, sys.stdin = ["-c"] + [str(a) for a in argv], io.StringIO(str(request.get("stdin") or ""))
        sys.stdout, sys.stderr = stdout, stderr
        try:
            exec(code, {"__name__": "__main__", "__source__": source.encode("utf-8", "surrogateescape")})
            out["exit_code"] = 0
        except SystemExit as exc:
            out["exit_code"] = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception as exc:  # noqa: BLE001 - the script's fault: exit 1, as python would
            out["exit_code"], out["error"] = 1, _message(exc)
    except Exception as exc:  # noqa: BLE001 - not even started: a request the probe cannot run
        out["error"] = "the run request: %s" % _message(exc)
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
    out["stdout"] = stdout.getvalue()
    if len(out["stdout"]) > RUN_STDOUT_CHARS:
        out["stdout"], out["error"] = "", "printed more than %d characters" % RUN_STDOUT_CHARS
    out["stderr"] = stderr.getvalue()[-STDERR_KEPT:]
    out["seconds"] = round(time.monotonic() - start, 4)
    return out


class _Listener:
    """A session's listener: `listen` served in a thread, until its seconds pass or the session ends."""

    def __init__(self):
        self.thread = None
        self.stop_fd = None  # the write end of the pipe _serve watches: closed, it stops
        self.port = None

    def start(self, port: int, seconds: float, bind: str) -> dict:
        import threading

        if self.thread is not None and self.thread.is_alive():
            return {"ok": False, "error": "already listening on port %d" % self.port}
        self.stop()
        server, why = _listening(port, bind)
        if server is None:
            return {"ok": False, "error": why}
        self.port = server.getsockname()[1]
        read_fd, self.stop_fd = os.pipe()
        self.thread = threading.Thread(target=self._run, args=(server, time.monotonic() + seconds, read_fd), name="listen", daemon=True)
        self.thread.start()
        return {"ok": True, "port": self.port}

    @staticmethod
    def _run(server: socket.socket, deadline: float, read_fd: int) -> None:
        try:
            _serve(server, deadline, read_fd)
        finally:
            os.close(read_fd)

    def stop(self) -> None:
        if self.stop_fd is not None:
            os.close(self.stop_fd)
            self.stop_fd = None
        if self.thread is not None:
            self.thread.join(HANGUP_GRACE + 1.0)
            self.thread = None


def _field(body: dict, name: str, kind, low, high=None):
    """A number of a request (as `_number` judges a command line's)."""
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _Usage("%s must be a number, not %r" % (name, value))
    return _number(str(value), name, kind, low, high)


def _bind_of(body: dict):
    bind = body.get("bind")
    if bind is not None and not isinstance(bind, str):
        raise _Usage("bind must be an address, not %r" % (bind,))
    return bind


def answer(request: dict, listener: _Listener) -> dict:
    """One request of a session, answered: {"run": …} -> {"ran": …}; {"listen": {"port", "seconds", "bind"}} ->
    {"listen": {"ok", "port" | "error"}}; {"connect": {"host", "port", "timeout", "bind"}} -> {"connect": …}."""
    kinds = [k for k in ("run", "listen", "connect") if k in request]
    if len(kinds) != 1 or not isinstance(request[kinds[0]], dict):
        return {"error": "a request names one of run, listen, connect, with an object"}
    kind, body = kinds[0], request[kinds[0]]
    if kind == "run":
        return {"ran": run_script(body)}
    try:
        if kind == "listen":
            port, seconds = _field(body, "port", int, 0, 65535), _field(body, "seconds", float, 0.001)
            return {"listen": listener.start(port, seconds, _bind_of(body) or "0.0.0.0")}
        host = body.get("host")
        if not isinstance(host, str) or not host:
            raise _Usage("host must be an address, not %r" % (host,))
        port, timeout = _field(body, "port", int, 1, 65535), _field(body, "timeout", float, 0.001)
        return {"connect": connect(host, port, timeout, _bind_of(body))}
    except _Usage as exc:
        return {kind: {"ok": False, "error": "a bad request: %s" % exc}}


def session(workdir: str, wanted: list) -> None:
    """The facts at once (one line {"facts": …}, its clock read last, as `facts` does), then each request the
    controller sends on stdin, one JSON line each (`answer`), each answered with one line, in order, until stdin
    ends; a listener then stops with it. check's one command per host: its facts, its code hash and marks (a run
    of the tree-hash script), the listener on the master and every host's connect, in one interpreter."""
    listener = _Listener()
    try:
        try:
            out = facts(workdir, wanted)
        except Exception as exc:  # noqa: BLE001 - a bug: the facts are its report, as in `facts` mode
            import traceback

            traceback.print_exc()
            out = {"probe_version": PROBE_VERSION, "errors": {"probe": _message(exc)}}
        _emit({"facts": out})
        while True:
            try:
                request = _request()
            except Exception as exc:  # noqa: BLE001
                _emit({"error": "a request the probe cannot read: %s" % _message(exc)})
                return
            if request is None:
                return
            _emit(answer(request, listener))
    finally:
        listener.stop()


# ------------------------------------------------------------------------------------------------ command line


class _Usage(Exception):
    pass


def _number(text: str, what: str, kind, low, high=None):
    try:
        value = kind(text)
    except ValueError:
        raise _Usage("%s must be a number, not %r" % (what, text)) from None
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        raise _Usage("%s out of range: %r" % (what, text))
    return value


MODES = {  # mode -> (positional names, options)
    "facts": ((), ("--workdir", "--modules")),
    "python": ((), ("--modules",)),
    "image-facts": ((), ("--workdir",)),
    "session": ((), ("--workdir", "--modules")),
    "listen": (("PORT", "SECONDS"), ("--bind",)),
    "connect": (("HOST", "PORT", "TIMEOUT"), ("--bind",)),
    "free-port": (("PORT",), ("--bind",)),
}


def _parse(argv: list) -> tuple:
    if not argv or argv[0] not in MODES:
        raise _Usage("unknown mode %r" % argv[0] if argv else "no mode given")
    mode, rest = argv[0], list(argv[1:])
    names, allowed = MODES[mode]
    positional, options = [], {}
    while rest:
        arg = rest.pop(0)
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if name not in allowed:
                raise _Usage("%s does not take %s" % (mode, name))
            if not eq:
                if not rest:
                    raise _Usage("%s needs a value" % name)
                value = rest.pop(0)
            options[name] = value
        else:
            positional.append(arg)
    if len(positional) != len(names):
        raise _Usage("%s takes %s" % (mode, " ".join(names) or "no positional arguments"))
    values = dict(zip(names, positional))
    if "PORT" in values:
        values["PORT"] = _number(values["PORT"], "PORT", int, 1 if mode == "connect" else 0, 65535)
    for name in ("SECONDS", "TIMEOUT"):
        if name in values:
            values[name] = _number(values[name], name, float, 0.001)
    return mode, values, options


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        mode, values, options = _parse(argv)
    except _Usage as exc:
        sys.stderr.write("probe: %s\n%s\n" % (exc, USAGE))
        return 2
    bind = options.get("--bind")
    try:
        if mode == "facts":
            wanted = [m for m in options.get("--modules", "").split(",") if m]
            _emit(facts(options.get("--workdir", "~"), wanted))
        elif mode == "python":
            _emit(python_facts([m for m in options.get("--modules", "").split(",") if m]))
        elif mode == "image-facts":
            image_facts(options.get("--workdir", "~"))
        elif mode == "session":
            session(options.get("--workdir", "~"), [m for m in options.get("--modules", "").split(",") if m])
        elif mode == "listen":
            listen(values["PORT"], values["SECONDS"], bind or "0.0.0.0")
        elif mode == "connect":
            _emit(connect(values["HOST"], values["PORT"], values["TIMEOUT"], bind))
        else:
            _emit(free_port(values["PORT"], bind or "0.0.0.0"))
    except Exception as exc:  # noqa: BLE001 - a bug: still one JSON object (listen may have printed already)
        import traceback

        traceback.print_exc()
        if mode not in ("listen", "session"):
            _emit({"probe_version": PROBE_VERSION, "errors": {"probe": _message(exc)}})
    return 0


def _exit(code: int) -> None:
    """End the process at once once every line is out: no interpreter teardown (freeing every module and object:
    ~8 ms of CPU, on every host, each check). Nothing is left to do then: each line was flushed as it was written,
    a listener and its clients are closed, no file is open for writing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader is gone
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
