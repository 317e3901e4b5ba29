"""Issue 19 on a real simulated cluster: kill only what is provably ours (class 4), one operation per host at a
time (class 6), interrupts leave nothing behind (class 9).

The runs are a user's script that prints and ends, or sleeps (no torch work: what is tested is what mnft does
around it). Every process is looked for inside the hosts' namespaces and on this machine (the controller)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runhelpers import latest_record, run_processes, wait_no_orphans

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def cli_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")


def mnft(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def inventory(cluster, tmp_path, n=2) -> str:
    return str(cluster.write_inventory(tmp_path / "inv.yaml", hosts=cluster.hosts[:n]))


def on_host(host, path: str) -> Path:
    """A host's path ("~/…" or absolute inside the host) as this machine sees it."""
    return host.home / path[2:] if path.startswith("~/") else Path(path.replace("/root/", str(host.home) + "/", 1))


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ class 4


def test_stop_of_an_ended_run_spares_an_unrelated_process_that_reuses_its_process_group(healthy_cluster, tmp_path, lab_scripts):
    inv = inventory(healthy_cluster, tmp_path)
    done = mnft(tmp_path, "train", "--hosts", inv, "--src", str(lab_scripts), "--", "quick.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    h1 = healthy_cluster.hosts[0]
    # an unrelated process that leads its own process group, whose number the run's group had (pid reuse)
    unrelated = healthy_cluster.popen(h1, ["sleep", "300"], start_new_session=True)
    try:
        time.sleep(0.3)
        pgid_file = on_host(h1, record["hosts"]["h1"]["run_dir"]) / "pgid"
        assert pgid_file.is_file()
        pgid_file.write_text(f"{unrelated.pid}\n")
        stopped = mnft(tmp_path, "stop", record["run_id"])
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert f"run {record['run_id']} already ended on h1, h2: nothing to stop" in stopped.stdout
        assert "Traceback" not in stopped.stderr
        time.sleep(0.5)
        assert unrelated.poll() is None and alive(unrelated.pid)
        assert latest_record(tmp_path)["state"] == "succeeded"  # the record is left as it was
    finally:
        unrelated.kill()
        unrelated.wait()


# ------------------------------------------------------------------------------------------------ class 6


def wait_running(tmp_path: Path, run_id: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = mnft(tmp_path, "status", run_id, "--json")
        hosts = json.loads(status.stdout)["hosts"] if status.stdout.strip().startswith("{") else {}
        if hosts and all(h.get("state") == "running" and "sleeping" in (h.get("last_line") or "") for h in hosts.values()):
            return
        time.sleep(1)
    raise AssertionError(f"run {run_id} never ran on every host: {status.stdout[-2000:]}")


def test_a_second_train_on_busy_hosts_is_refused_naming_the_holder_and_stop_ends_exactly_the_first_run(healthy_cluster, tmp_path, lab_scripts):
    inv = inventory(healthy_cluster, tmp_path)
    hosts = healthy_cluster.hosts[:2]
    h1 = hosts[0]
    first = mnft(tmp_path, "train", "--hosts", inv, "--src", str(lab_scripts), "--detach", "--", "long.py")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    run_id = first.stdout.strip().splitlines()[-1]
    wait_running(tmp_path, run_id)
    # a file only h1's workdir has, which an older mnft's sync (rsync --delete) would have removed
    marker = h1.home / "mnft" / "not-in-the-source.txt"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("left by the first run's user\n")
    (lab_scripts / "long.py").write_text((lab_scripts / "long.py").read_text() + "# changed after the first run started\n")

    second = mnft(tmp_path, "train", "--hosts", inv, "--src", str(lab_scripts), "--", "long.py")
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    line = [ln for ln in second.stderr.splitlines() if "0 of 1 free" in ln]  # its devices are the first run's
    assert line and line[0].startswith("mnft: h1: every device of the host (no --gpus) asked, 0 of 1 free: the host's CPUs: "
                                       f"train run {run_id} by root@"), second.stderr
    assert "Traceback" not in second.stderr
    assert latest_record(tmp_path)["state"] == "refused"
    job = json.loads((tmp_path / "runs" / run_id / "run.json").read_text())["job_id"]
    running = h1.home / "mnft" / "outputs" / job / "long.py"  # the first run's own code, in its job's directory
    assert "changed after" not in running.read_text()
    # a sync of the workdir goes on beside the run: it neither waits for it nor touches its code, nor the user's file
    synced = mnft(tmp_path, "sync", "--hosts", inv, "--src", str(lab_scripts))
    assert synced.returncode == 0, synced.stdout + synced.stderr
    assert marker.is_file() and "changed after" in (h1.home / "mnft" / "long.py").read_text()
    assert "changed after" not in running.read_text()

    status = mnft(tmp_path, "status", run_id)
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"h1: its CPUs held by train run {run_id} by root@" in status.stdout
    assert {h["state"] for h in json.loads(mnft(tmp_path, "status", run_id, "--json").stdout)["hosts"].values()} == {"running"}

    # another run's process on h1 (its own tag): stop ends exactly this run
    other = healthy_cluster.popen(h1, ["sleep", "300"], env={"MNFT_RUN_TAG": "OTHER@h1", "MNFT_RUN_ID": "OTHER"}, start_new_session=True)
    try:
        stopped = mnft(tmp_path, "stop", run_id, "--json")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert all(h["remaining"] == [] for h in json.loads(stopped.stdout)["hosts"].values())
        assert other.poll() is None
        assert not any(run_id in cmd for cmds in run_processes(healthy_cluster, hosts).values() for cmd in cmds)
    finally:
        other.kill()
        other.wait()
    wait_no_orphans(healthy_cluster, hosts, timeout=10)
    again = mnft(tmp_path, "sync", "--hosts", inv, "--src", str(lab_scripts))  # after the run, as during it
    assert again.returncode == 0, again.stdout + again.stderr
    assert marker.read_text() == "left by the first run's user\n"  # never mnft's to remove


# ------------------------------------------------------------------------------------------------ class 9


def controller_processes(*needles: str) -> list[str]:
    """Command lines of this machine's processes holding every needle."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd and all(n in cmd for n in needles) and alive(int(pid)):
                found.append(cmd)
    return found


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_a_slow_sync_leaves_no_rsync_or_ssh_on_the_controller_or_the_hosts(healthy_cluster, tmp_path, sig, code):
    h1 = healthy_cluster.hosts[0]
    src = tmp_path / "data"
    src.mkdir()
    with open(src / "big.bin", "wb") as fh:
        fh.write(os.urandom(64 << 20))  # 64 MiB at 4 Mbit/s: over 2 minutes, longer than the test waits
    inv = inventory(healthy_cluster, tmp_path, 1)
    subprocess.run(["tc", "qdisc", "add", "dev", h1.veth, "root", "tbf", "rate", "4mbit", "burst", "32kbit", "latency", "400ms"], check=True)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "invoke", "-r", str(REPO), "sync", "--hosts", inv, "--src", str(src), "--json"],
                                cwd=REPO, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (controller_processes("rsync", str(src)) and run_processes(healthy_cluster, [h1], ("rsync",))):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert controller_processes("ssh", "BatchMode=yes", h1.address), "the sync's rsync never connected"
        time.sleep(1)  # mid-transfer
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err
        assert "mnft: interrupted" in err and "Traceback" not in err
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (controller_processes("rsync", str(src)) or controller_processes("ssh", "BatchMode=yes", h1.address)
                                               or run_processes(healthy_cluster, [h1], ("rsync", "mnft_boot"))):
            time.sleep(0.2)
        assert controller_processes("rsync", str(src)) == []
        assert controller_processes("ssh", "BatchMode=yes", h1.address) == []
        assert run_processes(healthy_cluster, [h1], ("rsync", "mnft_boot")) == {}
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", h1.veth, "root"], check=False)
