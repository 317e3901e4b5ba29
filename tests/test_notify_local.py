"""--notify on a real run (a local-connection inventory: no SSH): it is told the outcome of a finished and of a
failed run, after the run's end is recorded, and a notify command that hangs is killed without holding the run's
end or changing its outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def invoke(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HOME=str(tmp_path / "home"), MNFT_RUNS_DIR=str(tmp_path / "runs"))
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def told(path: Path) -> dict:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line.startswith("MNFT_NOTIFY_"))


@pytest.fixture
def lab(tmp_path):
    if not any(os.access(os.path.join(d, "rsync"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("rsync is not installed")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".invoke.yaml").write_text("notify:\n  timeout: 2\n")  # the user's config: a short bound
    inv = tmp_path / "local.yaml"
    inv.write_text(f"hosts:\n  me:\n    connection: local\n    slots: 1\n    python: {sys.executable}\n    workdir: {tmp_path / 'work'}\n")
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.py").write_text("print('done')\n")
    (src / "fail.py").write_text("import sys\nprint('giving up')\nsys.exit(3)\n")
    return inv, src


def test_notify_gets_a_finished_runs_outcome_and_a_hanging_notify_does_not_hold_its_end(tmp_path, lab):
    inv, src = lab
    line = f'env > {tmp_path}/told; cp "$MNFT_NOTIFY_LOG/run.json" {tmp_path}/seen.json; echo $$ > {tmp_path}/pid; exec sleep 300'
    done = invoke(tmp_path, "train", "--hosts", str(inv), "--src", str(src), "--notify", line, "--", "ok.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(next((tmp_path / "runs").glob("[!.]*/run.json")).read_text())
    env = told(tmp_path / "told")
    assert env["MNFT_NOTIFY_RUN"] == record["run_id"] and env["MNFT_NOTIFY_EVENT"] == "ended"
    assert (env["MNFT_NOTIFY_OUTCOME"], env["MNFT_NOTIFY_EXIT_CODE"], env["MNFT_NOTIFY_HOSTS"]) == ("succeeded", "0", "me")
    assert Path(env["MNFT_NOTIFY_LOG"]) == tmp_path / "runs" / record["run_id"]
    assert json.loads((tmp_path / "seen.json").read_text())["state"] == "succeeded"  # its end was recorded before it was told
    assert "warning: the notify command (--notify) took more than 2s and was killed (the run's outcome is unchanged)" in done.stdout
    assert not Path(f"/proc/{(tmp_path / 'pid').read_text().strip()}").exists()  # the hanging command is gone
    assert record["state"] == "succeeded" and record["notified"]["ended"]["ok"] is False


def test_notify_gets_a_failed_runs_outcome_exit_code_and_cause(tmp_path, lab):
    inv, src = lab
    done = invoke(tmp_path, "train", "--hosts", str(inv), "--src", str(src), "--notify", f"env > {tmp_path}/told", "--", "fail.py")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(next((tmp_path / "runs").glob("[!.]*/run.json")).read_text())
    env = told(tmp_path / "told")
    assert (env["MNFT_NOTIFY_OUTCOME"], env["MNFT_NOTIFY_FAILED_HOST"]) == ("failed", "me")
    assert env["MNFT_NOTIFY_EXIT_CODE"] == str(record["hosts"]["me"]["exit_code"]) == "1"  # the host's torchrun's
    assert env["MNFT_NOTIFY_CAUSE"] == "me rank 0 exited with code 3" == record["diagnosis"]["cause"]
    assert env["MNFT_NOTIFY_FIX"] == record["diagnosis"]["fix"] and env["MNFT_NOTIFY_REASON"] == record["reason"]
    assert record["notified"]["ended"] == {"ok": True, "warning": None, "at": record["notified"]["ended"]["at"]}
