"""Container images for the test bed, made on this machine: no registry, no network, and no podman to build them.

An image is written directly as a docker-archive, the format `podman load -i` reads: manifest.json, the image's
config and one uncompressed layer, a tar of its root filesystem in sorted order, owned by root, directories dated
`EPOCH` (files keep their own times, so that Python's .pyc files stay valid for their sources). Its id, what
`podman image inspect --format '{{.Id}}'` prints, is the sha256 of the config, which names the layer's digest: the
same inputs give the same id, build after build, and on every host that loads the archive.

    tiny_image("a")  localhost/mnft-tiny:a, ≈ 2 MB: /bin/sh (dash), sleep and their libraries; /etc/mnft-tiny holds
                     the tag, so :a and :b are two different images (relay and identity tests)
    torch_image()    localhost/mnft-torch:<key>: this machine's Python (at /usr/local, `python3` and `python` on
                     PATH) with CPU torch, transformers, peft, tokenizers, safetensors, numpy, pyyaml, huggingface_hub
                     and what they require: what mnft's recipes import under torchrun

Both return an `Image` (ref, id, archive): `Cluster.load_image(hosts, image)` copies it into hosts' storage,
`Cluster.share_image(hosts, image)` lists a read-only store of it in theirs (at once, after its first time). The torch
archive (≈ 1 GB) is built once and kept in `CACHE` (/var/cache/mnft-test-images; MNFT_TEST_IMAGE_CACHE overrides)
under a key made of the Python version, the C library, every distribution's name and version and this file's
source: a later session finds it and loads it in seconds. A new key's archive replaces the old one.

Why not `podman import` of a rootfs tarball: it writes into some podman storage (the machine's default one, which
should stay as it is, or a build storage to clean up), stamps the image with the time of import (a new id every
build), and costs one more copy of the layer.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE", "TORCH_ROOTS", "Image", "build", "cached", "read_archive", "tiny_image", "torch_image", "write_layer"]

CACHE = Path(os.environ.get("MNFT_TEST_IMAGE_CACHE") or "/var/cache/mnft-test-images")
EPOCH = 1704067200  # 2024-01-01: the date of every directory and of the image itself
CREATED = "2024-01-01T00:00:00Z"
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MULTIARCH = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
LIBDIR = f"usr/lib/{MULTIARCH}"  # every library goes here: on the loader's own search path, no ld.so.cache needed
PYTHON_HOME = "usr/local"  # the interpreter's prefix inside the image (it finds its stdlib from its own location)
TORCH_ROOTS = ("torch", "transformers", "peft", "tokenizers", "safetensors", "numpy", "pyyaml", "huggingface_hub")
STDLIB_LEFT_OUT = ("test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages", "config-")
SITE_LEFT_OUT = ("torch/include/", "torch/test/", "torch/bin/")  # headers and C++ test programs: ≈ 200 MB
SITE_KEPT = ("torch/bin/torch_shm_manager",)  # torch.multiprocessing's file_system sharing starts it
BUILDER = Path(__file__).resolve()


@dataclass(frozen=True)
class Image:
    ref: str  # "localhost/mnft-tiny:a": the name it is loaded under
    id: str  # 64 hex digits: the config's sha256, what `podman image inspect --format '{{.Id}}'` prints
    archive: Path  # a docker-archive for `podman load -i`


# A root filesystem: {path inside the image, without the leading "/": what is there}.
@dataclass(frozen=True)
class Link:
    target: str


@dataclass(frozen=True)
class Data:
    content: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class Dir:
    mode: int = 0o755


Entry = Path | Data | Link | Dir  # a Path is a file of this machine, copied with its mode and time
Root = dict[str, Entry]


# --------------------------------------------------------------------------------------------------- images


def tiny_image(tag: str = "a", directory: Path | None = None) -> Image:
    """`localhost/mnft-tiny:<tag>`: dash as /bin/sh, sleep, libc; its content (/etc/mnft-tiny) is the tag, so every
    tag is a different image. Built in milliseconds, every call, into `directory` (default CACHE)."""
    if not re.match(r"^[a-z0-9][a-z0-9_.-]{0,63}$", tag):
        raise ValueError(f"bad tag {tag!r}")
    root = _base_root(["/usr/bin/dash", "/usr/bin/sleep"])
    root["usr/bin/sh"] = Link("dash")
    root["etc/mnft-tiny"] = Data(f"{tag}\n".encode())
    directory = Path(directory or CACHE)
    directory.mkdir(parents=True, exist_ok=True)
    return build(root, f"localhost/mnft-tiny:{tag}", directory / f"mnft-tiny-{tag}.tar", cmd=["/bin/sh"])


def torch_image(cache: Path | None = None) -> Image:
    """`localhost/mnft-torch:<key>`: this machine's Python with torch and the distributions mnft's recipes need
    (TORCH_ROOTS and everything they require), from CACHE when it was built before, else built there (≈ 1 GB)."""
    dists = _closure(TORCH_ROOTS)
    key = _key(["torch", sys.version, *platform.libc_ver(), *sorted(f"{d.metadata['Name']}=={d.version}" for d in dists)])
    cache = Path(cache or CACHE)
    archive = cache / f"mnft-torch-{key}.tar"
    return cached(archive, lambda: build(_torch_root(dists), f"localhost/mnft-torch:{key}", archive, cmd=["python3"]),
                  stale="mnft-torch-*.tar")


def cached(archive: Path, make: Callable[[], Image], *, stale: str = "") -> Image:
    """The image in `archive`, made by `make` first when it is not there (one session at a time builds: a lock in
    its directory); then the directory's other archives matching `stale` are removed."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    with open(archive.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if archive.is_file():
            return read_archive(archive)
        image = make()
        for old in archive.parent.glob(stale) if stale else ():
            if old != archive:
                old.unlink(missing_ok=True)
        return image


def read_archive(archive: Path) -> Image:
    """The ref and id of the image in a docker-archive written by `build` (manifest.json is its first member)."""
    with tarfile.open(archive) as tar:
        member = tar.next()
        if member is None or member.name != "manifest.json":
            raise ValueError(f"{archive}: not an archive written by tests/images.py (no manifest.json first)")
        manifest = json.load(tar.extractfile(member))[0]
    return Image(ref=manifest["RepoTags"][0], id=manifest["Config"].removesuffix(".json"), archive=archive)


def build(root: Root, ref: str, archive: Path, *, cmd: list[str], env: dict[str, str] | None = None) -> Image:
    """Write `root` as image `ref` into the docker-archive `archive` (atomically: a reader never sees half of it)."""
    layer = archive.with_name(f"{archive.name}.{os.getpid()}.layer")  # a writer of its own: sessions run side by side
    partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
    try:
        diff_id = write_layer(root, layer)
        os.utime(layer, (EPOCH, EPOCH))  # the archive's bytes too are the same for the same inputs
        config = _config(diff_id, cmd, {"PATH": IMAGE_PATH, "LANG": "C.UTF-8", **(env or {})})
        image_id = hashlib.sha256(config).hexdigest()
        manifest = json.dumps([{"Config": f"{image_id}.json", "RepoTags": [ref], "Layers": ["layer.tar"]}]).encode()
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT, copybufsize=1 << 20) as tar:
            _add(tar, "manifest.json", Data(manifest))
            _add(tar, f"{image_id}.json", Data(config))
            _add(tar, "layer.tar", layer)
        os.replace(partial, archive)
    finally:
        layer.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    return Image(ref=ref, id=image_id, archive=archive)


def write_layer(root: Root, path: Path) -> str:
    """Write the tar of `root` (sorted, every missing parent directory added) to `path`; returns "sha256:<hex>"."""
    entries = dict(root)
    for name in list(root):
        parts = name.split("/")
        for depth in range(1, len(parts)):
            entries.setdefault("/".join(parts[:depth]), Dir())
    with open(path, "wb") as out:
        hashing = _Hashing(out)
        with tarfile.open(fileobj=hashing, mode="w", format=tarfile.PAX_FORMAT, copybufsize=1 << 20) as tar:
            for name in sorted(entries):
                _add(tar, name, entries[name])
    return "sha256:" + hashing.sha.hexdigest()


# --------------------------------------------------------------------------------------------------- root filesystems


def _base_root(programs: Iterable[str]) -> Root:
    """A merged-/usr root with /etc/passwd and /etc/group (root, nobody), /tmp, and `programs` (paths here) at their
    own paths with the libraries they load."""
    root: Root = {
        "bin": Link("usr/bin"), "sbin": Link("usr/sbin"), "lib": Link("usr/lib"), "lib64": Link("usr/lib64"),
        "etc/passwd": Data(b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
        "etc/group": Data(b"root:x:0:\nnogroup:x:65534:\n"),
        "tmp": Dir(0o1777), "var/tmp": Dir(0o1777), "root": Dir(0o700), "usr/sbin": Dir(), "usr/local/bin": Dir(),
    }
    for program in programs:
        root[_in_usr(program)] = Path(program)
    root.update(_libraries(root))
    return root


def _torch_root(dists: list[importlib.metadata.Distribution]) -> Root:
    """The interpreter at /usr/local (bin/python3.11, python3, python; its stdlib less tests, IDLE and tkinter),
    the distributions' files in its site-packages (their scripts in /usr/local/bin), and every library they load."""
    prefix = os.path.realpath(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = os.path.join(prefix, "lib", version)
    site = os.path.join(stdlib, "site-packages")
    root = _base_root(["/usr/bin/dash", "/usr/bin/env"])
    root["usr/bin/sh"] = Link("dash")
    root[f"{PYTHON_HOME}/bin/{version}"] = Path(os.path.realpath(sys.executable))
    root[f"{PYTHON_HOME}/bin/python3"] = Link(version)
    root[f"{PYTHON_HOME}/bin/python"] = Link(version)
    for top, dirs, files in os.walk(stdlib):
        rel = os.path.relpath(top, stdlib)
        if rel == ".":
            dirs[:] = [d for d in dirs if not d.startswith(STDLIB_LEFT_OUT)]
        for name in files:
            if not name.startswith("_tkinter"):
                root[os.path.normpath(f"{PYTHON_HOME}/lib/{version}/{rel}/{name}")] = Path(top, name)
    for dist in dists:
        for file in dist.files or ():
            path = os.path.normpath(os.path.join(site, file))  # RECORD paths are relative to site-packages
            rel = os.path.relpath(path, site)
            if path.startswith(site + "/") and (rel in SITE_KEPT or not rel.startswith(SITE_LEFT_OUT)):
                root[f"{PYTHON_HOME}/lib/{version}/site-packages/{rel}"] = Path(path)
            elif os.path.dirname(path) == os.path.join(prefix, "bin") and os.path.isfile(path):
                root[f"{PYTHON_HOME}/bin/{os.path.basename(path)}"] = _script(Path(path), prefix, version)
    root.update(_libraries(root))
    return root


def _script(path: Path, prefix: str, version: str) -> Entry:
    """A console script whose first line runs this machine's interpreter, made to run the image's instead."""
    content = path.read_bytes()
    first, _, rest = content.partition(b"\n")
    if not first.startswith(b"#!" + prefix.encode()):
        return path
    return Data(f"#!/{PYTHON_HOME}/bin/{version}".encode() + b"\n" + rest, 0o755)


def _libraries(root: Root) -> Root:
    """The shared libraries the ELF files of `root` load that `root` does not hold (by `ldd`), in LIBDIR under the
    names they are loaded by, and the dynamic loader at its own path."""
    inside = {os.path.normpath(entry) for entry in root.values() if isinstance(entry, Path)}
    elves = sorted(path for path in inside if _is_elf(path))
    found: Root = {}
    missing: set[str] = set()
    for start in range(0, len(elves), 64):
        ldd = ["ldd", *elves[start:start + 64]]  # exits 1 when one file is not dynamic: its lines say so
        out = subprocess.run(ldd, capture_output=True, text=True, timeout=120, check=False).stdout
        for line in out.splitlines():
            m = re.match(r"^\s+(\S+) => (.+?)(?: \(0x[0-9a-f]+\))?$", line)
            if m and m.group(2) == "not found":
                missing.add(m.group(1))
            elif m and os.path.realpath(m.group(2)) not in inside:
                found[f"{LIBDIR}/{m.group(1)}"] = Path(os.path.realpath(m.group(2)))
            elif not m and (loader := re.match(r"^\s+(/\S+) \(0x[0-9a-f]+\)$", line)):
                found[_in_usr(loader.group(1))] = Path(os.path.realpath(loader.group(1)))
    if missing:
        raise RuntimeError(f"libraries that files of the image load are not on this machine: {', '.join(sorted(missing))}")
    return found


def _closure(roots: Iterable[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `roots` and everything they require (no extras; markers of this machine)."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    wanted = [(name, True) for name in roots]
    while wanted:
        name, needed = wanted.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(key)
        except importlib.metadata.PackageNotFoundError:
            if needed:
                raise RuntimeError(f"the torch image needs {name}, which is not installed here") from None
            continue  # a requirement not installed here: what is installed imports without it
        seen[key] = dist
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append((requirement.name, False))
    return [seen[key] for key in sorted(seen)]


# --------------------------------------------------------------------------------------------------- tar, config


def _add(tar: tarfile.TarFile, name: str, entry: Entry) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = EPOCH
    if isinstance(entry, Dir):
        info.type, info.mode = tarfile.DIRTYPE, entry.mode
        tar.addfile(info)
    elif isinstance(entry, Link):
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.target, 0o777
        tar.addfile(info)
    elif isinstance(entry, Data):
        info.size, info.mode = len(entry.content), entry.mode
        tar.addfile(info, io.BytesIO(entry.content))
    else:
        with open(entry, "rb") as f:
            st = os.fstat(f.fileno())
            info.size, info.mode, info.mtime = st.st_size, st.st_mode & 0o7777, int(st.st_mtime)
            tar.addfile(info, f)


def _config(diff_id: str, cmd: list[str], env: dict[str, str]) -> bytes:
    config = {
        "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine()),
        "os": "linux",
        "created": CREATED,
        "config": {"Env": [f"{k}={v}" for k, v in env.items()], "Cmd": cmd, "Labels": {"org.mnft.test-image": "1"}},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": CREATED, "created_by": "mnft tests/images.py"}],
    }
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


class _Hashing:
    """A write-only file that hashes what passes through it (tarfile needs write and tell)."""

    def __init__(self, out: io.BufferedWriter):
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)

    def tell(self) -> int:
        return self.size


def _key(parts: Iterable[str]) -> str:
    digest = hashlib.sha256("\0".join(parts).encode())
    digest.update(BUILDER.read_bytes())
    return digest.hexdigest()[:16]


def _in_usr(path: str) -> str:
    """A path of this machine inside a merged-/usr image: /lib64/x is usr/lib64/x, /usr/bin/x usr/bin/x."""
    rel = path.lstrip("/")
    return f"usr/{rel}" if rel.split("/", 1)[0] in ("bin", "sbin", "lib", "lib64") else rel


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False
