"""mnft provision's facts of a host (envhost's `facts` mode, and what `install` reads of an environment): its Pythons,
platform, libc, disk, an environment's distributions and record, the SSH mesh's peers. Standard library only.
"""

import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys

from .meshpeers import mesh_peers
RECORD = ".mnft-env.json"
URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")  # an index URL's user:token, never shown (mnft.hosts.command)
VERSION_SCRIPT = "import platform,sys;print(platform.python_version());print(sys.implementation.name)"


def _emit(obj) -> None:
    try:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the controller is gone (a build it stopped): nobody reads the answer
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def root_of(venv: str) -> str:
    return os.path.abspath(os.path.expanduser(venv)).rstrip("/") + ".d"


def _existing_parent(path: str) -> str:
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


RECORD_BYTES = 16 << 20  # an environment's record (its distributions) read at most: a larger one is no record
TEXT_BYTES = 65536  # a small text file (pyvenv.cfg, os-release) read at most


def _read_json(path: str):
    try:
        with open(path, "rb") as f:
            data = f.read(RECORD_BYTES + 1)
        return json.loads(data) if len(data) <= RECORD_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None


def site_packages(env: str):
    found = sorted(glob.glob(os.path.join(env, "lib", "python*", "site-packages")))
    return found[0] if found else None


def env_python_version(env: str):
    try:
        with open(os.path.join(env, "pyvenv.cfg"), encoding="utf-8") as f:
            for line in f.read(TEXT_BYTES).splitlines():
                key, _, value = line.partition("=")
                if key.strip() in ("version_info", "version"):
                    return value.strip()
    except OSError:
        return None
    return None


def distributions(env: str) -> dict:
    """name -> version of every distribution installed in the environment, from its metadata (nothing imported)."""
    import importlib.metadata as metadata

    site = site_packages(env)
    if site is None:
        return {}
    out = {}
    for dist in metadata.distributions(path=[site]):
        name = dist.metadata["Name"]
        if name:
            out[canonical(name)] = dist.version
    return out


def describe_env(path: str) -> dict:
    """What is at an environment path (a link to an environment, a directory someone made, nothing)."""
    info = {"path": path, "exists": os.path.lexists(path), "is_link": os.path.islink(path), "target": None, "record": None,
            "python": None, "dists": None, "complete": False}
    if not info["exists"]:
        return info
    real = os.path.realpath(path)
    info["target"] = real
    if not os.path.isdir(real):
        return info
    info["record"] = _read_json(os.path.join(real, RECORD))
    info["complete"] = info["record"] is not None
    info["python"] = env_python_version(real)
    try:
        info["dists"] = distributions(real)
    except Exception as exc:  # noqa: BLE001 - a broken environment is a fact, not a crash
        info["error"] = "cannot read its distributions: %s" % exc
    return info


def _python_version(python: str):
    exe = python if "/" in python else shutil.which(python)
    if exe is None:
        return None
    exe = os.path.expanduser(exe)
    try:
        done = subprocess.run([exe, "-I", "-c", VERSION_SCRIPT], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, universal_newlines=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) < 2:
        return None
    return {"path": exe, "version": lines[0], "implementation": lines[1]}


def _libc():
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
        if name and name.startswith("glibc "):
            return {"libc": "glibc", "version": name.split()[1]}
    except (ValueError, OSError):
        pass
    musl = glob.glob("/lib/ld-musl-*.so.1")
    if musl:
        try:
            err = subprocess.run([musl[0]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 universal_newlines=True, timeout=5).stderr
            match = re.search(r"Version (\d+\.\d+)", err)
            return {"libc": "musl", "version": match.group(1) if match else None}
        except (OSError, subprocess.SubprocessError):
            return {"libc": "musl", "version": None}
    return {"libc": None, "version": None}


def _os_release():
    """The distribution and its version ("debian 12": ID and VERSION_ID of /etc/os-release), or None."""
    try:
        with open("/etc/os-release", encoding="utf-8", errors="replace") as f:
            text = f.read(TEXT_BYTES)
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition("=")
        values[key] = value.strip().strip("\"'")
    return " ".join(v for v in (values.get("ID"), values.get("VERSION_ID")) if v) or None


def facts(venv: str, pythons: list, want) -> dict:
    """pythons[0] is the interpreter running this script (the controller starts the script with it)."""
    root = root_of(venv)
    out = {"arch": platform.machine(), "system": platform.system(), "os": _os_release(), "libc": _libc(), "root": root}
    candidates, seen = [], set()
    for python in pythons + (["python%s" % want] if want else []):
        if python in seen:
            continue
        seen.add(python)
        if python == pythons[0]:  # the interpreter running this script: no need to start it again
            found = {"path": sys.executable, "version": platform.python_version(), "implementation": sys.implementation.name}
        else:
            found = _python_version(python)
        candidates.append(dict(found or {}, name=python, found=found is not None))
        if found and want and found["version"].startswith(want + ".") and found["implementation"] == "cpython":
            break  # the wanted version is there: no need to start more interpreters
    out["pythons"] = candidates
    usage = shutil.disk_usage(_existing_parent(root))
    out["disk"] = {"path": _existing_parent(root), "free_bytes": usage.free}
    path = os.path.abspath(os.path.expanduser(venv))
    try:  # opening the directory revalidates it on NFS (close-to-open): a link another host replaced is read anew
        os.scandir(os.path.dirname(path)).close()
    except OSError:
        pass
    out["env"] = describe_env(path)
    out["env"]["managed"] = (not out["env"]["exists"]) or (out["env"]["is_link"] and (out["env"]["target"] or "").startswith(root + "/envs/"))
    out["previous"] = describe_env(os.path.join(root, "previous"))
    out["previous"].pop("dists", None)
    dist = os.path.join(root, "dist")
    files = {}
    for name in (os.listdir(os.path.join(dist, "wheels")) if os.path.isdir(os.path.join(dist, "wheels")) else []):
        try:
            files[name] = os.path.getsize(os.path.join(dist, "wheels", name))
        except OSError:
            pass
    out["dist"] = {"path": dist, "wheels": files, "uv": os.path.getsize(os.path.join(dist, "uv")) if os.path.isfile(os.path.join(dist, "uv")) else None}
    out["mesh"] = mesh_peers()
    out["rsync"] = shutil.which("rsync")
    return out
