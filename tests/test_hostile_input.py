"""Whatever a file mnft reads holds, reading it costs a bounded time and memory; past a limit it ends in exit 2
and one line naming the file and the limit, never a traceback, a hang or a MemoryError (issue 19, class 1). Values
that reach a file or a command are validated whole (class 2).

A table of bad inputs per parser (inventories in their four formats, job files, lock files, env files, run
records), each measured: a generous bound on time (2 s) and on memory (tracemalloc's peak, 50 MB), not a
benchmark. Hypothesis generates more from the pieces that make parsers blow up (aliases, brackets, digits). The
real command line is run for a few of them: exit 2, one line on stderr, no traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mnft.core import limits
from mnft.core.errors import InputError
from mnft.env import lockfile
from mnft.hosts import inventory
from mnft.run import job as jobs
from mnft.run import launch, records, torchrunargs

REPO = Path(__file__).resolve().parent.parent
SECONDS, BYTES = 5.0, 50 * 1024 * 1024  # generous (not a benchmark): the worst input takes ~0.6 CPU s here, under 1 s wall alone


def measured(call, *args):
    """(what call(*args) returned or the InputError it raised, CPU seconds, peak bytes): timed once as it runs (the
    thread's CPU time: other work on a loaded machine does not count), then run again under tracemalloc for its
    memory (tracemalloc slows Python code down several times)."""
    def once():
        try:
            return call(*args)
        except InputError as exc:
            return exc

    start = time.thread_time()
    once()
    elapsed = time.thread_time() - start
    tracemalloc.start()
    try:
        outcome = once()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return outcome, elapsed, peak


def refused(call, *args) -> str:
    """The one-line InputError `call(*args)` raises, within the time and memory bound."""
    outcome, elapsed, peak = measured(call, *args)
    assert isinstance(outcome, InputError), f"not refused: {outcome!r}"[:300]
    message = str(outcome)
    assert "\n" not in message, message
    assert elapsed < SECONDS, f"{elapsed:.2f} s: {message}"
    assert peak < BYTES, f"{peak >> 20} MB: {message}"
    return message


def bounded(call, *args):
    """call(*args) returns or raises InputError (one line), within the bound; any other exception is a bug."""
    outcome, elapsed, peak = measured(call, *args)
    assert not isinstance(outcome, InputError) or "\n" not in str(outcome), str(outcome)
    assert elapsed < SECONDS and peak < BYTES, (elapsed, peak >> 20)
    return outcome


def bomb(levels: int = 9, width: int = 9) -> str:
    """The billion laughs: each anchor a list of `width` aliases of the previous one: width**levels leaves."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels + 1):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def _inline_bomb(levels: int = 9, width: int = 9) -> str:
    """The same bomb inside one value: [&l0 [lol, …], &l1 [*l0, …], …]."""
    items = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    items += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return ", ".join(items)


def indent(text: str, by: int) -> str:
    return "".join(" " * by + line + "\n" for line in text.splitlines())


# ------------------------------------------------------------------------------------------------ inventories

INVENTORIES = {
    # the defects of issue 19: an alias bomb hung `check`, a billion-host range ended in MemoryError, an integer
    # of a few thousand digits and a deeply nested document in a traceback
    "alias bomb (Ansible vars)": ("all:\n  vars:\n" + indent(bomb(), 4) + "  hosts:\n    n1:\n", "expands to more than"),
    "alias bomb (an Ansible host's value)": ("all:\n  vars:\n" + indent(bomb(), 4) + "  hosts:\n    n1:\n"
                                             "      ansible_host: *l9\n", "expands to more than"),
    "alias bomb (a host's value)": ("hosts:\n  n1:\n    address: [" + _inline_bomb() + "]\n", "expands to more than"),
    "billion-host range": ("all:\n  hosts:\n    node[1:1000000000]:\n", "expands to more than 4096 hosts"),
    "ranges multiplied": ("all:\n  hosts:\n    n[1:1000][1:1000][1:1000]:\n", "expands to more than 4096 hosts"),
    "thousands-digit integer": ("hosts:\n  n1:\n    slots: " + "9" * 5000 + "\n", "an integer of 5000 characters"),
    "thousands-digit port": ("all:\n  hosts:\n    n1:\n      ansible_port: " + "1" * 4000 + "\n", "an integer of 4000"),
    "sexagesimal integer": ("hosts:\n  n1:\n    slots: 1" + ":59" * 3000 + "\n", "an integer of"),
    "deep flow nesting": ("hosts:\n  n1:\n    slots: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than 64"),
    "deep block nesting": ("".join(" " * i + f"k{i}:\n" for i in range(200)), "nested deeper than 64"),
    "deep Ansible groups": ("all:\n" + "".join("  " * (2 * i + 1) + f"children:\n{'  ' * (2 * i + 2)}g{i}:\n"
                                              for i in range(40)), "nested deeper than 64"),
    "an alias to its own list": ("a: &a [*a]\nhosts: {n1: {}}\n", "refers to the collection that holds it"),
    "too many aliases": ("a: &a 1\nb: [" + ", ".join(["*a"] * 10_001) + "]\n", "more than 10000 YAML aliases"),
    "too many nodes": ("hosts: {n1: {}}\nx:\n" + "- 1\n" * 120_000, "more than 100000 YAML nodes"),
    "many nodes on long lines": ("hosts: {n1: {}}\nx:\n" + ("  - [" + "1," * 30_000 + "1]\n") * 4, "more than 100000"),
    "merge-key bomb": ("a0: &a0 {k: 1}\n" + "".join(f"a{i}: &a{i} {{<<: [{', '.join([f'*a{i - 1}'] * 9)}]}}\n"
                                                    for i in range(1, 10)) + "hosts: {n1: {}}\n", "expands to more than"),
    "too many hosts": ("hosts:\n" + "".join(f"  n{i}: {{}}\n" for i in range(5000)), "more than 4096 hosts"),
    "a line of 100 KiB": ("hosts:\n  n1:\n    user: " + "u" * 100_000 + "\n", "line longer than 65536 characters"),
    "a host value ending in a newline": ('hosts:\n  n1:\n    address: "n1\\n"\n', "must be a single line"),
    "a host name ending in a newline": ('hosts:\n  "n1\\n": {}\n', "not a valid host name"),
    # the same in Ansible's INI form
    "INI: billion-host range": ("[gpu]\nnode[1:1000000000]\n", "expands to more than 4096 hosts"),
    "INI: a port of thousands of digits": ("[gpu]\nn1:" + "9" * 5000 + "\n", "is not a port number"),
    "Ansible: a port of 900 digits": ("all:\n  hosts:\n    'n1:" + "9" * 900 + "':\n", "is not a port number"),
    "INI: thousands-digit integer": ("[gpu]\nn1 ansible_port=" + "9" * 5000 + "\n", "an integer of 5000 characters"),
    "INI: a literal of thousands of digits": ("[gpu]\nn1 slots=[" + "9" * 4000 + "]\n", "an integer longer than 32"),
    "INI: deep literal": ("[gpu]\nn1 x=" + "[" * 5000 + "]" * 5000 + "\n", None),  # Ansible's reading: text
    "INI: groups reached by 2**40 paths": (
        "[g0]\nn1\n" + "".join(f"[a{i}:children]\ng{i}\n[b{i}:children]\ng{i}\n[g{i + 1}:children]\na{i}\nb{i}\n"
                               for i in range(40)), "reached by more than 100000 paths"),
    "INI: too many hosts": ("[gpu]\n" + "".join(f"n{i}\n" for i in range(5000)), "more than 4096 hosts"),
    "INI: a host value ending in a newline": ("[gpu]\nn1 ansible_host=\"'n1\\n'\"\n", "must be a single line"),
    # DeepSpeed hostfile
    "hostfile: thousands-digit slots": ("n1 slots=" + "9" * 5000 + "\n", "an integer of 5000 characters"),
    "hostfile: too many hosts": ("".join(f"n{i} slots=1\n" for i in range(5000)), "more than 4096 hosts"),
}


@pytest.mark.timeout(30)  # a regression hangs (the alias bomb did): fail instead of blocking the suite
@pytest.mark.parametrize("name", INVENTORIES)
def test_a_hostile_inventory_is_refused_in_one_line_at_a_bounded_cost(tmp_path, name):
    text, message = INVENTORIES[name]
    path = tmp_path / "inv"
    path.write_text(text)
    if message is None:  # read, at a bounded cost
        assert not isinstance(bounded(inventory.load, path), InputError)
        return
    said = refused(inventory.load, path)
    assert said.startswith(f"{path}") and message in said, said


def test_an_inventory_larger_than_its_limit_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "inv.yaml"
    with open(path, "wb") as f:
        f.truncate(2 * 1024 * 1024 * 1024)  # 2 GiB, sparse
    assert "larger than 1 MiB" in refused(inventory.load, path)


def test_an_inventory_from_a_pipe_is_read_one_byte_past_its_limit(tmp_path):
    fifo = tmp_path / "inv.yaml"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"yes 'n1 slots=1' > {fifo}"], stderr=subprocess.DEVNULL)
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="larger than 1 MiB"):  # an endless stream: one read, bounded
            inventory.load(fifo)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        writer.kill()
        writer.wait()
    assert peak < 4 * limits.INVENTORY_BYTES


def test_every_limit_has_its_place_in_the_docs():
    doc = (REPO / "docs" / "security.md").read_text()
    for name, value, _ in limits.TABLE:
        assert f"`{name}`" in doc, name


# pieces that make YAML, range and INI parsers blow up, put together at random
YAML_PIECES = st.sampled_from(["&a ", "*a", "&b ", "*b", "[", "]", "{", "}", ", ", ": ", "- ", "\n", "  ", "<<: *a",
                               "9" * 40, "n[1:99999]", "all:", "hosts:", "children:", "vars:", "x", "'", '"', "!!int ",
                               "1:2:3", "0x" + "f" * 40, "\t", "? ", "|\n", "%YAML 1.1\n---\n", "*c", "n1:" + "9" * 40])
INI_PIECES = st.sampled_from(["[g]", "[g:vars]", "[g:children]", "[all:vars]", "\n", "n[1:99999]", "n1", " ", "=",
                              "ansible_port", "slots", "9" * 40, "[", "]", "(", ")", "'", '"', "#", ";", "\\", "g",
                              "ansible_host", "True", "{1:[2]}", "-", ":", "1e999", "n1:" + "9" * 40])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(YAML_PIECES, max_size=60).map("".join))
def test_any_yaml_shaped_text_is_an_inventory_or_one_line(text):
    bounded(inventory.parse, text, Path("inv.yaml"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(INI_PIECES, max_size=60).map("".join))
def test_any_ini_shaped_text_is_an_inventory_or_one_line(text):
    bounded(inventory.parse, "[g]\n" + text, Path("hosts.ini"))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_at_all_is_an_inventory_or_one_line(text):
    bounded(inventory.parse, text, Path("inv"))


# ------------------------------------------------------------------------------------------------ job files

JOBS = {
    "alias bomb": (bomb() + "script: train.py\nargs: *l9\n", "expands to more than"),
    "deep nesting": ("script: train.py\nargs: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than 64"),
    "thousands-digit exit code": ("script: train.py\nresume:\n  exit_codes: [" + "9" * 5000 + "]\n", "an integer of 5000"),
    "a line of 100 KiB": ("script: train.py\nname: " + "n" * 100_000 + "\n", "line longer than 65536"),
    "a module ending in a newline": ('module: "pkg.train\\n"\n', "is not a module name"),
    "a job name with an escape": ('script: a.py\nname: "x\\e[2J"\n', "without control characters"),
    "a script path with a carriage return": ('script: "a.py\\r"\n', "without control characters"),
    "an argument holding NUL": ('script: a.py\nargs: ["a\\0b"]\n', "holds a NUL character"),
    "torchrun: an abbreviation of --nnodes": ("script: a.py\ntorchrun: ['--nnod=2']\n", "reads --nnod as --nnodes"),
    "torchrun: --opt value": ("script: a.py\ntorchrun: ['--master-addr', 'x']\n", "--master-addr is set by mnft"),
    "torchrun: a short option with its value": ("script: a.py\ntorchrun: ['-r3']\n", "reads -r3 as --redirects"),
    "torchrun: flags combined": ("script: a.py\ntorchrun: ['-mt3']\n", "--module or --tee"),
    "torchrun: help": ("script: a.py\ntorchrun: ['--he']\n", "reads --he as --help"),
    "torchrun: ambiguous": ("script: a.py\ntorchrun: ['--dup', 'x']\n", "is ambiguous"),
    "torchrun: a word torchrun would run": ("script: a.py\ntorchrun: ['--role', 'r', 'other.py']\n", "'other.py' is not an option"),
    "env: torchrun's own through PET_": ("script: a.py\nenv: {PET_STANDALONE: '1'}\n", "sets a torchrun option mnft owns"),
    "pass_env: torchrun's own through PET_": ("script: a.py\npass_env: [PET_NNODES]\n", "reads PET_NNODES as --nnodes"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", JOBS)
def test_a_hostile_job_file_is_refused_in_one_line_at_a_bounded_cost(tmp_path, name):
    text, message = JOBS[name]
    path = tmp_path / "job.yaml"
    path.write_text(text)
    said = refused(jobs.load_job_file, path)
    assert said.startswith(str(path)) and message in said, said


def test_torchrun_options_mnft_does_not_own_pass_however_written(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("script: a.py\ntorchrun: ['--monitor-interval=1', '--local-addr', 'n1', '--numa-binding', 'node', "
                    "'--virtual-local-rank', '--some-newer-option', 'v']\n")
    assert jobs.load_job_file(path).torchrun[0] == "--monitor-interval=1"


def torchs_parser():
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def test_the_table_of_torchrun_options_is_torchs_own():
    parser = torchs_parser()
    assert parser.allow_abbrev and parser.prefix_chars == "-"
    found = tuple((tuple(a.option_strings), a.dest, a.nargs != 0) for a in parser._actions if a.option_strings)
    assert found == torchrunargs.OPTIONS


OPTION_WORDS = st.builds(
    lambda strings, cut, value: strings[:max(2, cut)] + value,
    st.sampled_from([s for strings, _, _ in torchrunargs.OPTIONS for s in strings]),
    st.integers(2, 30),
    st.sampled_from(["", "=1", "3", "t3", "=x=y"]),
)


def _raise(message):
    raise ValueError(message)


@settings(max_examples=400, deadline=None)
@given(OPTION_WORDS)
def test_an_option_torchrun_reads_as_one_of_mnfts_is_refused(word):
    """torch's own parser (argparse, this Python) says which options a word sets; whenever one is mnft's, or
    argparse refuses the word as ambiguous, mnft refuses it before anything runs."""
    parser = torchs_parser()
    defaults = vars(parser.parse_args(["x.py"]))
    parser.error = _raise  # argparse's error() would print and exit
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args, _ = parser.parse_known_args([word, "1", "x.py"])  # "1": the value of an option that takes one
        changed = {dest for dest, value in vars(args).items() if value != defaults[dest]}
    except ValueError as exc:
        changed = {"ambiguous"} if "ambiguous" in str(exc) else set()
    except SystemExit:  # --help printed the help
        changed = {"help"}
    changed -= {"training_script", "training_script_args"}
    if changed & (torchrunargs.OWNED | {"ambiguous"}):
        assert torchrunargs.refusal([word, "1"]) is not None, (word, changed)


# ------------------------------------------------------------------------------------------------ lock files

LOCKS = {
    "requirements.lock": {
        "a version of thousands of digits": ("torch==" + "9" * 5000 + "\n", "is not a version"),
        "a line of 100 KiB": ("torch==2.6.0 --hash=sha256:" + "a" * 100_000 + "\n", "line longer than 65536"),
    },
    "pylock.toml": {
        "deep nesting": ('lock-version = "1.0"\nx = ' + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than"),
        "deep inline tables": ('lock-version = "1.0"\nx = ' + "{a = " * 3000 + "1" + "}" * 3000 + "\n", "nested deeper"),
        "thousands-digit integer": ('lock-version = "1.0"\nx = ' + "9" * 5000 + "\n", "an integer longer"),
        "a version of thousands of digits": ('lock-version = "1.0"\n[[packages]]\nname = "torch"\nversion = "'
                                             + "9" * 5000 + '"\n', "is not a version"),
    },
}


@pytest.mark.parametrize("name, case", [(n, c) for n, cases in LOCKS.items() for c in cases])
def test_a_hostile_lock_file_is_refused_in_one_line(tmp_path, name, case):
    text, message = LOCKS[name][case]
    path = tmp_path / name
    path.write_text(text)
    said = refused(lockfile.load, path)
    assert said.startswith(str(path)) and message in said, said


def test_a_lock_larger_than_its_limit_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "requirements.lock"
    with open(path, "wb") as f:
        f.truncate(limits.LOCK_BYTES + 1)
    assert "larger than 16 MiB" in refused(lockfile.load, path)


# ------------------------------------------------------------------------------------------------ env files

ENV_FILES = {
    "a line of 100 KiB": ("TOKEN=" + "x" * 100_000 + "\n", "line longer than 65536"),
    "a value holding NUL": ("TOKEN=a\0b\n", "holds a NUL character"),
    "not UTF-8": ("TOKEN=\udcff\n", "not UTF-8"),
    "larger than its limit": ("A=" + "x" * 60_000 + "\n") * 5,
    "a name ending in a space and newline": ("TOKEN \n=x\n", "expected NAME=VALUE"),
    "torchrun's own through PET_": ("PET_NNODES=4\n", "sets a torchrun option mnft owns"),
}


@pytest.mark.parametrize("name", ENV_FILES)
def test_a_hostile_env_file_is_refused_in_one_line(tmp_path, name):
    case = ENV_FILES[name]
    text, message = case if isinstance(case, tuple) else (case, "larger than 256 KiB")
    path = tmp_path / "secrets.env"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    path.chmod(0o600)
    said = refused(launch.split_env, (), {}, (str(path),))
    assert str(path) in said or "PET_NNODES" in said
    assert message in said, said


# ------------------------------------------------------------------------------------------------ run records

RECORDS = {
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "thousands-digit integer": '{"run_id": "r1", "created": ' + "9" * 5000 + "}",
    "not an object": "[1, 2]",
    "not UTF-8": b'{"run_id": "\xff"}',
    "someone else's": '{"run_id": "r2"}',
}


@pytest.mark.parametrize("name", RECORDS)
def test_a_damaged_run_record_is_one_line(tmp_path, monkeypatch, name):
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    (tmp_path / "r1").mkdir()
    data = RECORDS[name]
    (tmp_path / "r1" / "run.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    assert "run.json" in refused(records.load, "r1")


def test_a_run_record_larger_than_its_limit_is_refused_without_reading_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    (tmp_path / "r1").mkdir()
    with open(tmp_path / "r1" / "run.json", "wb") as f:
        f.truncate(limits.RECORD_BYTES + 1)
    assert "larger than 64 MiB" in refused(records.load, "r1")


@pytest.mark.parametrize("run_id", ["../x", "/etc", "a/b", "r1\n", ".hidden", "r1/../../x"])
def test_a_run_id_never_leaves_runs(tmp_path, monkeypatch, run_id):
    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "run.json").write_text(json.dumps({"run_id": "../x"}))
    assert "not a run id" in refused(records.load, run_id)


def test_a_damaged_inventory_snapshot_is_one_line():
    from mnft.run.rerun import from_snapshot

    good = {"path": None, "format": "mnft", "master": "n1", "known_hosts": None, "rendezvous_port": 29500,
            "hosts": [{"name": "n1", "address": "10.0.0.1"}]}
    assert from_snapshot(good).hosts[0].address == "10.0.0.1"
    for bad in (None, {}, {**good, "hosts": [{"name": "n1", "address": "10.0.0.1\n"}]},
                {**good, "hosts": [{"name": "n1", "user": "x; id"}]}, {**good, "rendezvous_port": "9" * 99},
                {**good, "hosts": [{"name": "n1", "unknown": 1}], "master": "n2"}):
        refused(from_snapshot, bad)


# ------------------------------------------------------------------------------------------------ the real CLI


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MNFT_RUNS_DIR": str(tmp_path / "runs"), "MNFT_HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["alias bomb (Ansible vars)", "billion-host range", "thousands-digit integer",
                                  "deep flow nesting", "INI: billion-host range"])
def test_the_command_line_exits_2_with_one_line_naming_the_file(tmp_path, name):
    path = tmp_path / "hosts"
    path.write_text(INVENTORIES[name][0])
    done = cli(tmp_path, "inventory", "--hosts", str(path))
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert str(path) in done.stderr and INVENTORIES[name][1] in done.stderr


@pytest.mark.timeout(120)
def test_resume_run_refuses_a_run_id_outside_runs(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "run.json").write_text(json.dumps({"run_id": "../x", "state": "failed", "launched": True}))
    done = cli(tmp_path, "train", "--resume-run", "../x", "--dry-run")
    assert done.returncode == 2 and "not a run id" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1
