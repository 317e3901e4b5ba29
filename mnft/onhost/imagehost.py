"""mnft's container image on a host, the host side: the runtime found there and the image's identity; save, load
and place an image for `mnft sync --image`.

The controller ships this module (its payload: mnft.hosts.payload) to the host's Python (mnft.hosts.pyrun) and reads one JSON
object from stdout. Standard library only, Python >= 3.8.

    facts RUNTIME IMAGE                 the runtime and the image's identity, one JSON line (below)
    prepare DIR                         a fresh staging directory (0700, its parents made), the mesh's peers, and
                                        which other hosts' staging directories of this sync it sees (sharing)
    save RUNTIME IMAGE DIR              the image saved into DIR/image.tar (a docker-archive: see save()); a .sif
                                        linked (else copied) to DIR/image.sif
    load RUNTIME IMAGE DIR ID           DIR/image.tar loaded (podman: pulled from the docker-archive), its id
                                        verified to be ID, tagged IMAGE; DIR removed
    place IMAGE DIR ID                  a .sif: DIR/image.sif verified (sha256) and renamed to IMAGE; DIR removed
    clean DIR...                        staging directories removed (only those named like mnft's)

RUNTIME is "auto" (the first of podman, docker, apptainer, singularity on PATH; a docker whose daemon does not answer
is passed over, with the reason; an IMAGE that is a path, `/…`, `~/…` or `*.sif`, looks for apptainer and singularity
only), a kind (podman | docker | apptainer | singularity) or the absolute path of one.

facts' answer, the contract other modules read (mnft.image.runtime.Runtime.from_facts, check's rules):

    {"runtime": "podman"|"docker"|"apptainer"|"singularity"|null, "path": "/usr/bin/podman", "version": "4.3.1",
     "uid": 0, "gid": 0, "home": "/root", "rootless": false, "cdi": false, "gpus": false,
     "image": {"ref": IMAGE, "present": true, "id": "sha256:…"}, "error": null}

`id` is the image's config digest (`podman/docker image inspect --format {{.Id}}`, written "sha256:<hex>"): it is the
same after save and load on another host, where a manifest digest is not. A .sif's id is "sha256:" + the file's own
sha256, cached in ~/.cache/mnft/sif-ids.json by (path, device, inode, size, mtime): a 10 GB file is read once, not at
every check. `error` is one line (no runtime, the runtime failed: its last line of stderr), else null.

Another host module may compute the same facts in its own round-trip: `from . import imagehost;
imagehost.facts(runtime, image)` (the probe's image-facts mode).

Every program this script starts has a timeout, stdin closed (the controller's channel is this script's stdin), and
its output kept at most OUTPUT_KEPT bytes; every file read has a cap.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time

from .filehash import sha256_file
from .meshpeers import mesh_peers

KINDS = ("podman", "docker", "apptainer", "singularity")
DAEMONS = ("podman", "docker")
SIF_KINDS = ("apptainer", "singularity")
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
CDI_FILES = 64  # spec files looked at, at most
CDI_BYTES = 1 << 20  # one CDI spec read at most
CACHE_BYTES = 1 << 20  # the .sif id cache read at most (past it: started afresh)
CACHE_ENTRIES = 256
CACHE = "~/.cache/mnft/sif-ids.json"
OUTPUT_KEPT = 65536  # a program's output kept (its end)
LINE_CHARS = 300  # an error line, at most
QUICK_TIMEOUT = 20.0  # --version, a daemon's answer, nvidia-smi, inspect
MOVE_TIMEOUT = 3600.0  # save and load of an image of many GB
STAGE_PREFIX = "mnft-image-"  # staging directories: /var/tmp/mnft-image-TOKEN-HOST, or DIR/.mnft-image-TOKEN-HOST beside a .sif
ARCHIVE = "image.tar"
SIF_FILE = "image.sif"
LOADED = re.compile(r"^Loaded image(?:\(s\))?(?: ID)?:\s*(.+)$")
VERSION = re.compile(r"version\s+v?([0-9][^\s,]*)", re.I)


def _emit(obj) -> None:
    try:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the controller is gone: nobody reads the answer
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _line(text: str) -> str:
    """The last non-empty line of a text, cut to LINE_CHARS."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= LINE_CHARS else last[:LINE_CHARS] + "…"


def _kept(f) -> str:
    """The end of a program's output file: OUTPUT_KEPT bytes at most."""
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - OUTPUT_KEPT))
    return f.read(OUTPUT_KEPT).decode("utf-8", "replace")


def run(argv: list, timeout: float) -> tuple:
    """(exit code or None when it timed out, stdout's end, stderr's end); an exit code of 127 when it cannot start."""
    env = dict(os.environ, LC_ALL="C")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            code = None
        except OSError as exc:
            return 127, "", "%s: %s" % (argv[0], exc.strerror or exc)
        return code, _kept(out), _kept(err)


def _failed(what: str, code, err: str) -> str:
    if code is None:
        return "%s: no answer (timed out)" % what
    return "%s failed (exit code %s)%s" % (what, code, (": " + _line(err)) if _line(err) else "")


# ------------------------------------------------------------------------------------------------ the runtime


def is_path_image(image: str) -> bool:
    """An image given as a file (an Apptainer/Singularity .sif), not a reference a daemon's store resolves."""
    return image.startswith(("/", "~/")) or image.endswith(".sif")


def kind_of(path: str):
    """podman | docker | apptainer | singularity from an executable's name (singularity-ce too), else None."""
    name = os.path.basename(path).lower()
    for kind in KINDS:
        if name.startswith(kind):
            return kind
    return None


def _version(path: str) -> tuple:
    """(kind from its answer, version) of `PATH --version`, or raises RuntimeError with its line."""
    code, out, err = run([path, "--version"], QUICK_TIMEOUT)
    if code != 0:
        raise RuntimeError(_failed("%s --version" % path, code, err or out))
    text = out.strip() or err.strip()
    found = VERSION.search(text)
    kind = None
    for k in KINDS:
        if k in text.lower():
            kind = k
            break
    return kind, found.group(1) if found else (_line(text) or None)


def _daemon_answers(path: str):
    """None when docker's daemon answers, else why not (one line)."""
    code, out, err = run([path, "version", "--format", "{{.Server.Version}}"], QUICK_TIMEOUT)
    if code == 0 and out.strip():
        return None
    return _line(err) or _line(out) or ("no answer (timed out)" if code is None else "exit code %s" % code)


def find_runtime(runtime: str, image: str) -> dict:
    """{"runtime", "path", "version", "error"}: the runtime this host uses, as RUNTIME asks."""
    found = {"runtime": None, "path": None, "version": None, "error": None}
    if runtime == "auto":
        order = SIF_KINDS if is_path_image(image) else KINDS
        skipped = []
        for kind in order:
            path = shutil.which(kind)
            if not path:
                continue
            if kind == "docker":
                why = _daemon_answers(path)
                if why:
                    skipped.append("docker at %s skipped: its daemon does not answer (%s)" % (path, why))
                    continue
            return _described(kind, path)
        found["error"] = "no container runtime found on PATH (%s)%s" % (", ".join(order), "; " + "; ".join(skipped) if skipped else "")
        return found
    if runtime in KINDS:
        path = shutil.which(runtime)
        if not path:
            found["error"] = "%s not found on PATH (%s)" % (runtime, os.environ.get("PATH", ""))
            return found
        described = _described(runtime, path)
    elif runtime.startswith("/"):
        if not (os.path.isfile(runtime) and os.access(runtime, os.X_OK)):
            found["error"] = "container runtime %s: no such executable on this host" % runtime
            return found
        described = _described(kind_of(runtime), runtime)
    else:
        found["error"] = "container runtime %r: use auto, one of %s, or an absolute path" % (runtime, ", ".join(KINDS))
        return found
    if described["error"] is None and described["runtime"] == "docker":
        why = _daemon_answers(described["path"])
        if why:
            described["error"] = "docker at %s: its daemon does not answer (%s)" % (described["path"], why)
    return described


def _described(kind, path: str) -> dict:
    out = {"runtime": kind, "path": path, "version": None, "error": None}
    try:
        said, out["version"] = _version(path)
    except RuntimeError as exc:
        out["error"] = str(exc)
        return out
    if out["runtime"] is None:
        out["runtime"] = said
    if out["runtime"] is None:
        out["error"] = "%s is none of %s (its --version answer names none of them)" % (path, ", ".join(KINDS))
    return out


def cdi_gpus() -> bool:
    """A CDI spec describing nvidia.com/gpu devices (NVIDIA Container Toolkit's `nvidia-ctk cdi generate`)."""
    seen = 0
    for folder in CDI_DIRS:
        for path in sorted(glob.glob(os.path.join(folder, "*"))):
            if not path.endswith((".yaml", ".yml", ".json")) or seen >= CDI_FILES:
                continue
            seen += 1
            try:
                with open(path, "rb") as f:
                    if b"nvidia.com/gpu" in f.read(CDI_BYTES):
                        return True
            except OSError:
                continue
    return False


def has_gpus() -> bool:
    """nvidia-smi on PATH lists at least one GPU."""
    path = shutil.which("nvidia-smi")
    if not path:
        return False
    code, out, _ = run([path, "-L"], QUICK_TIMEOUT)
    return code == 0 and any(line.startswith("GPU ") for line in out.splitlines())


# ------------------------------------------------------------------------------------------------ the image's identity


def normal_id(text: str):
    """An image id as podman ("hex") or docker ("sha256:hex") prints it, as "sha256:hex"; None if it is not one."""
    text = (text or "").strip()
    hexpart = text[7:] if text.startswith("sha256:") else text
    return "sha256:" + hexpart.lower() if re.fullmatch(r"[0-9a-fA-F]{64}", hexpart) else None


def _not_found(err: str) -> bool:
    low = err.lower()
    return "no such image" in low or "image not known" in low or "not found" in low or "no such object" in low


def daemon_image(path: str, image: str) -> tuple:
    """(present, id, error) of an image in a podman/docker store."""
    code, out, err = run([path, "image", "inspect", "--format", "{{.Id}}", image], QUICK_TIMEOUT * 3)
    if code == 0:
        found = normal_id(out.strip().splitlines()[0] if out.strip() else "")
        if found is None:
            return False, None, "%s image inspect gave no image id: %s" % (path, _line(out) or "no output")
        return True, found, None
    if code is not None and _not_found(err):
        return False, None, None
    return False, None, _failed("%s image inspect" % path, code, err)


def _cache_key(path: str, st) -> str:
    return "%s|%d|%d|%d|%d" % (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _load_cache() -> dict:
    try:
        with open(os.path.expanduser(CACHE), "rb") as f:
            data = f.read(CACHE_BYTES + 1)
    except OSError:
        return {}
    if len(data) > CACHE_BYTES:
        return {}
    try:
        cache = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return {k: v for k, v in cache.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(cache, dict) else {}


def _save_cache(cache: dict) -> None:
    path = os.path.expanduser(CACHE)
    keep = dict(list(cache.items())[-CACHE_ENTRIES:])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".sif-ids.", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(keep, f)
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: the next check hashes the file again


def remember(path: str, digest: str) -> None:
    """A .sif's sha256 known already (placed by `place`): cached, so the next facts need not read it."""
    try:
        st = os.stat(path)
    except OSError:
        return
    cache = _load_cache()
    cache.pop(_cache_key(path, st), None)
    cache[_cache_key(path, st)] = digest
    _save_cache(cache)


def sif_image(image: str) -> tuple:
    """(present, id, error) of a .sif file: its sha256, from the cache when the file is unchanged."""
    path = os.path.abspath(os.path.expanduser(image))
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False, None, None
        return False, None, "%s: %s" % (path, exc.strerror or exc)
    if not stat.S_ISREG(st.st_mode):
        return False, None, "%s is not a file" % path
    key = _cache_key(path, st)
    cache = _load_cache()
    if key in cache and normal_id(cache[key]):
        return True, normal_id(cache[key]), None
    try:
        digest = "sha256:" + sha256_file(path)
    except OSError as exc:
        return False, None, "%s: %s" % (path, exc.strerror or exc)
    cache = {k: v for k, v in cache.items() if not k.startswith(path + "|")}
    cache[key] = digest
    _save_cache(cache)
    return True, digest, None


def facts(runtime: str, image: str) -> dict:
    """The contract above: which runtime, as whom, GPUs and CDI, and the image's id on this host."""
    found = find_runtime(runtime, image)
    uid, gid = os.getuid(), os.getgid()
    out = {"runtime": found["runtime"], "path": found["path"], "version": found["version"], "uid": uid, "gid": gid,
           "home": os.path.expanduser("~"), "rootless": found["runtime"] == "podman" and uid != 0, "cdi": cdi_gpus(),
           "gpus": has_gpus(), "image": {"ref": image, "present": False, "id": None}, "error": found["error"]}
    if found["runtime"] in SIF_KINDS or (found["runtime"] is None and is_path_image(image)):
        present, ident, why = sif_image(image)  # a file: known without the runtime
    elif found["runtime"] in DAEMONS and found["error"] is None:
        present, ident, why = daemon_image(found["path"], image)
    else:
        present, ident, why = False, None, None
    out["image"]["present"], out["image"]["id"] = present, ident
    out["error"] = out["error"] or why
    return out


# ------------------------------------------------------------------------------------------------ moving an image


class Failure(Exception):
    pass


def _stage_dir(path: str) -> str:
    """A staging directory of mnft's (refused otherwise: clean and load remove it)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.basename(path).lstrip(".").startswith(STAGE_PREFIX):
        raise Failure("%s is not a staging directory of mnft's" % path)
    return path


def prepare(folder: str) -> dict:
    """A fresh staging directory, FOLDER = …/[.]mnft-image-TOKEN-HOST (never one that exists: TOKEN is the controller's,
    random). "seen": the HOSTs of the other staging directories of this TOKEN beside it: hosts that see them share
    the directory (an NFS home holding a .sif): the later to prepare sees the earlier's, so seeing taken both ways
    finds every group (mnft.sync.mirror.groups_of)."""
    path = _stage_dir(folder)
    parent, name = os.path.split(path)
    token = name.rsplit("-", 1)[0] + "-"
    os.makedirs(parent, exist_ok=True)
    os.mkdir(path, 0o700)
    seen = sorted(other[len(token):] for other in os.listdir(parent) if other.startswith(token) and other != name)
    usage = shutil.disk_usage(path)
    return {"ok": True, "dir": path, "free_bytes": usage.free, "mesh": mesh_peers(), "seen": seen, "error": None}


def _runtime_path(runtime: str, image: str) -> tuple:
    found = find_runtime(runtime, image)
    if found["error"] or found["runtime"] not in DAEMONS:
        raise Failure(found["error"] or "%s has no image store to save to or load into" % found["runtime"])
    return found["runtime"], found["path"]


def save(runtime: str, image: str, folder: str) -> dict:
    """The image as a docker-archive: podman and docker both load it, and it keeps the image's id (its config, byte
    for byte). An oci-archive does not, for an image of docker's manifest type (an NGC image, one docker built, one
    loaded from a docker-archive): podman writes its config anew and the id changes."""
    folder = _stage_dir(folder)
    if is_path_image(image):  # a .sif: the file itself, linked into the staging directory beside it (no copy)
        staged, target = os.path.join(folder, SIF_FILE), os.path.abspath(os.path.expanduser(image))
        try:
            os.link(target, staged)
        except OSError:
            shutil.copy2(target, staged)
        return {"ok": True, "file": staged, "bytes": os.path.getsize(staged), "error": None}
    kind, path = _runtime_path(runtime, image)
    archive = os.path.join(folder, ARCHIVE)
    argv = [path, "save", "-o", archive, image] if kind == "docker" else [path, "save", "--format", "docker-archive", "-o", archive, image]
    code, out, err = run(argv, MOVE_TIMEOUT)
    if code != 0:
        raise Failure(_failed("%s save" % kind, code, err or out))
    return {"ok": True, "file": archive, "bytes": os.path.getsize(archive), "error": None}


def _image_ids(path: str) -> set:
    code, out, err = run([path, "images", "--quiet", "--no-trunc"], QUICK_TIMEOUT * 3)
    if code != 0:
        raise Failure(_failed("%s images" % path, code, err))
    return {i for i in (normal_id(line) for line in out.split()) if i}


def _names(path: str, ident: str) -> list:
    """The names (repository:tag) an image still has; unknown: taken as some (nothing is removed then)."""
    code, out, _ = run([path, "image", "inspect", "--format", "{{range .RepoTags}}{{.}} {{end}}", ident], QUICK_TIMEOUT * 3)
    return out.split() if code == 0 else ["?"]


def load(runtime: str, image: str, folder: str, want: str) -> dict:
    """Load the archive, keep it only if it is the image `want` names (else remove what it brought, and give the
    name back to the image that held it), tag it IMAGE. The staging directory is removed in every case."""
    folder = _stage_dir(folder)
    try:
        kind, path = _runtime_path(runtime, image)
        want = normal_id(want) or want
        before = _image_ids(path)
        _, old, _ = daemon_image(path, image)
        archive = os.path.join(folder, ARCHIVE)
        if kind == "podman":  # `podman load` first unpacks the whole archive as an OCI one (≈ 3 s a GB) before it tries
            code, out, err = run([path, "pull", "--quiet", "docker-archive:" + archive], MOVE_TIMEOUT)  # docker's: no network
            loaded = [line.strip() for line in out.splitlines()[-1:]]  # --quiet: the id it stored
        else:
            code, out, err = run([path, "load", "-i", archive], MOVE_TIMEOUT)
            loaded = []
            for line in (out + "\n" + err).splitlines():
                match = LOADED.match(line.strip())
                if match:
                    loaded += [name.strip() for name in match.group(1).split(",") if name.strip()]
        if code != 0:
            raise Failure(_failed("%s load" % kind, code, err or out))
        ids = set()
        for name in loaded:
            ident = normal_id(name) or daemon_image(path, name)[1]
            if ident:
                ids.add(ident)
        if want not in (ids or _image_ids(path)):  # what the archive brought, by the names the load printed
            for ident in sorted(ids - before):  # what the archive brought is not the image: it goes
                run([path, "rmi", "--force", ident], QUICK_TIMEOUT * 3)
            if old:
                run([path, "tag", old, image], QUICK_TIMEOUT)
            got = ", ".join(sorted(ids)) or "nothing that could be named"
            raise Failure("the loaded image is %s, not %s: removed" % (got, want))
        code, _, err = run([path, "tag", want, image], QUICK_TIMEOUT)
        if code != 0:
            raise Failure(_failed("%s tag" % kind, code, err))
        if old and old != want and not _names(path, old):  # --force: the image that held the name, if it has no other
            run([path, "rmi", old], QUICK_TIMEOUT * 3)  # (podman's rmi by id would take its other names with it)
        _, ident, why = daemon_image(path, image)
        if ident != want:
            raise Failure("after the load %s is %s, not %s%s" % (image, ident or "absent", want, ": " + why if why else ""))
        return {"ok": True, "id": ident, "replaced": old if old and old != want else None, "error": None}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def place(image: str, folder: str, want: str) -> dict:
    """A .sif sent into a staging directory beside its place: verified by sha256, then renamed into place (one
    rename: a reader sees the old file or the new one, never half of one). The staging directory is removed."""
    folder = _stage_dir(folder)
    try:
        staged = os.path.join(folder, SIF_FILE)
        digest = "sha256:" + sha256_file(staged)
        if digest != normal_id(want):
            raise Failure("the file received is %s, not %s: removed" % (digest, want))
        target = os.path.abspath(os.path.expanduser(image))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.chmod(staged, 0o644)
        os.replace(staged, target)
        remember(target, digest)
        return {"ok": True, "id": digest, "error": None}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def clean(folders: list) -> dict:
    gone = []
    for folder in folders:
        path = _stage_dir(folder)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return {"ok": True, "removed": gone, "error": None}


def main(argv: list) -> int:
    arity = {"facts": 2, "prepare": 1, "save": 3, "load": 4, "place": 3}
    mode = argv[0] if argv else None
    if mode not in arity and mode != "clean" or (mode in arity and len(argv) != arity[mode] + 1):
        sys.stderr.write("usage: imagehost.py facts RUNTIME IMAGE | prepare DIR | save RUNTIME IMAGE DIR | "
                         "load RUNTIME IMAGE DIR ID | place IMAGE DIR ID | clean DIR...\n")
        return 2
    started = time.monotonic()
    try:
        if mode == "facts":
            reply = facts(argv[1], argv[2])
        elif mode == "prepare":
            reply = prepare(argv[1])
        elif mode == "save":
            reply = save(*argv[1:])
        elif mode == "load":
            reply = load(*argv[1:])
        elif mode == "place":
            reply = place(*argv[1:])
        else:
            reply = clean(argv[1:])
    except Failure as exc:
        reply = {"ok": False, "error": str(exc)}
    except OSError as exc:
        reply = {"ok": False, "error": "%s%s" % (exc.strerror or exc, ": " + exc.filename if getattr(exc, "filename", None) else "")}
    if mode != "facts":
        reply["seconds"] = round(time.monotonic() - started, 3)
    _emit(reply)
    return 0
