"""What the cluster tests of `train` share: reading a controller's output, finding a run's processes on a host
(inside its namespace, by what they run), and the latest run record."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

RUN_MARKERS = ("torch.distributed.run", "mnft.recipes", "agent.payload", "mnft_boot")
REPO = Path(__file__).resolve().parent.parent


def add_hf_trainer_example(repo: Path) -> Path:
    """The project's HF Trainer example and its job file, as a lab's own git repository holds them (staged)."""
    (repo / "examples" / "hf_trainer").mkdir(parents=True)
    (repo / "jobs").mkdir()
    shutil.copy(REPO / "examples" / "hf_trainer" / "train_tiny.py", repo / "examples" / "hf_trainer" / "train_tiny.py")
    shutil.copy(REPO / "examples" / "jobs" / "hf_trainer.yaml", repo / "jobs" / "hf_trainer.yaml")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    return repo


def wait_for_output(proc: subprocess.Popen, pattern: str, timeout: float = 180) -> list[str]:
    """Read the controller's output until a line matches (e.g. the first training step)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"{pattern!r} never appeared:\n" + "".join(seen[-40:]))


def wait_listening(cluster, host, port: int, timeout: float = 30) -> None:
    """Until something listens on the TCP port inside the host's namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f":{port} " in cluster.run(host, ["ss", "-Hltn"]).stdout:
            return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port} in {host.name}")


def run_processes(cluster, hosts, markers=RUN_MARKERS) -> dict[str, list[str]]:
    out = {}
    for host in hosts:
        procs = [cmd for _, cmd in cluster.processes(host) if any(m in cmd for m in markers)]
        if procs:
            out[host.name] = procs
    return out


def wait_no_orphans(cluster, hosts, timeout: float = 40, markers=RUN_MARKERS) -> None:
    deadline = time.monotonic() + timeout
    while True:  # looks at least once, even when the deadline has already passed
        survivors = run_processes(cluster, hosts, markers)
        if not survivors:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"processes of the run survived: {survivors}")
        time.sleep(0.5)


def latest_record(tmp_path: Path) -> dict:
    """The run created last (two runs in one second: their ids sort by their random part, not by time)."""
    records = [json.loads((run / "run.json").read_text()) for run in sorted((tmp_path / "runs").glob("[!.]*")) if (run / "run.json").is_file()]
    return max(records, key=lambda r: (r.get("created") or 0, r["run_id"]))


class Controller:
    """A lab member's own controller: mnft run as them from the checkout, with their own home, `$MNFT_HOME` (known
    hosts, snapshot store) and runs/ under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(exist_ok=True)

    def env(self) -> dict:
        home = self.dir / "home"
        home.mkdir(exist_ok=True)
        return dict(os.environ, HOME=str(home), MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(self.dir / "runs"), PYTHONUNBUFFERED="1")

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "invoke", "-r", str(REPO), *args]

    def mnft(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=REPO, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False)

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), cwd=REPO, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
