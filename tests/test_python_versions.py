"""The Pythons mnft promises to run on: the controller on any Python that pyproject's `requires-python` allows
(3.10.0 up: Debian 12's own is 3.11.2), the host-side scripts on 3.8 up (hosts mnft does not control).

A use of the standard library newer than that works on the Python the suite runs on and breaks on the oldest
allowed one (`TarFile.extractall(filter=)` exists from 3.11.4 and 3.10.12: on Debian 12's 3.11.2 every `mnft
logs` failed). The scan below reads every module's source for the standard library's additions that are known
(names, modules and keyword arguments, each with the version that brought it) and names each use newer than its
floor; the concrete cases run under the machine's own Pythons where they are installed.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_architecture import TORCH_ENTRIES, host_modules, modules

ROOT = Path(__file__).resolve().parent.parent
CONTROLLER_FLOOR = (3, 10, 0)
HOST_FLOOR = (3, 8, 0)

# module (or module.name) -> the version that brought it. Only what is newer than the host floor (3.8).
NAMES = {
    "tomllib": (3, 11), "wsgiref.types": (3, 11), "zoneinfo": (3, 9), "graphlib": (3, 9),
    "datetime.UTC": (3, 11), "enum.StrEnum": (3, 11), "enum.ReprEnum": (3, 11), "enum.verify": (3, 11),
    "enum.member": (3, 11), "enum.nonmember": (3, 11), "enum.global_enum": (3, 11), "enum.EnumCheck": (3, 11),
    "enum.FlagBoundary": (3, 11), "enum.property": (3, 11),
    "typing.Self": (3, 11), "typing.LiteralString": (3, 11), "typing.Never": (3, 11), "typing.NotRequired": (3, 11),
    "typing.Required": (3, 11), "typing.assert_never": (3, 11), "typing.assert_type": (3, 11),
    "typing.reveal_type": (3, 11), "typing.TypeVarTuple": (3, 11), "typing.Unpack": (3, 11),
    "typing.dataclass_transform": (3, 11), "typing.get_overloads": (3, 11), "typing.clear_overloads": (3, 11),
    "typing.override": (3, 12), "typing.TypeAliasType": (3, 12), "typing.ReadOnly": (3, 13), "typing.TypeIs": (3, 13),
    "typing.TypeAlias": (3, 10), "typing.ParamSpec": (3, 10), "typing.Concatenate": (3, 10), "typing.TypeGuard": (3, 10),
    "typing.is_typeddict": (3, 10), "typing.Annotated": (3, 9),
    "contextlib.chdir": (3, 11), "contextlib.aclosing": (3, 10), "hashlib.file_digest": (3, 11),
    "asyncio.TaskGroup": (3, 11), "asyncio.timeout": (3, 11), "asyncio.timeout_at": (3, 11), "asyncio.Runner": (3, 11),
    "asyncio.Barrier": (3, 11), "asyncio.to_thread": (3, 9), "operator.call": (3, 11),
    "math.cbrt": (3, 11), "math.exp2": (3, 11), "math.sumprod": (3, 12), "math.lcm": (3, 9), "math.nextafter": (3, 9),
    "math.ulp": (3, 9), "itertools.batched": (3, 12), "itertools.pairwise": (3, 10),
    "sys.exception": (3, 11), "sys.monitoring": (3, 12), "sys.stdlib_module_names": (3, 10), "sys.orig_argv": (3, 10),
    "sys.platlibdir": (3, 9), "locale.getencoding": (3, 11), "logging.getLevelNamesMapping": (3, 11),
    "logging.getHandlerByName": (3, 12), "logging.getHandlerNames": (3, 12), "inspect.getmembers_static": (3, 11),
    "inspect.get_annotations": (3, 10), "os.login_tty": (3, 11), "os.process_cpu_count": (3, 13),
    "os.path.splitroot": (3, 12), "os.path.isjunction": (3, 12), "os.waitstatus_to_exitcode": (3, 9),
    "os.pidfd_open": (3, 9), "os.eventfd": (3, 10), "os.splice": (3, 10), "signal.pidfd_send_signal": (3, 9),
    "tarfile.data_filter": (3, 11, 4), "tarfile.tar_filter": (3, 11, 4), "tarfile.fully_trusted_filter": (3, 11, 4),
    "tarfile.FilterError": (3, 11, 4), "shutil.chown": (3, 3), "copy.replace": (3, 13), "warnings.deprecated": (3, 13),
    "functools.cache": (3, 9), "random.randbytes": (3, 9), "types.NoneType": (3, 10), "types.EllipsisType": (3, 10),
    "types.UnionType": (3, 10), "types.GenericAlias": (3, 9), "dataclasses.KW_ONLY": (3, 10),
    "statistics.correlation": (3, 10), "statistics.covariance": (3, 10), "statistics.linear_regression": (3, 10),
    "importlib.resources.files": (3, 9), "importlib.metadata.packages_distributions": (3, 10),
    "ast.unparse": (3, 9), "http.HTTPMethod": (3, 11), "socket.send_fds": (3, 9), "socket.recv_fds": (3, 9),
    "builtins.ExceptionGroup": (3, 11), "builtins.BaseExceptionGroup": (3, 11), "builtins.aiter": (3, 10),
    "builtins.anext": (3, 10), "builtins.EncodingWarning": (3, 10),
}
# method names no older object has (str, pathlib.Path, int, BaseException) -> the version that brought them
METHODS = {
    "removeprefix": (3, 9), "removesuffix": (3, 9), "is_relative_to": (3, 9), "with_stem": (3, 9),
    "hardlink_to": (3, 10), "bit_count": (3, 10), "add_note": (3, 11), "is_junction": (3, 12),
    "with_segments": (3, 12), "full_match": (3, 13), "from_uri": (3, 13),
}
# (function or method name, keyword) -> the version that brought the keyword
KEYWORDS = {
    ("extractall", "filter"): (3, 11, 4), ("extract", "filter"): (3, 11, 4), ("unpack_archive", "filter"): (3, 11, 4),
    ("Popen", "process_group"): (3, 11), ("run", "process_group"): (3, 11), ("call", "process_group"): (3, 11),
    ("check_call", "process_group"): (3, 11), ("check_output", "process_group"): (3, 11),
    ("Popen", "pipesize"): (3, 10), ("rmtree", "onexc"): (3, 12), ("NamedTemporaryFile", "delete_on_close"): (3, 12),
    ("TemporaryDirectory", "delete"): (3, 12), ("dataclass", "weakref_slot"): (3, 11), ("dataclass", "slots"): (3, 10),
    ("dataclass", "kw_only"): (3, 10), ("field", "kw_only"): (3, 10), ("zip", "strict"): (3, 10),
    ("relative_to", "walk_up"): (3, 12), ("glob", "case_sensitive"): (3, 12), ("rglob", "case_sensitive"): (3, 12),
    ("exists", "follow_symlinks"): (3, 12), ("read_text", "newline"): (3, 13), ("write_text", "newline"): (3, 10),
    ("fmean", "weights"): (3, 11), ("bisect", "key"): (3, 10), ("bisect_left", "key"): (3, 10),
    ("bisect_right", "key"): (3, 10), ("insort", "key"): (3, 10), ("basicConfig", "encoding"): (3, 9),
    ("Popen", "user"): (3, 9), ("Popen", "group"): (3, 9), ("Popen", "extra_groups"): (3, 9), ("Popen", "umask"): (3, 9),
    ("run", "user"): (3, 9), ("run", "group"): (3, 9), ("run", "extra_groups"): (3, 9), ("run", "umask"): (3, 9),
    ("shutdown", "cancel_futures"): (3, 9), ("ArgumentParser", "exit_on_error"): (3, 9),
}


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """local name -> the dotted standard name it stands for (`import os.path as p` -> p: os.path)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    base = names.get(node.id, f"builtins.{node.id}" if node.id in dir(__builtins__) or node.id in ("ExceptionGroup", "BaseExceptionGroup", "aiter", "anext", "EncodingWarning") else None)
    return ".".join([base, *reversed(parts)]) if base else None


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the nodes that run only where this Python has what they use: under `if hasattr(...)`, `if
    HAS_...` or `if sys.version_info ...`, or an import in a `try` that catches ImportError."""
    out = set()
    for node in ast.walk(tree):
        body = []
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "hasattr(" in test or re.search(r"\bHAS_", test) or "version_info" in test:
                body = node.body
        elif isinstance(node, ast.Try) and any(
            h.type is not None and re.search(r"\b(ImportError|ModuleNotFoundError)\b", ast.unparse(h.type)) for h in node.handlers
        ):
            body = [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        out.update(id(sub) for part in body for sub in ast.walk(part))
    return out


def newer_than(source: str, floor: tuple[int, ...]) -> list[str]:
    """'line N: what (3.x)' for each use in source of the standard library newer than floor, unless guarded."""
    tree = ast.parse(source)
    names = _imported_names(tree)
    guarded = _guarded(tree)
    found = []

    def note(node, what, since):
        if since > floor and id(node) not in guarded:
            found.append(f"line {node.lineno}: {what} ({'.'.join(map(str, since))})")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in NAMES:
                    note(node, f"import {alias.name}", NAMES[alias.name])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module in NAMES:
                note(node, f"from {node.module} import", NAMES[node.module])
            for alias in node.names:
                if f"{node.module}.{alias.name}" in NAMES:
                    note(node, f"{node.module}.{alias.name}", NAMES[f"{node.module}.{alias.name}"])
        elif isinstance(node, (ast.Attribute, ast.Name)):
            dotted = _dotted(node, names)
            if dotted in NAMES and not (isinstance(node, ast.Name) and node.id in names):  # `from x import y` noted above
                note(node, dotted, NAMES[dotted])
            if isinstance(node, ast.Attribute) and node.attr in METHODS and not (dotted and dotted.split(".")[0] in sys.stdlib_module_names):
                note(node, f".{node.attr}()", METHODS[node.attr])
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id if isinstance(node.func, ast.Name) else None
            for keyword in node.keywords:
                if (func, keyword.arg) in KEYWORDS:
                    note(node, f"{func}({keyword.arg}=)", KEYWORDS[(func, keyword.arg)])
    return sorted(set(found), key=lambda s: int(re.match(r"line (\d+)", s).group(1)))


HOSTS = set(host_modules()) | set(TORCH_ENTRIES)


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_uses_the_standard_library_newer_than_it_may_find(name):
    floor = HOST_FLOOR if name in HOSTS else CONTROLLER_FLOOR
    source = modules()[name].read_text(encoding="utf-8")
    assert newer_than(source, floor) == [], f"mnft.{name} must run on Python {'.'.join(map(str, floor))}"
    ast.parse(source, feature_version=floor[:2])


def test_the_scan_finds_what_broke_on_debian_12():  # the scan above cannot pass by finding nothing
    source = (
        "import tarfile, tomllib\nfrom datetime import UTC\nimport subprocess as sp\n"
        "def f(tar, p):\n    tar.extractall(p, filter='data')\n    sp.Popen(['x'], process_group=0)\n"
        "    return p.removeprefix('a'), zip(p, p, strict=True)\n"
    )
    assert newer_than(source, CONTROLLER_FLOOR) == [
        "line 1: import tomllib (3.11)", "line 2: datetime.UTC (3.11)", "line 5: extractall(filter=) (3.11.4)",
        "line 6: Popen(process_group=) (3.11)",
    ]
    assert "line 7: .removeprefix() (3.9)" in newer_than(source, HOST_FLOOR)
    assert "line 7: zip(strict=) (3.10)" in newer_than(source, HOST_FLOOR)
    assert newer_than("import os\nos.walk('.')\nos.readlink('x')\n", HOST_FLOOR) == []
    guarded = ("try:\n    import tomllib\nexcept ModuleNotFoundError:\n    import tomli as tomllib\n"
               "if HAS_DATA_FILTER:\n    tar.extractall(p, filter='data')\nelse:\n    tar.extractall(p)\n")
    assert newer_than(guarded, CONTROLLER_FLOOR) == []
    assert newer_than(guarded.replace("HAS_DATA_FILTER", "ok"), CONTROLLER_FLOOR) == ["line 6: extractall(filter=) (3.11.4)"]


def test_pyproject_states_the_floor_the_scan_holds():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^requires-python = ">=3\.10"$', text, re.M)


def _python(version: str) -> str | None:
    """A Python of that minor version on this machine (pyenv's or the system's), or None."""
    for candidate in sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}")) + [Path(f"/usr/bin/python{version}")]:
        if candidate.exists():
            return str(candidate)
    return shutil.which(f"python{version}")


@pytest.mark.parametrize("name", host_modules())
def test_host_modules_import_under_python_3_8(name):
    """Each host module imported (its definitions run, nothing started) by a real 3.8, from its payload's package."""
    python = _python("3.8")
    if python is None:
        pytest.skip("no Python 3.8 on this machine")
    code = "import sys; sys.path.insert(0, sys.argv[1]); import importlib; importlib.import_module('mnft.' + sys.argv[2])"
    done = subprocess.run([python, "-S", "-c", code, str(ROOT), name], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_controller_compiles_under_python_3_10():
    python = _python("3.10")
    if python is None:
        pytest.skip("no Python 3.10 on this machine")
    files = [str(p) for p in sorted(modules().values())]
    code = "import sys\nfor f in sys.argv[1:]:\n    compile(open(f, encoding='utf-8').read(), f, 'exec')\n"
    done = subprocess.run([python, "-c", code, *files], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# Unpacking a host's logs (mnft.run.logs.unpack through mnft.core.archive): the tar made here, unpacked by the
# Python under test in a subprocess; it prints what came out, or the refusal.
UNPACK = r'''
import io, json, os, sys, tarfile
from mnft.core import archive

def tar_of(entries):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, kind, arg in entries:
            info = tarfile.TarInfo(name)
            data = b""
            if kind == "file":
                data = arg.encode(); info.size = len(data); info.mode = 0o4777 if name.endswith(".sh") else 0o666
            elif kind == "dir":
                info.type = tarfile.DIRTYPE; info.mode = 0o755
            elif kind in ("sym", "hard"):
                info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE; info.linkname = arg
            elif kind == "chr":
                info.type = tarfile.CHRTYPE; info.devmajor, info.devminor = 1, 3
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()

out = {"passes_through": bool(archive.PASS_THROUGH)}
for case, entries in json.loads(sys.argv[2]).items():
    dest = os.path.join(sys.argv[1], case)
    with tarfile.open(fileobj=io.BytesIO(tar_of(entries)), mode="r:gz") as tar:
        why = archive.extract(tar, tar.getmembers(), dest)
    files = sorted(os.path.relpath(os.path.join(r, n), dest) for r, ds, fs in os.walk(dest) for n in ds + fs) if os.path.exists(dest) else []
    modes = {f: oct(os.lstat(os.path.join(dest, f)).st_mode & 0o7777) for f in files if not os.path.islink(os.path.join(dest, f)) and os.path.isfile(os.path.join(dest, f))}
    out[case] = {"why": why, "files": files, "modes": modes, "outside": os.path.exists(os.path.join(sys.argv[1], "escaped"))}
print(json.dumps(out))
'''
GOOD = [("run", "dir", None), ("run/output.log", "file", "step 1"), ("run/latest", "sym", "output.log"),
        ("run/copy.log", "hard", "run/output.log"), ("run/start.sh", "file", "#!/bin/sh")]  # .sh: set-user-id, 0o4777
BAD = {
    "absolute": [("run/a", "file", "x"), ("/tmp/escaped", "file", "x")],
    "climbs": [("run/a", "file", "x"), ("run/../../escaped", "file", "x")],
    "link-out": [("run/a", "file", "x"), ("run/l", "sym", "../../escaped")],
    "link-absolute": [("run/a", "file", "x"), ("run/l", "sym", "/etc/passwd")],
    "hardlink-out": [("run/a", "file", "x"), ("run/h", "hard", "/etc/passwd")],
    "device": [("run/a", "file", "x"), ("run/null", "chr", None)],
    "pipe": [("run/a", "file", "x"), ("run/p", "fifo", None)],
}


def _unpack_with(python: str, tmp_path: Path) -> dict:
    import json
    import os

    cases = {"good": GOOD, **BAD}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([python, "-c", UNPACK, str(tmp_path), json.dumps(cases)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("python", ["/usr/bin/python3", sys.executable], ids=["system-python", "this-python"])
def test_a_hosts_logs_unpack_safely_on_every_python(python, tmp_path):
    """Debian 12's own Python (3.11.2) has no tarfile filter: the same members unpack, and the same are refused
    with nothing written, as on a Python that has it."""
    if not Path(python).exists():
        pytest.skip(f"no {python} on this machine")
    out = _unpack_with(python, tmp_path)
    assert out["good"] == {"why": None, "files": ["run", "run/copy.log", "run/latest", "run/output.log", "run/start.sh"],
                           "modes": {"run/copy.log": "0o644", "run/output.log": "0o644", "run/start.sh": "0o755"}, "outside": False}
    assert {case: out[case]["why"] for case in BAD} == {
        "absolute": "'/tmp/escaped' is an absolute path",
        "climbs": "'run/../../escaped' climbs out of the folder (..)",
        "link-out": "'run/l' links out of the folder ('../../escaped')",
        "link-absolute": "'run/l' links to an absolute path ('/etc/passwd')",
        "hardlink-out": "'run/h' links to an absolute path ('/etc/passwd')",
        "device": "'run/null' is a device or a pipe",
        "pipe": "'run/p' is a device or a pipe",
    }
    assert all(out[case]["files"] == [] and not out[case]["outside"] for case in BAD)  # nothing written


def test_the_system_python_is_one_without_the_filter():  # the test above covers both ways only where this holds
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 on this machine")
    done = subprocess.run(["/usr/bin/python3", "-c", "import tarfile; print(hasattr(tarfile, 'data_filter'))"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False" or pytest.skip("this system's Python has tarfile's filter")
