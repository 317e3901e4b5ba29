"""What a detached run's supervisor runs on its host: mnft and the controller's libraries it needs, as one tar.gz.

The controller ships what it runs itself: mnft's package (its source tree) and the installed files of the
distributions the supervision loop imports (Fabric, paramiko, PyYAML, rich, psutil, packaging and everything they
require), read from their RECORD. The bundle is named by the sha256 of its files, and built once per set of
files (a stamp of their paths, sizes and modification times is kept beside it), so a second run costs no hashing.

A host can run the bundle when its Python is >= mnft's requires-python and, where the bundle holds compiled
modules (cryptography, PyYAML's C loader, psutil), when each such distribution's wheel tags are among the host's
(same CPython minor, machine, a glibc at least as new: mnft.env.wheelhouse.Platform); a distribution installed
without a wheel's tags (a distribution's own package) is taken to need the controller's exact platform.
`compatible` says why not, with the fix.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import sys
import tarfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mnft.core.errors import InputError
from mnft.hosts.hostkeys import mnft_home

ROOTS = ("fabric", "paramiko", "invoke", "pyyaml", "rich", "psutil", "packaging", "tomli")  # what mnft.run.train and its supervision import
NEVER = frozenset({"mnft", "torch", "pip", "setuptools", "wheel"})  # mnft is shipped from its source; the rest are never needed there
COMPILED = (".so", ".pyd", ".dylib")
MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class Dist:
    name: str
    version: str
    files: tuple[tuple[str, Path], ...]  # (path inside site/, file here); () when read back from a stamp
    tags: tuple[str, ...]  # the wheel's tags (WHEEL), () when installed without them
    compiled: bool = False  # holds an extension module (.so): the host must take its tags

    @classmethod
    def of(cls, name: str, version: str, files: tuple[tuple[str, Path], ...], tags: tuple[str, ...]) -> "Dist":
        return cls(name, version, files, tags, any(arc.endswith(COMPILED) for arc, _ in files))

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "tags": list(self.tags), "compiled": self.compiled}


@dataclass(frozen=True)
class Bundle:
    digest: str
    path: Path  # the tar.gz
    dists: tuple[Dist, ...]
    python: tuple[int, int]
    machine: str
    libc: tuple[str | None, str | None]

    def compiled(self) -> list[Dist]:
        return [d for d in self.dists if d.compiled]


def _closure(roots: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions of roots and of everything they require (markers judged here), mnft's never."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name in NEVER:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional root (tomli on 3.11) or a requirement whose marker left it out
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return [seen[k] for k in sorted(seen)]


def _files(dist: metadata.Distribution, tops: dict[str, list[str]]) -> tuple[tuple[str, Path], ...]:
    """A distribution's installed files as its RECORD lists them; one installed without a RECORD (a system
    package's egg-info) by its top-level packages and its metadata directory instead."""
    base = Path(str(dist.locate_file(""))).resolve()
    items = [Path(str(dist.locate_file(item))).resolve() for item in dist.files or [] if "__pycache__" not in item.parts]
    if not dist.files:
        name = dist.metadata["Name"]
        found = [base / top for top, owners in tops.items() if name in owners]
        found += [base / f"{top}.py" for top, owners in tops.items() if name in owners]
        meta = getattr(dist, "_path", None)
        found += [Path(str(meta))] if meta is not None else []
        items = [p.resolve() for root in found if root.exists() for p in ([root] if root.is_file() else root.rglob("*"))
                 if "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return tuple((p.relative_to(base).as_posix(), p) for p in items if p.is_file() and base in p.parents)


def _package_files() -> tuple[tuple[str, Path], ...]:
    import mnft

    root = Path(mnft.__file__).resolve().parent
    return tuple((("mnft/" + p.relative_to(root).as_posix()), p) for p in sorted(root.rglob("*"))
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def dists(closure: list[metadata.Distribution] | None = None) -> tuple[Dist, ...]:
    out = []
    tops = metadata.packages_distributions()
    for dist in _closure(ROOTS) if closure is None else closure:
        wheel = dist.read_text("WHEEL") or ""
        tags = tuple(line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:"))
        out.append(Dist.of(canonicalize_name(dist.metadata["Name"]), dist.version, _files(dist, tops), tags))
    return tuple(out)


def _installed_at(dist: metadata.Distribution) -> list:
    """What changes when a distribution is installed again: its metadata directory's RECORD (or the directory)."""
    where = getattr(dist, "_path", None)  # importlib.metadata's PathDistribution: its .dist-info / .egg-info
    if where is None:
        return [None]
    record = Path(str(where)) / "RECORD"
    info = (record if record.is_file() else Path(str(where))).stat()
    return [str(where), info.st_size, info.st_mtime_ns]


def _stamped(root: Path | None) -> tuple[list[metadata.Distribution], dict, Path, Path]:
    """The stamp of what the bundle would hold, cheap to take (the distributions' RECORD files and mnft's own files
    by size and time, no file read): its file beside the bundles names the digest and the distributions' facts."""
    closure = _closure(ROOTS)
    key = [[d.metadata["Name"], d.version, *_installed_at(d)] for d in closure]
    key += [[arc, p.stat().st_size, p.stat().st_mtime_ns] for arc, p in _package_files()]
    stamp = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    home = root or mnft_home() / "supervisor"
    libc = platform.libc_ver()
    facts = dict(python=sys.version_info[:2], machine=platform.machine(), libc=(libc[0] or None, libc[1] or None))
    return closure, facts, home, home / f"stamp-{stamp[:32]}.json"


def _read_stamp(known: Path) -> tuple[str, tuple[Dist, ...]]:
    """(digest, the distributions' facts) a stamp file names; ("", ()) when there is none or it is not one."""
    from mnft.core import limits

    try:
        data = limits.read_json(known, limits.STATE_BYTES, "the supervisor bundle's stamp", "STATE_BYTES", missing=None)
        found = tuple(Dist(str(d["name"]), str(d["version"]), (), tuple(str(t) for t in d["tags"]), d["compiled"] is True) for d in data["dists"])
        return str(data["digest"]), found
    except (InputError, KeyError, TypeError):
        return "", ()


def described(root: Path | None = None) -> Bundle:
    """The bundle as `compatible` judges it, without building it (`mnft check`): its digest when it was built for
    these very files, else "" (a host then has no such bundle yet)."""
    closure, facts, home, known = _stamped(root)
    digest, found = _read_stamp(known)
    return Bundle(digest, home / f"{digest}.tar.gz", found if digest else dists(closure), **facts)


def build(root: Path | None = None) -> Bundle:
    """The bundle of this controller's mnft and libraries, built at most once for the same files."""
    closure, facts, home, known = _stamped(root)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    digest, found = _read_stamp(known)
    if digest and (home / f"{digest}.tar.gz").is_file():
        return Bundle(digest, home / f"{digest}.tar.gz", found, **facts)
    found = dists(closure)
    members = [f for d in found for f in d.files] + list(_package_files())
    h = hashlib.sha256()
    for arc, path in sorted(members):
        h.update(arc.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    digest = h.hexdigest()[:32]
    target = home / f"{digest}.tar.gz"
    if not target.is_file():
        tmp = home / f".{digest}.{os.getpid()}.tmp"
        with tmp.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w") as tar:
            for arc, path in sorted(members):
                info = tar.gettarinfo(str(path), arcname="site/" + arc)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
        os.replace(tmp, target)
    known.write_text(json.dumps({"digest": digest, "dists": [d.to_json() for d in found]}))
    prune(home, keep=digest)
    return Bundle(digest, target, found, **facts)


KEEP = 3  # bundles kept here (the newest): a controller that upgrades mnft does not fill its disk


def prune(home: Path, keep: str) -> None:
    """The older bundles and stamps here beyond the KEEP newest (this controller's own cache, rebuilt when needed)."""
    bundles = sorted(home.glob("*.tar.gz"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in bundles[KEEP:]:
        if old.name != f"{keep}.tar.gz":
            old.unlink(missing_ok=True)
    stamps = sorted(home.glob("stamp-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in stamps[4 * KEEP:]:
        old.unlink(missing_ok=True)


def compatible(bundle: Bundle, host: dict) -> str | None:
    """Why the host (superhost's look) cannot run the bundle, with the fix; None when it can."""
    python = tuple(host.get("python") or ())[:2]
    shown = ".".join(str(x) for x in python) or "?"
    if python < MIN_PYTHON:
        return (f"its Python ({host.get('executable')}) is {shown}; mnft needs ≥ {'.'.join(map(str, MIN_PYTHON))}: "
                "set the inventory's python for that host to a newer one")
    if host.get("system") != "Linux":
        return f"it runs {host.get('system')}, not Linux"
    from mnft.env.wheelhouse import Platform

    libc = host.get("libc") or [None, None]
    platform_ = Platform(".".join(str(x) for x in python), str(host.get("machine")), "glibc" if libc[0] == "glibc" else libc[0], libc[1])
    accepted = {str(t) for t in platform_.tags()}
    for dist in bundle.compiled():
        if dist.tags:
            if not any(tag in accepted for tag in _expanded(dist.tags)):
                return (f"{dist.name} {dist.version} here is built for {', '.join(dist.tags)}; the host is {platform_.describe()}: "
                        f"run mnft from a Python {'.'.join(map(str, bundle.python))} of the host's kind, or name another supervisor host")
        elif (python, host.get("machine")) != (bundle.python, bundle.machine) or libc[0] != bundle.libc[0] \
                or _version(libc[1]) < _version(bundle.libc[1]):
            return (f"{dist.name} {dist.version} here was installed for this machine only (CPython {'.'.join(map(str, bundle.python))}, "
                    f"{bundle.machine}, {bundle.libc[0]} {bundle.libc[1]}); the host is {platform_.describe()}: install mnft's "
                    "requirements from wheels (pip) on this controller, or name a supervisor host like this machine")
    return None


def _expanded(tags: tuple[str, ...]) -> list[str]:
    out = []
    for tag in tags:  # a compressed tag set (cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64)
        interp, abi, plats = tag.split("-", 2)
        out += [f"{i}-{a}-{p}" for i in interp.split(".") for a in abi.split(".") for p in plats.split(".")]
    return out


def _version(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (text or "0").split(".")[:2])
    except ValueError:
        return (0,)


def size(bundle: Bundle) -> int:
    return bundle.path.stat().st_size


def contents(bundle: Bundle) -> bytes:
    """The bundle's bytes, as sent: the tar.gz this module wrote (BUNDLE_BYTES at most)."""
    from mnft.core import limits

    return limits.read_bytes(bundle.path, limits.BUNDLE_BYTES, "the supervisor's bundle", "BUNDLE_BYTES")
