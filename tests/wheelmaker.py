"""Tiny real wheels for the provision tests, written as zip files (nothing is downloaded or built)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str, version: str, *, requires: tuple[str, ...] = (), padding: int = 0) -> Path:
    """A py3-none-any wheel of a one-module package `name` whose __version__ is `version` (padding: bytes of
    incompressible data in the package, to give it a size)."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files: dict[str, bytes] = {
        f"{module}/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"{dist_info}/METADATA": ("Metadata-Version: 2.1\n" f"Name: {name}\n" f"Version: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: mnft-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if padding:
        import os

        files[f"{module}/blob.bin"] = os.urandom(padding)
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items()) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for file, data in files.items():
            archive.writestr(file, data)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_lock(path: Path, wheels: list[Path], pins: dict[str, str], *, find_links: Path, python: str = "3.11", hashes: bool = True) -> Path:
    """requirements.lock pinning `pins` (name -> version), with the hashes of the matching wheel files."""
    lines = [f"# python: {python}", "--no-index", f"--find-links {find_links}"]
    for name, version in pins.items():
        wheel = next((w for w in wheels if w.name.startswith(f"{name.replace('-', '_')}-{version}-")), None)
        line = f"{name}=={version}"
        if hashes and wheel is not None:
            line += f" \\\n    --hash=sha256:{sha256(wheel)}"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return path
