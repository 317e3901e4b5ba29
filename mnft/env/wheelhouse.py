"""The controller's wheelhouse: every locked wheel for every platform the hosts run, fetched once, here.

Hosts never need the internet: the controller resolves the lock's pins into wheel files for each host platform
(Python version, libc, CPU architecture) with `pip download --only-binary=:all: --no-deps --platform …`, from the
index the lock names (or its --find-links, or a pylock.toml's local wheel paths), checks each wheel against the
lock's hashes, and keeps them in `$MNFT_HOME/wheelhouse` (an index of sizes and sha256 beside them, so a second
run hashes nothing). Selecting the wheel for a host is pure: wheel file names and the host's tags in, files out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Iterable, Mapping

from packaging import tags as ptags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.env.lockfile import Lock, Pin
from mnft.hosts.command import redact_url
from mnft.hosts.hostkeys import mnft_home
from mnft.onhost.filehash import sha256_file

LEGACY_MANYLINUX = {(2, 5): "manylinux1", (2, 12): "manylinux2010", (2, 17): "manylinux2014"}
PIP_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Platform:
    """What decides which wheel a host installs."""

    python: str  # "3.11"
    arch: str  # "x86_64"
    libc: str | None  # "glibc" | "musl" | None
    libc_version: str | None  # "2.36"

    def describe(self) -> str:
        libc = f"{self.libc} {self.libc_version}" if self.libc else "unknown libc"
        return f"cp{self.python.replace('.', '')}, {self.arch}, {libc}"

    def platform_tags(self) -> list[str]:
        """Most specific first: manylinux_2_N for N down to 17 (and the legacy aliases), musllinux, linux."""
        arch = self.arch
        tags: list[str] = []
        version = tuple(int(x) for x in re.findall(r"\d+", self.libc_version or "")[:2])
        if self.libc == "glibc" and len(version) == 2:
            for minor in range(version[1], 4, -1):
                tags.append(f"manylinux_2_{minor}_{arch}")
                legacy = LEGACY_MANYLINUX.get((2, minor))
                if legacy and (minor == 17 or arch in ("x86_64", "i686")):
                    tags.append(f"{legacy}_{arch}")
        elif self.libc == "musl" and len(version) == 2:
            tags += [f"musllinux_1_{minor}_{arch}" for minor in range(version[1], -1, -1)]
        tags.append(f"linux_{arch}")
        return tags

    def tags(self) -> list[ptags.Tag]:
        major, minor = (int(x) for x in self.python.split(".")[:2])
        plats = self.platform_tags()
        return [*ptags.cpython_tags((major, minor), abis=[f"cp{major}{minor}"], platforms=plats),
                *ptags.compatible_tags((major, minor), f"cp{major}{minor}", plats)]


@dataclass(frozen=True)
class Wheel:
    file: str  # name in the wheelhouse
    name: str  # canonical
    version: str  # from the file name
    installed_version: str  # Version: in the wheel's METADATA (what the environment will report)
    sha256: str
    size: int
    unpacked: int  # bytes once installed (sum of the archive's file sizes)


def select(pins: Iterable[Pin], files: Iterable[str], platform: Platform) -> tuple[dict[str, str], list[Pin]]:
    """For each pin the best wheel file for the platform (by tag priority); pins with none are returned apart."""
    priority = {tag: i for i, tag in enumerate(platform.tags())}
    parsed = []
    for file in files:
        try:
            name, version, _, wheel_tags = parse_wheel_filename(file)
        except InvalidWheelFilename:
            continue
        rank = min((priority[t] for t in wheel_tags if t in priority), default=None)
        if rank is not None:
            parsed.append((str(name), str(version), rank, file))
    chosen, missing = {}, []
    for pin in pins:
        candidates = sorted((rank, file) for name, version, rank, file in parsed if name == pin.name and pin.matches(version))
        if candidates:
            chosen[pin.name] = candidates[0][1]
        else:
            missing.append(pin)
    return chosen, missing


class Wheelhouse:
    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root else mnft_home() / "wheelhouse"
        self.index_path = self.root / ".index.json"
        self._index: dict[str, dict] | None = None

    def files(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.suffix == ".whl" and p.is_file())

    def _load_index(self) -> dict[str, dict]:
        if self._index is None:
            try:  # a cache of the wheels' hashes: damaged, it is made again; too large, it is refused
                index = limits.read_json(self.index_path, limits.STATE_BYTES, "wheelhouse index", "STATE_BYTES", missing={})
            except limits.TooLarge as exc:
                raise InputError(f"{exc}: delete it (mnft makes it again)") from None
            except InputError:
                index = {}
            self._index = index if isinstance(index, dict) else {}
        return self._index

    def wheel(self, file: str) -> Wheel:
        """A wheel's identity, hashed once and remembered (by size and mtime)."""
        path = self.root / file
        stat = path.stat()
        index = self._load_index()
        entry = index.get(file)
        if not entry or entry.get("size") != stat.st_size or entry.get("mtime_ns") != stat.st_mtime_ns:
            entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_file(path), **_wheel_metadata(path)}
            index[file] = entry
            self._save_index()
        name, version, _, _ = parse_wheel_filename(file)
        return Wheel(file, str(name), str(version), entry["version"], entry["sha256"], entry["size"], entry["unpacked"])

    def _save_index(self) -> None:
        tmp = self.index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._index, indent=1, sort_keys=True))
        os.replace(tmp, self.index_path)

    def add(self, path: Path) -> str:
        """Copy (hard link when possible) a local wheel file into the wheelhouse."""
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.root / path.name
        if not target.exists():
            tmp = target.with_name(target.name + ".part")
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copy2(path, tmp)
            os.replace(tmp, target)
        return path.name

    def resolve(self, lock: Lock, wanted: Mapping[Platform, Iterable[Pin]], *, offline: bool = False, find_links: Iterable[str] = (),
                progress=None) -> dict[Platform, dict[str, Wheel]]:
        """A wheel for every pin each platform needs (the pins the hosts' plans chose by their own marker values):
        from the wheelhouse, else the lock's local paths, else pip download. Raises InputError naming a package
        without a wheel for a platform, or a hash mismatch."""
        self.root.mkdir(parents=True, exist_ok=True)
        out: dict[Platform, dict[str, Wheel]] = {}
        for platform, needed in wanted.items():
            pins = tuple(dict.fromkeys(needed))
            chosen, missing = select(pins, self.files(), platform)
            local = [p for p in missing if p.paths]
            for pin in local:
                for path in pin.paths:
                    if Path(path).is_file():
                        self.add(Path(path))
            if local:
                chosen, missing = select(pins, self.files(), platform)
            if missing:
                self._download(lock, missing, platform, offline=offline, find_links=tuple(find_links), progress=progress)
                chosen, missing = select(pins, self.files(), platform)
            if missing:
                names = ", ".join(f"{p.name}=={p.version}" for p in missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
                raise InputError(f"{lock.path}: no wheel of {names} for platform {platform.describe()} in {self._sources(lock, find_links)}")
            wheels = {}
            for pin in pins:
                wheel = self.wheel(chosen[pin.name])
                if pin.hashes and f"sha256:{wheel.sha256}" not in pin.hashes:
                    raise InputError(f"{lock.path}:{pin.line}: {pin.name}=={pin.version}: the wheel {wheel.file} has sha256 {wheel.sha256}, "
                                     "which the lock does not list (a different build, or a tampered file): fix the lock or the index")
                wheels[pin.name] = wheel
            out[platform] = wheels
        return out

    def _sources(self, lock: Lock, find_links: Iterable[str]) -> str:
        where = [*lock.indexes(), *lock.find_links, *find_links]
        return redact_url(", ".join(where)) if where else f"{self.root} (the wheelhouse) and pip's configured index"

    def _download(self, lock: Lock, pins: list[Pin], platform: Platform, *, offline: bool, find_links: tuple[str, ...], progress) -> None:
        links = [*lock.find_links, *find_links]
        remote_links = [link for link in links if re.match(r"^https?://", link)]
        if offline and (not lock.no_index or remote_links):
            names = ", ".join(f"{p.name}=={p.version}" for p in pins[:5])
            raise InputError(f"{lock.path}: {names} not in the wheelhouse ({self.root}) and --offline forbids the index "
                             f"({redact_url(', '.join(lock.indexes() + remote_links)) or 'the configured index'}): run once without --offline, "
                             "or add --find-links DIR with the wheels")
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(self.root),
                "--disable-pip-version-check", "--progress-bar", "off", "--python-version", platform.python,
                "--implementation", "cp", "--abi", "cp" + platform.python.replace(".", ""), "--abi", "abi3", "--abi", "none"]
        for tag in platform.platform_tags():
            argv += ["--platform", tag]
        env = dict(os.environ)
        if lock.no_index or offline:
            argv.append("--no-index")
        else:  # by environment, never on the command line: ps shows it to every user, and an index URL may hold a token
            if lock.index_url:
                env["PIP_INDEX_URL"] = lock.index_url
            extra = [*lock.extra_index_urls, *{p.index: None for p in pins if p.index and p.index != lock.index_url}]
            if extra:
                env["PIP_EXTRA_INDEX_URL"] = " ".join(extra)
        for link in links:
            argv += ["--find-links", link]
        argv += [f"{p.name}=={p.version}" for p in pins]
        if progress is not None:
            progress(f"fetching {len(pins)} wheel(s) for {platform.describe()}")
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PIP_TIMEOUT, env=env)
        except subprocess.TimeoutExpired:
            raise InputError(f"{lock.path}: fetching wheels timed out after {PIP_TIMEOUT:.0f}s") from None
        if done.returncode != 0:
            text = done.stderr + done.stdout
            match = re.search(r"No matching distribution found for (\S+)", text)
            if match:
                raise InputError(f"{lock.path}: no wheel of {match.group(1)} for platform {platform.describe()} in {self._sources(lock, find_links)}")
            lines = [ln for ln in text.strip().splitlines() if ln.strip()]
            raise InputError(f"{lock.path}: pip download failed: {redact_url(lines[-1]) if lines else 'exit %d' % done.returncode}")


def _wheel_metadata(path: Path) -> dict:
    """The installed version (METADATA's Version) and unpacked size of a wheel."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            meta = next((i for i in infos if re.fullmatch(r"[^/]+\.dist-info/METADATA", i.filename)), None)
            if meta is None:
                raise InputError(f"{path}: not a wheel (no .dist-info/METADATA)")
            if meta.file_size > limits.WHEEL_METADATA_BYTES:  # the size it unpacks to (zipfile stops there)
                raise limits.too_large(f"{path}: {meta.filename}", "wheel's metadata", limits.WHEEL_METADATA_BYTES, "WHEEL_METADATA_BYTES")
            with archive.open(meta) as member:
                text = limits.read_at_most(member, limits.WHEEL_METADATA_BYTES)
            headers = HeaderParser().parsestr(text.decode("utf-8", "replace"))
            return {"version": headers.get("Version", ""), "unpacked": sum(i.file_size for i in infos)}
    except zipfile.BadZipFile:
        raise InputError(f"{path}: not a wheel (not a zip archive): delete it from the wheelhouse") from None
