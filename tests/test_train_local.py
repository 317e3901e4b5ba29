"""invoke train on a local-connection inventory (the README's main command path): no SSH, local rsync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def invoke(tmp_path: Path, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp_path / "home"), MNFT_RUNS_DIR=str(tmp_path / "runs"), **(env_extra or {}))
    (tmp_path / "home").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def local_inventory(tmp_path):
    if not any(os.access(os.path.join(d, "rsync"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("rsync is not installed")
    inv = tmp_path / "local.yaml"
    inv.write_text(f"hosts:\n  me:\n    connection: local\n    slots: 2\n    python: {sys.executable}\n    workdir: {tmp_path / 'work'}\n")
    return str(inv)


def test_dry_run_prints_each_command_with_secrets_redacted_and_starts_nothing(tmp_path, local_inventory):
    done = invoke(tmp_path, "train", "--hosts", local_inventory, "--dry-run", "--env", "HF_TOKEN", "--set", "lr=1e-4",
                  env_extra={"HF_TOKEN": "hf-secret-123"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch.distributed.run --nnodes 1 --nproc-per-node 2 --node-rank 0 --master-addr 127.0.0.1" in done.stdout
    assert "HF_TOKEN=***" in done.stdout and "lr=1e-4" in done.stdout
    assert "hf-secret-123" not in done.stdout + done.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "work").exists()


def test_train_on_this_machine_syncs_runs_and_records(tmp_path, local_inventory):
    done = invoke(tmp_path, "train", "--recipe", "lora", "--hosts", local_inventory, "--src", str(REPO), "--set", "max_steps=6", "--set", "log_every=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = next(p for p in (tmp_path / "runs").glob("[!.]*") if p.is_dir())
    record = json.loads((run_dir / "run.json").read_text())
    job = tmp_path / "work" / "outputs" / record["job_id"]  # the job's working directory: its code, hard links to its snapshot
    snap = tmp_path / "work" / ".mnft" / "code" / record["code_hash"][:16]
    assert (job / "mnft" / "recipes" / "lora.py").samefile(snap / "mnft" / "recipes" / "lora.py")
    assert not (snap / "mnft" / "recipes" / "lora.py").stat().st_mode & 0o222  # read-only: a job cannot change another's code
    assert (tmp_path / "runs" / ".gitignore").read_text().splitlines()[-1] == "*"  # records out of git status
    assert record["state"] == "succeeded" and record["hosts"]["me"]["exit_code"] == 0
    assert record["code_hash"] and set(record["timings"]) >= {"check_s", "sync_s", "launch_s", "first_step_s", "total_s"}
    assert (run_dir / "loss.png").is_file() and (run_dir / "me" / "run" / "output.log").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["hosts"] == {"me": {"node_rank": 0, "state": "exited", "exit_code": 0}}
    assert "me r1 | rank=1/2" in done.stdout


def test_a_bad_override_is_refused_before_anything_runs(tmp_path, local_inventory):
    done = invoke(tmp_path, "train", "--hosts", local_inventory, "--set", "output_dir=/tmp/x")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["mnft: recipe override 'output_dir=/tmp/x': output_dir is set by mnft (use --resume to continue a run)"]
    assert not (tmp_path / "work").exists()


def test_a_secret_value_on_the_command_line_is_refused_in_one_line(tmp_path, local_inventory):
    done = invoke(tmp_path, "train", "--hosts", local_inventory, "--dry-run", "--env", "HF_TOKEN=hf-on-the-cmdline")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "mnft: --env HF_TOKEN=…: HF_TOKEN is a secret and would be visible on this machine's command line; "
        "use --env HF_TOKEN (value from this environment) or --env-file FILE (mode 0600)"
    ]
    assert "hf-on-the-cmdline" not in done.stdout + done.stderr


def test_a_launch_refused_by_the_check_is_recorded_with_the_failing_host(tmp_path):
    inv = tmp_path / "bad.yaml"
    inv.write_text(f"hosts:\n  me:\n    connection: local\n    python: /nonexistent/python3\n    workdir: {tmp_path / 'work'}\n")
    done = invoke(tmp_path, "train", "--hosts", str(inv))
    assert done.returncode == 1 and "check failed on me" in done.stderr
    record = json.loads(next((tmp_path / "runs").glob("*/run.json")).read_text())
    assert record["state"] == "refused" and record["launched"] is False
    assert record["check"]["failed_hosts"] == ["me"] and "check_s" in record["timings"] and "sync_s" not in record["timings"]


def test_a_host_that_cannot_start_is_recorded_failed_with_its_error(tmp_path):
    inv = tmp_path / "nowork.yaml"
    inv.write_text(f"hosts:\n  me:\n    connection: local\n    python: {sys.executable}\n    workdir: {tmp_path / 'nowork'}\n")
    done = invoke(tmp_path, "train", "--hosts", str(inv), "--no-sync")
    assert done.returncode == 1 and "did not start on every host" in done.stderr
    record = json.loads(next((tmp_path / "runs").glob("*/run.json")).read_text())
    assert record["state"] == "failed" and record["launched"] is True
    assert record["hosts"]["me"]["state"] == "failed-to-start"
    # --no-sync on a new job: the code `sync` left in the workdir, run there (and there is none)
    assert record["hosts"]["me"]["error"] == (f"working directory {tmp_path / 'nowork'} does not exist (train places "
                                              "a job's code there; with --no-sync, a new job runs what the `sync` task left in the workdir, a resume "
                                              "what its job's directory holds)")
    assert record["launch"] == {"in_workdir": True}


def test_a_bug_in_mnft_during_supervision_ends_the_run_recorded_with_its_processes_gone(tmp_path, local_inventory):
    import psutil

    boom = ("import mnft.run.progress as p\n"
            "def metric(self, data):\n    raise RuntimeError('a bug in the display')\n"
            "p.Display.metric = metric\n"
            "from mnft.cli.main import main; main()")
    env = dict(os.environ, HOME=str(tmp_path / "home"), MNFT_RUNS_DIR=str(tmp_path / "runs"))
    (tmp_path / "home").mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", boom, "train", "--recipe", "lora", "--hosts", local_inventory, "--src", str(REPO),
                           "--set", "max_steps=200"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "a bug in the display" in done.stderr  # a bug keeps its traceback
    record = json.loads(next((tmp_path / "runs").glob("[!.]*")).joinpath("run.json").read_text())
    assert record["state"] == "failed" and record["reason"] == "mnft error: RuntimeError: a bug in the display"
    def left():
        return [p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if record["run_id"] in " ".join(p.info["cmdline"] or [])]

    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left() == []  # torn down by mnft (the last keeper exits a moment after it is killed)


def test_no_sync_runs_a_new_job_on_what_sync_left_in_the_workdir_there(tmp_path, local_inventory):
    """--no-sync sends nothing: a new job runs the code `sync` put in the workdir, started there (its relative paths
    are the workdir's), and says so in its record; the job's own directory is not made."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "where.py").write_text("import os\nprint('cwd', os.getcwd(), flush=True)\n")
    synced = invoke(tmp_path, "sync", "--hosts", local_inventory, "--src", str(repo))
    assert synced.returncode == 0, synced.stdout + synced.stderr
    (repo / "where.py").write_text("print('not this version')\n")  # not sent: --no-sync
    done = invoke(tmp_path, "train", "--hosts", local_inventory, "--no-sync", "--src", str(repo), "--", "where.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"cwd {tmp_path / 'work'}" in done.stdout and "not this version" not in done.stdout
    record = json.loads(next((tmp_path / "runs").glob("*/run.json")).read_text())
    assert record["launch"] == {"in_workdir": True} and not (tmp_path / "work" / "outputs" / record["job_id"]).exists()
