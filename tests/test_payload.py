"""What a host runs of mnft: an entry of the host package (mnft.onhost) with the modules it imports, in one payload on
the command's stdin, served to `import` from memory (mnft.hosts.payload builds it, mnft.onhost.boot reads it).

Each test runs the real bootstrap in a real interpreter, as a host's SSH session would.
"""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mnft.hosts import payload, pyrun
from mnft.onhost import boot, probe


def run(data: bytes, *args: str, cwd: str | None = None, env: dict | None = None, python: str = sys.executable, site: bool = False):
    argv = [python, *([] if site else ["-S"]), "-c", pyrun.BOOTSTRAP, *args]
    return subprocess.run(argv, input=data, capture_output=True, timeout=60, cwd=cwd, env=dict(os.environ, **(env or {})))


def module(source: str) -> tuple[bytes, bytes]:
    return source.encode(), marshal.dumps(compile(source, "test", "exec", dont_inherit=True))


# ------------------------------------------------------------------------------------------------ what a payload holds


def test_an_entry_ships_with_exactly_the_host_modules_it_imports_found_in_their_source():
    shipped = payload.closure("leasehost")
    assert shipped[:2] == ("__init__", "boot") and "leasehost" in shipped
    assert "procs" in shipped and "usage" in shipped  # imported by the lease script's modules
    assert "agent" not in shipped and "probe" not in shipped  # nothing it does not import
    assert "imagehost" in payload.closure("probe")  # imported inside a function: shipped too


def test_an_entry_that_is_not_a_host_module_is_a_bug_named():
    with pytest.raises(ValueError, match="no host module 'nothing_here'"):
        payload.closure("nothing_here")


def test_a_payload_is_built_once_and_is_smaller_than_its_sources():
    assert payload.build("agent") is payload.build("agent")
    import zlib

    head, body = payload.build("agent").split(b"\n", 1)
    assert int(head.split()[0]) == len(body) and len(body) < len(zlib.decompress(body)) / 2  # compressed, to under half


# ------------------------------------------------------------------------------------------------ on the host


def test_the_lease_entry_as_shipped_answers_on_a_hosts_python(tmp_path):
    done = run(pyrun.payload("leasehost"), "show", env={"MNFT_LEASE_DIR": str(tmp_path)})
    assert json.loads(done.stdout.decode().splitlines()[-1])["held"] is False, done.stderr


def test_a_host_whose_python_reads_the_controllers_bytecode_runs_it_and_any_other_compiles_the_source():
    modules = {"x": (b"def main(argv):\n    print('source', argv)\n", module("def main(argv):\n    print('bytecode', argv)\n")[1])}
    same = run(payload.pack("x", modules), "a b")
    assert same.stdout == b"bytecode ['a b']\n" and same.returncode == 0, same.stderr
    other = run(payload.pack("x", modules, magic="0d0d0a0b"), "a b")
    assert other.stdout == b"source ['a b']\n", other.stderr


def test_an_entrys_main_return_is_the_exit_status_and_its_siblings_import_relatively():
    modules = {"x": module("from . import y\ndef main(argv):\n    print(y.WORD)\n    return 7\n"), "y": module("WORD = 'sibling'\n")}
    done = run(payload.pack("x", modules))
    assert done.stdout == b"sibling\n" and done.returncode == 7


def test_a_file_a_user_could_have_written_is_never_imported_in_place_of_the_payloads_module(tmp_path):
    """The payload's finder comes first: a planted mnft_onhost package in the working directory (sys.path[0] of
    `python -c`) or on PYTHONPATH is never read."""
    planted = tmp_path / boot.PACKAGE
    planted.mkdir()
    (planted / "__init__.py").write_text("raise SystemExit('planted package imported')\n")
    (planted / "y.py").write_text("WORD = 'planted'\n")
    modules = {"x": module("from . import y\ndef main(argv):\n    print(y.WORD)\n"), "y": module("WORD = 'shipped'\n")}
    done = run(payload.pack("x", modules), cwd=str(tmp_path), env={"PYTHONPATH": str(tmp_path)})
    assert done.stdout == b"shipped\n", done.stderr


def test_a_module_the_payload_lacks_is_an_import_error_not_a_file_read(tmp_path):
    (tmp_path / boot.PACKAGE).mkdir()
    (tmp_path / boot.PACKAGE / "z.py").write_text("WORD = 'planted'\n")
    modules = {"x": module("def main(argv):\n    from . import z\n    print(z.WORD)\n")}
    done = run(payload.pack("x", modules), cwd=str(tmp_path), env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1 and b"ImportError" in done.stderr and b"planted" not in done.stdout


def test_a_python_older_than_the_promise_gets_one_line_naming_the_fix():
    wrapper = ("import sys,runpy\nclass V(tuple): pass\nsys.version_info = V((3, 7, 9))\n"
               f"exec({pyrun.BOOTSTRAP!r})\n")
    done = subprocess.run([sys.executable, "-S", "-c", wrapper], input=pyrun.payload("leasehost"), capture_output=True, timeout=60)
    assert done.returncode == 3
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "Python is 3.7; mnft's host side needs Python 3.8 or newer" in lines[0] and "`python:`" in lines[0]


def test_a_python_without_zlib_gets_one_line_too():
    wrapper = f"import sys\nsys.modules['zlib'] = None\nexec({pyrun.BOOTSTRAP!r})\n"
    done = subprocess.run([sys.executable, "-S", "-c", wrapper], input=pyrun.payload("leasehost"), capture_output=True, timeout=60)
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 3 and len(lines) == 1 and lines[0].startswith("mnft: this host's Python cannot read mnft's payload")


@pytest.mark.parametrize("planted", ["zlib", "json", "importlib", "marshal"])
def test_nothing_in_the_working_directory_is_imported_before_or_after_the_payloads_finder(tmp_path, planted):
    """`python -c` looks in its working directory first: a user's zlib.py or json.py there (root's command run from
    another user's directory, a Slurm step in the project) never runs; the bootstrap takes the directory off the path."""
    (tmp_path / f"{planted}.py").write_text("import sys\nsys.stderr.write('PLANTED RAN\\n')\nsys.exit(9)\n")
    done = run(pyrun.payload("leasehost"), "show", cwd=str(tmp_path), env={"MNFT_LEASE_DIR": str(tmp_path)})
    assert done.returncode == 0 and b"PLANTED" not in done.stderr, done.stderr


def test_a_host_traceback_names_the_payloads_module_and_line_never_a_path_of_the_controller():
    assert str(payload.HOST_PACKAGE).encode() not in zlib_body(payload.build("leasehost"))
    source = "def main(argv):\n    raise ValueError('boom')\n"
    code = payload._named(compile(source, "/controller/checkout/mnft/onhost/x.py", "exec", dont_inherit=True), boot.filename("x"))
    done = run(payload.pack("x", {"x": (source.encode(), marshal.dumps(code))}))
    said = done.stderr.decode()
    assert done.returncode == 1 and '"<mnft_onhost>/x.py", line 2, in main' in said and "ValueError: boom" in said, said
    assert "/controller/" not in said


def zlib_body(data: bytes) -> bytes:
    import zlib

    return zlib.decompress(data.split(b"\n", 1)[1])


def test_a_process_that_outlives_its_channel_starts_from_its_own_copy_of_the_payload(tmp_path):
    copy = tmp_path / "agent.payload"
    copy.write_bytes(pyrun.payload("agent"))
    done = subprocess.run([sys.executable, "-S", "-c", boot.FILE_BOOTSTRAP, str(copy), "status", str(tmp_path / "no-run")],
                          capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and json.loads(done.stdout.decode().splitlines()[-1]) is not None, done.stderr


def test_another_payload_runs_in_the_same_process_and_leaves_its_modules_as_they_were():
    """A hold or the probe's session runs the controller's second payload (the tree hash) in its own process: that
    payload's modules for the call, its own after."""
    first = payload.pack("x", {"x": module("def main(argv):\n    return 0\n"), "y": module("WORD = 'first'\n")})
    second = payload.pack("x", {"x": module("from . import y\ndef main(argv):\n    return y.WORD + ' ' + ' '.join(argv)\n"),
                                "y": module("WORD = 'second'\n")})
    code = ("import sys,base64,marshal,zlib\n"
            "h,b=sys.stdin.buffer.read().split(b'\\n',1)\n"
            "from mnft.onhost import boot\n"
            f"boot._install({first!r})\n"
            "from mnft_onhost import y\n"
            "print(boot.run(h+b'\\n'+b, ['a']))\n"
            "import mnft_onhost.y as again\n"
            "print(again.WORD, again is y)\n")
    done = subprocess.run([sys.executable, "-c", code], input=second, capture_output=True, timeout=60)
    assert done.stdout.decode().splitlines() == ["second a", "first True"], done.stderr


def test_the_probe_session_runs_a_sent_entry_and_keeps_its_output_within_bounds(monkeypatch):
    request = pyrun.run_request("treehash", ["--help"])
    ran = probe.run_script(request)
    assert ran["exit_code"] is not None and ran["error"] is None
    say = payload.pack("x", {"x": module("def main(argv):\n    print('x' * 11)\n")})
    import base64

    monkeypatch.setattr(probe, "RUN_STDOUT_CHARS", 10)
    ran = probe.run_script({"payload": base64.b64encode(say).decode()})
    assert ran["stdout"] == "" and ran["error"] == "printed more than 10 characters"


def test_the_bootstrap_fits_on_a_command_line_and_never_names_a_file_to_import():
    for line in (boot.BOOTSTRAP, boot.FILE_BOOTSTRAP):
        assert len(line) < 1000 and "import mnft" not in line
        assert line.startswith("import sys\nsys.path[:]=[p for p in sys.path if p]\n")  # the working directory off, first
    assert Path(payload.HOST_PACKAGE, "boot.py").is_file()


def test_the_imports_read_from_a_modules_text_are_those_pythons_parser_reads():
    import ast

    for path in sorted(payload.HOST_PACKAGE.glob("*.py")):
        parsed = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                parsed.update([node.module.split(".")[0]] if node.module else [alias.name for alias in node.names])
        assert payload.imported(path.stem) == {n for n in parsed if (payload.HOST_PACKAGE / f"{n}.py").is_file()}, path.name
