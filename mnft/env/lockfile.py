"""Lock files: every package pinned exactly, read strictly.

Two formats, told apart by the file name (`*.toml` is PEP 751 `pylock.toml`, anything else a pip requirements
file such as `requirements.lock` written by `pip-compile` or `uv pip compile --generate-hashes`):

* requirements: one `name==version` per line (extras and a `; marker` allowed, `--hash=sha256:…` as many as
  given, `\\` continuations, `#` comments), plus the options that say where wheels come from: `--index-url` /
  `-i`, `--extra-index-url`, `--find-links` / `-f`, `--no-index` (and the harmless `--only-binary`,
  `--prefer-binary`, `--pre`, `--trusted-host`). The Python version comes from a `# python: 3.11` line, or the
  header pip-compile ("with Python 3.11") or `uv pip compile` (`--python-version 3.11`) writes.
* pylock.toml: `[[packages]]` with `name` and `version`, `marker`, `index`, and `wheels` (their `hashes`, and a
  `path` relative to the lock when the wheel is a local file); `requires-python` gives the Python version.

Anything not pinned to one version (`>=`, `==1.*`, no version, a URL, a path, `-e`, `-r`) is refused with a
one-line `InputError` naming the file and line: a lock that resolves differently on two hosts is not a lock.
Pure: nothing here touches the network or a host.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from mnft.core import limits

try:  # the standard library's from Python 3.11; tomli (the same code) before it: requires-python is >=3.10
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from mnft.core.errors import InputError

DEFAULT_NAMES = ("requirements.lock", "pylock.toml")
_HASH = re.compile(r"^(sha256|sha384|sha512):([0-9a-fA-F]+)$")
_PYTHON_LINE = re.compile(r"^#\s*python\s*[:=]\s*(\d+\.\d+)\s*$", re.I)
_PIP_COMPILE = re.compile(r"with Python (\d+\.\d+)")
_UV_COMPILE = re.compile(r"--python-version[ =](\d+\.\d+)")
_REQUIRES_PY = re.compile(r"^\s*(==|~=|>=)\s*(\d+)\.(\d+)(?:\.\*|\.\d+)?\s*$")
# options that only change how pip chooses among candidates, never which version a pin installs
_HARMLESS = {"--only-binary", "--prefer-binary", "--pre", "--trusted-host", "--no-binary"}
_VALUE_OPTIONS = {"--index-url": "index_url", "-i": "index_url", "--extra-index-url": "extra_index_urls",
                  "--find-links": "find_links", "-f": "find_links", "--trusted-host": None, "--only-binary": None, "--no-binary": None}


@dataclass(frozen=True)
class Pin:
    """One exactly pinned distribution."""

    name: str  # canonical (PEP 503): lower case, '-' separated
    version: str
    hashes: frozenset[str] = frozenset()  # "sha256:…" (lower-case hex)
    marker: str | None = None
    line: int = 0
    index: str | None = None  # pylock: the index this package comes from
    paths: tuple[str, ...] = ()  # pylock: local wheel files (absolute)

    def applies(self, environment: dict[str, str]) -> bool:
        return self.marker is None or Marker(self.marker).evaluate(environment)

    def matches(self, version: str) -> bool:
        """True when an installed version is this pin (a local label such as +cpu on the wheel is allowed when
        the pin has none, as pip's `==` allows it)."""
        try:
            installed, pinned = Version(version), Version(self.version)
        except ValueError:  # InvalidVersion, or thousands of digits (a host's answer)
            return version == self.version
        if pinned.local is None:
            return installed.public == pinned.public
        return installed == pinned


@dataclass(frozen=True)
class Lock:
    path: Path
    format: str  # "requirements" | "pylock"
    pins: tuple[Pin, ...]
    python: str | None = None  # "3.11": the minor version the lock was resolved for (None: not said)
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()  # absolute paths or URLs
    no_index: bool = False
    digest: str = ""  # sha256 of the file's bytes
    notes: tuple[str, ...] = field(default=())

    def pins_for(self, environment: dict[str, str]) -> tuple[Pin, ...]:
        return tuple(p for p in self.pins if p.applies(environment))

    def indexes(self) -> list[str]:
        urls = [self.index_url] if self.index_url else []
        urls += list(self.extra_index_urls)
        urls += sorted({p.index for p in self.pins if p.index and p.index not in urls})
        return urls


def default_lock(src: Path) -> Path:
    """The project's lock at the source tree's top: requirements.lock, else pylock.toml."""
    for name in DEFAULT_NAMES:
        if (src / name).is_file():
            return src / name
    raise InputError(f"{src}: no lock file ({' or '.join(DEFAULT_NAMES)}): write one (e.g. `uv pip compile --generate-hashes "
                     f"requirements.in -o requirements.lock`) or pass --lock FILE")


def load(path: Path | str) -> Lock:
    """A lock file, read within mnft's limits (at most LOCK_BYTES, lines at most LINE_CHARS)."""
    path = Path(path)
    data = limits.read_bytes(path, limits.LOCK_BYTES, "lock file", "--lock")
    text = limits.text_of(data, str(path), "lock file")
    if path.suffix == ".toml":
        return parse_pylock(text, path, hashlib.sha256(data).hexdigest())
    return parse_requirements(text, path, hashlib.sha256(data).hexdigest())


# ------------------------------------------------------------------------------------------------ requirements


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) with `\\` continuations joined and comments removed (a `#` after white space)."""
    out: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw)
        if not buffer:
            start = number
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        buffer += line
        if buffer.strip():
            out.append((start, buffer.strip()))
        buffer = ""
    if buffer.strip():
        out.append((start, buffer.strip()))
    return out


def _python_of_header(text: str) -> str | None:
    for raw in text.splitlines():
        if not raw.startswith("#"):
            continue
        for pattern in (_PYTHON_LINE, _PIP_COMPILE, _UV_COMPILE):
            match = pattern.search(raw)
            if match:
                return match.group(1)
    return None


def _location(value: str, base: Path) -> str:
    """A find-links entry: a URL as is, a path made absolute against the lock's directory."""
    if re.match(r"^[a-z][a-z0-9+.-]*://", value, re.I):
        if value.startswith("file://"):
            return value[len("file://"):]
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def parse_requirements(text: str, path: Path, digest: str = "") -> Lock:
    where = str(path)
    pins: dict[str, Pin] = {}
    opts: dict[str, list[str]] = {"index_url": [], "extra_index_urls": [], "find_links": []}
    no_index = False
    for number, line in _logical_lines(text):
        at = f"{where}:{number}"
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise InputError(f"{at}: malformed line ({exc}): {line!r}") from None
        if words[0].startswith("-"):
            i = 0
            while i < len(words):
                word = words[i]
                name, eq, value = word.partition("=")
                if name in ("-e", "--editable", "-r", "--requirement", "-c", "--constraint"):
                    raise InputError(f"{at}: {name} is not allowed in a lock: every package is one `name==version` line ({line!r})")
                if name == "--no-index":
                    no_index = True
                    i += 1
                    continue
                if name in _HARMLESS and name not in _VALUE_OPTIONS:
                    i += 1
                    continue
                if name in _VALUE_OPTIONS or (name.startswith("-i") and len(name) > 2) or (name.startswith("-f") and len(name) > 2):
                    if name in ("-i", "-f") or name in _VALUE_OPTIONS:
                        if not eq:
                            if i + 1 >= len(words):
                                raise InputError(f"{at}: {name} needs a value")
                            value, i = words[i + 1], i + 1
                        key = _VALUE_OPTIONS[name]
                    else:  # -ihttps://… / -f./wheels
                        key, value = _VALUE_OPTIONS[name[:2]], word[2:]
                    if key == "find_links":
                        value = _location(value, path.parent)
                    if key:
                        opts[key].append(value)
                    i += 1
                    continue
                raise InputError(f"{at}: unknown option {word!r} in the lock (allowed: --index-url, --extra-index-url, --find-links, --no-index)")
            continue
        hashes = []
        options = re.findall(r"(?:^|\s)(-\S+)", line)  # the requirement keeps its own quoting (markers: "3.8")
        requirement = re.sub(r"(?:^|\s)-\S+", " ", line).strip()
        for word in options:
            if word.startswith("--hash"):
                value = word.partition("=")[2] if "=" in word else ""
                match = _HASH.match(value)
                if not match:
                    raise InputError(f"{at}: malformed hash {word!r} (expected --hash=sha256:<hex>)")
                hashes.append(f"{match.group(1)}:{match.group(2).lower()}")
            elif word.startswith("-"):
                raise InputError(f"{at}: option {word!r} is not allowed on a package line")
        pin = _pin(requirement, at, number, frozenset(hashes), line)
        key = f"{pin.name};{pin.marker}"
        if key in pins:
            raise InputError(f"{at}: {pin.name} is pinned twice (also on line {pins[key].line})")
        pins[key] = pin
    if not pins:
        raise InputError(f"{where}: the lock pins no package")
    if len(opts["index_url"]) > 1:
        raise InputError(f"{where}: --index-url given {len(opts['index_url'])} times: keep one (others as --extra-index-url)")
    return Lock(path, "requirements", tuple(pins.values()), _python_of_header(text), (opts["index_url"] or [None])[0],
                tuple(opts["extra_index_urls"]), tuple(opts["find_links"]), no_index, digest)


def _pin(text: str, at: str, number: int, hashes: frozenset[str], line: str) -> Pin:
    if re.match(r"^(\.|/|~|[a-z][a-z0-9+.-]*://)", text, re.I) or " @ " in text or text.startswith("@"):
        raise InputError(f"{at}: {line!r} is a path or URL, not a pinned version: pin it as name==version")
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise InputError(f"{at}: malformed line {line!r}: {str(exc).splitlines()[0]}") from None
    if req.url:
        raise InputError(f"{at}: {line!r} is a URL, not a pinned version: pin it as name==version")
    specs = list(req.specifier)
    if len(specs) != 1 or specs[0].operator not in ("==", "===") or "*" in specs[0].version:
        raise InputError(f"{at}: {req.name} is not pinned to one version ({line!r}): a lock pins every package as name==version")
    try:
        Version(specs[0].version)
    except ValueError:  # InvalidVersion, or a release number of thousands of digits
        raise InputError(f"{at}: {req.name}: {limits.shown(specs[0].version)} is not a version") from None
    return Pin(canonicalize_name(req.name), specs[0].version, hashes, str(req.marker) if req.marker else None, number)


# ------------------------------------------------------------------------------------------------ pylock.toml


def parse_pylock(text: str, path: Path, digest: str = "") -> Lock:
    where = str(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{where}: malformed TOML: {exc}") from None
    except ValueError:  # an integer of thousands of digits
        raise InputError(f"{where}: malformed TOML: an integer longer than Python converts (a limit of mnft's input)") from None
    except RecursionError:  # tomllib nests by recursion: arrays or tables nested a thousand deep
        raise InputError(f"{where}: malformed TOML: nested deeper than Python's parser goes (a limit of mnft's input)") from None
    version = doc.get("lock-version")
    if not isinstance(version, str) or not version.startswith("1."):
        raise InputError(f"{where}: lock-version {version!r} is not supported (pylock.toml lock-version 1.x)")
    packages = doc.get("packages")
    if not isinstance(packages, list) or not packages:
        raise InputError(f"{where}: the lock has no [[packages]]")
    python = None
    requires = doc.get("requires-python")
    if isinstance(requires, str):
        match = _REQUIRES_PY.match(requires)
        if match and match.group(1) in ("==", "~="):
            python = f"{match.group(2)}.{match.group(3)}"
    pins: dict[str, Pin] = {}
    for number, pkg in enumerate(packages, 1):
        at = f"{where}: [[packages]] #{number}"
        if not isinstance(pkg, dict) or not isinstance(pkg.get("name"), str):
            raise InputError(f"{at}: a package needs a name")
        name = canonicalize_name(pkg["name"])
        at = f"{at} ({name})"
        if not isinstance(pkg.get("version"), str):
            raise InputError(f"{at}: not pinned to one version (no 'version'): a lock pins every package")
        try:
            Version(pkg["version"])
        except ValueError:  # InvalidVersion, or a release number of thousands of digits
            raise InputError(f"{at}: {limits.shown(pkg['version'])} is not a version") from None
        for kind in ("vcs", "directory", "archive"):
            if kind in pkg:
                raise InputError(f"{at}: a {kind} package cannot be provisioned offline: build a wheel and lock that")
        marker = pkg.get("marker")
        if marker is not None:
            try:
                Marker(marker)
            except InvalidMarker as exc:
                raise InputError(f"{at}: malformed marker {marker!r}: {exc}") from None
        hashes: set[str] = set()
        paths: list[str] = []
        for wheel in pkg.get("wheels") or []:
            if not isinstance(wheel, dict):
                raise InputError(f"{at}: each wheel is a table")
            for algo, value in (wheel.get("hashes") or {}).items():
                if not _HASH.match(f"{algo}:{value}"):
                    raise InputError(f"{at}: malformed hash {algo}:{value}")
                hashes.add(f"{algo}:{str(value).lower()}")
            if isinstance(wheel.get("path"), str):
                paths.append(_location(wheel["path"], path.parent))
        if not pkg.get("wheels") and "sdist" in pkg:
            raise InputError(f"{at}: only an sdist is locked: mnft installs wheels only (lock a wheel)")
        key = f"{name};{marker}"
        if key in pins:
            raise InputError(f"{at}: {name} is locked twice")
        pins[key] = Pin(name, pkg["version"], frozenset(hashes), marker, number, pkg.get("index"), tuple(paths))
    index = doc.get("default-index") if isinstance(doc.get("default-index"), str) else None
    only_local = all(p.paths for p in pins.values())
    return Lock(path, "pylock", tuple(pins.values()), python, index, (), (), only_local, digest)


def marker_environment(python_full: str, arch: str, system: str = "Linux") -> dict[str, str]:
    """PEP 508 marker values of a host, from its facts (CPython on Linux)."""
    return {
        "implementation_name": "cpython",
        "implementation_version": python_full,
        "os_name": "posix",
        "platform_machine": arch,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": system,
        "platform_version": "",
        "python_full_version": python_full,
        "python_version": ".".join(python_full.split(".")[:2]),
        "sys_platform": system.lower(),
        "extra": "",
    }
