"""A slow host during training is named: a CPU burner on one simulated host makes its rank compute slower, and
the progress line, `status` and the run record say which host holds the gang back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runhelpers import latest_record, wait_for_output, wait_no_orphans

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def test_a_busy_host_is_named_the_straggler_while_training(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(3)  # h1 and h3 share a CPU, h2 has its own: a burner there slows h2 only
    hosts = cluster.hosts[1:3]  # h2 (burned) and h3
    inv = cluster.write_inventory(tmp_path / "inv.yaml", hosts=hosts, slots=1)
    env = dict(os.environ, HOME=str(tmp_path), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    train = [sys.executable, "-m", "invoke", "-r", str(REPO), "train", "--hosts", str(inv), "--src", str(REPO),
             "--set", "max_steps=100000", "--set", "log_every=20", "--set", "save_every=100000"]
    proc = subprocess.Popen(train, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    burner = None
    try:
        # h2 gets busy once the run trains (a neighbour's job starting mid-run; burned from the start, h2's rank
        # imported torch on a quarter of its CPU: ~30 s more before the first step)
        wait_for_output(proc, r"\| step +\d+/", timeout=240)  # a rank's step line
        # a busy neighbour on h2's CPU: in its own session it takes about half of that CPU from h2's rank
        burner = cluster.popen(hosts[0], [cluster.python, "-c", "while True: pass"], start_new_session=True)
        # the kernel balances this machine's CPU per session (autogroup), also against whatever else runs here: a
        # moderate weight (about 3/4 of h2's CPU) keeps the burner's effect when the machine is loaded
        Path(f"/proc/{burner.pid}/autogroup").write_text("-5")
        wait_for_output(proc, r"^straggler h2: compute \d+\.\d× the median host", timeout=240)
        status = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "status", "--json"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        states = json.loads(status.stdout)["hosts"]
        assert states["h2"]["straggler"]["host"] == "h2" and states["h2"]["straggler"]["kind"] == "compute", states
        assert "straggler" not in states["h3"]
        assert set(states["h2"]["sample"]["ranks"]) == {"0"} and set(states["h3"]["sample"]["ranks"]) == {"1"}
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    record = latest_record(tmp_path)
    assert record["stragglers"]["h2"]["kind"] == "compute" and "h3" not in record["stragglers"]
    wait_no_orphans(cluster, hosts)
    logs = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "logs"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert logs.returncode == 0, logs.stdout + logs.stderr
    run_dir = tmp_path / "runs" / record["run_id"]
    assert (run_dir / "timing.png").stat().st_size > 0 and "straggler during the run: h2" in logs.stdout
