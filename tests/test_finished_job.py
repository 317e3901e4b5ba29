"""A finished job is finished: mnft's launch wrapper (mnft.onhost.entry) records each rank whose entry point returned,
and a host that fails after every one of its ranks did (an abort while the interpreter exits) does not fail the
run; it ends as succeeded with a warning naming the cause and the fix, and recovery never sees a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import parse
from mnft.hosts import payload
from mnft.onhost import entry
from mnft.run.diagnose import after_work
from mnft.run.gang import Gang, HostLaunch
from mnft.run.launch import LaunchOptions


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory holding the wrapper, as the agent writes it."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "entry.py").write_text(payload.standalone("entry"))
    return folder


def wrapped(run_dir: Path, *argv: str, cwd: Path, rank: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(run_dir / "entry.py"), *argv], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, RANK=str(rank)))


def test_a_script_runs_as_python_would_run_it_and_its_return_is_recorded(run_dir, tmp_path):
    project = tmp_path / "proj"
    (project / "lib").mkdir(parents=True)
    (project / "lib" / "helper.py").write_text("VALUE = 'from the script dir'\n")
    (project / "lib" / "train.py").write_text(textwrap.dedent("""\
        import json, sys
        import helper
        print(json.dumps({"argv": sys.argv, "file": __file__, "name": __name__, "path0": sys.path[0], "helper": helper.VALUE}))
        """))
    done = wrapped(run_dir, "lib/train.py", "--lr", "1e-4", "two words", cwd=project)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"argv": ["lib/train.py", "--lr", "1e-4", "two words"], "file": "lib/train.py", "name": "__main__",
                    "path0": str(project / "lib"), "helper": "from the script dir"}
    assert entry.done_ranks(str(run_dir)) == [3]


def test_a_module_runs_as_python_m_would_run_it(run_dir, tmp_path):
    project = tmp_path / "proj"
    (project / "pkg").mkdir(parents=True)
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "train.py").write_text("import sys\nprint(__name__, sys.argv[0].endswith('pkg/train.py'), sys.argv[1:], sys.path[0])\n")
    done = wrapped(run_dir, "-m", "pkg.train", "x", cwd=project)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["__main__", "True", "['x']", str(project)]
    assert entry.done_ranks(str(run_dir)) == [3]


@pytest.mark.parametrize("body, code, recorded", [
    ("raise SystemExit(0)", 0, True),
    ("import sys; sys.exit()", 0, True),
    ("import sys; sys.exit(3)", 3, False),
    ("raise RuntimeError('planned failure at step 6')", 1, False),
])
def test_only_a_return_or_a_zero_exit_counts_as_done_and_the_exit_status_is_kept(run_dir, tmp_path, body, code, recorded):
    (tmp_path / "t.py").write_text(body + "\n")
    done = wrapped(run_dir, "t.py", cwd=tmp_path)
    assert done.returncode == code
    assert entry.done_ranks(str(run_dir)) == ([3] if recorded else [])
    if code == 1:
        lines = done.stderr.strip().splitlines()  # the traceback as without mnft: from the script's frame
        assert lines == ["Traceback (most recent call last):", '  File "t.py", line 1, in <module>',
                         "    raise RuntimeError('planned failure at step 6')", "RuntimeError: planned failure at step 6"], done.stderr


def test_an_abort_at_interpreter_exit_after_the_work_keeps_its_signal_and_its_done_mark(run_dir, tmp_path):
    (tmp_path / "t.py").write_text("import atexit, os\natexit.register(os.abort)\nprint('trained 40 steps')\n")
    done = wrapped(run_dir, "t.py", cwd=tmp_path, rank=0)
    assert done.returncode == -6 and "trained 40 steps" in done.stdout
    assert entry.done_ranks(str(run_dir)) == [0]


# ------------------------------------------------------------------------------------------------ the gang

TWO_HOSTS = parse("hosts:\n  h1: {connection: local}\n  h2: {connection: local}\n")


def gang_of(tmp_path, fleet) -> Gang:
    launches = [HostLaunch(host=h, node_rank=r, rank_offset=r, slots=1, argv=("true",), env={}, secret_names=(), cwd=str(tmp_path),
                           run_dir=str(tmp_path / h / "run"), output_dir=str(tmp_path / "out"), metrics=None) for r, h in enumerate(("h1", "h2"))]
    return Gang(fleet, launches, "R", LaunchOptions(grace=0.5), {})


ABORT = ["[rank0]:terminate called without an active exception", "Root Cause (first observed failure):", "[0]:",
         "  rank      : 0 (local_rank: 0)", "  exitcode  : -6 (pid: 4242)"]


def exits(gang: Gang, host: str, code: int, done: list[int], lines: tuple[str, ...] = ()) -> None:
    for text in lines:
        gang.events.put((host, {"event": "line", "text": text}))
    gang.events.put((host, {"event": "exit", "code": code, "done": done}))


@pytest.mark.timeout(60)
def test_a_host_that_aborts_after_its_work_does_not_fail_a_run_whose_every_rank_finished(tmp_path):
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        exits(gang, "h1", 134, [0], tuple(ABORT))
        exits(gang, "h2", 0, [1])
        result = gang.wait()
    assert result.ok and result.failed_host is None
    assert result.after_work == {"h1": "h1: torchrun exited with code 134"}
    warning = after_work("h1", [t for _, t in result.hosts["h1"].tail])
    assert warning.cause == "h1: rank 0 was killed by SIGABRT while the interpreter exited, after its work was done"
    assert "destroy_process_group()" in warning.fix


@pytest.mark.timeout(60)
def test_a_host_that_fails_before_its_ranks_returned_fails_the_run(tmp_path):
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        exits(gang, "h1", 134, [], tuple(ABORT))
        result = gang.wait()
    assert not result.ok and result.failed_host == "h1" and result.after_work == {}


@pytest.mark.timeout(60)
def test_the_others_get_a_bounded_time_to_finish_after_one_aborted_after_its_work(tmp_path, monkeypatch):
    monkeypatch.setattr("mnft.run.gang.FINISH_GRACE", 0.5)
    with Fleet(TWO_HOSTS) as fleet:
        gang = gang_of(tmp_path, fleet)
        gang.runs["h2"].state = "running"  # h2 never ends
        exits(gang, "h1", 134, [0], tuple(ABORT))
        result = gang.wait()
    assert not result.ok and result.failed_host == "h1"
    assert result.reason == "h1: torchrun exited with code 134 after its work; the other hosts did not end within 0.5s"


def test_a_ranks_traceback_stays_after_the_lines_it_printed_before(run_dir, tmp_path):
    """Issue 36: a failed run's last lines showed the traceback before the step lines that preceded it. torchrun
    (--tee) gives a worker's stdout and stderr a log file each and copies each by a thread of its own: the order
    between them is lost. The wrapper puts the rank's stderr into its stdout file, so one stream keeps the order."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "steps.py").write_text("for i in range(1, 4):\n    print(f'step {i} loss 1.0')\nraise RuntimeError('planned failure at step 4')\n")
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with out.open("w") as o, err.open("w") as e:  # as torchrun's redirects leave a worker
        done = subprocess.run([sys.executable, str(run_dir / "entry.py"), "steps.py"], cwd=project, stdout=o, stderr=e, timeout=60,
                              env=dict(os.environ, RANK="0"))
    assert done.returncode == 1
    lines = out.read_text().splitlines()
    assert lines[:4] == ["step 1 loss 1.0", "step 2 loss 1.0", "step 3 loss 1.0", "Traceback (most recent call last):"]
    assert lines[-1] == "RuntimeError: planned failure at step 4" and err.read_text() == ""
    piped = wrapped(run_dir, "steps.py", cwd=project, rank=0)  # a pipe (or a terminal) is left as it is
    assert piped.stdout.splitlines() == ["step 1 loss 1.0", "step 2 loss 1.0", "step 3 loss 1.0"] and "RuntimeError" in piped.stderr


@pytest.mark.slow
def test_under_torchrun_a_ranks_lines_and_traceback_come_in_one_stream(run_dir, tmp_path):
    """The sibling, as mnft starts a job (torchrun --tee 3 --log-dir, the rank prefix): rank 0's stderr file stays
    empty and its traceback follows its step lines in torchrun's output."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "steps.py").write_text("for i in range(1, 4):\n    print(f'step {i} loss 1.0')\nraise RuntimeError('planned failure at step 4')\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0",
                           "--tee", "3", "--log-dir", str(tmp_path / "torchrun"), str(run_dir / "entry.py"), "steps.py"],
                          cwd=project, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank${rank}]:"))
    assert done.returncode != 0
    stderr_files = list((tmp_path / "torchrun").rglob("stderr.log"))
    assert stderr_files and all(f.read_text() == "" for f in stderr_files)
    ranked = [line for line in done.stdout.splitlines() if line.startswith("[rank0]:")]
    assert ranked[:4] == ["[rank0]:step 1 loss 1.0", "[rank0]:step 2 loss 1.0", "[rank0]:step 3 loss 1.0", "[rank0]:Traceback (most recent call last):"]
