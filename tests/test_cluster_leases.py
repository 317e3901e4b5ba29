"""Issue 19, class 6, and issue 29 on a real simulated cluster: two login users of one host are kept apart by its
leases, and one's sync never waits for the other's run.

Root (with torch, as the lab's admin would run a job) and bob (a plain login user of the host, whose Python has no
torch: what he takes there are leases, through mnft's own controller code over SSH, and `sync`) share h1, a host
without GPUs: its CPUs are one device. While one of them holds it, the other's train is refused naming him, and
nothing changes on the host for the one refused; bob's sync of his own workdir goes on beside root's run; once the
holder is done, the other gets the device. A file planted at a lease path by a user is refused and nothing is
written through it. One private host: users are added to its copies of /etc/passwd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runhelpers import latest_record

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parent.parent
BOB_HOME = "/tmp/home-bob"  # inside the host (its private /tmp), as Cluster.add_user makes it
DEVICE = "/tmp/mnft-dev-cpu.json"  # h1 has no /run/lock (the lease directory is /tmp) nor nvidia-smi (its CPUs are its one device)


@pytest.fixture(scope="module")
def lab(testbed, tmp_path_factory):
    """One host, h1, with the login user bob beside root."""
    work = tmp_path_factory.mktemp("lab")
    with testbed.Cluster.create(1, work, outsider=False) as cluster:
        # a password: without one the account is locked ("!" in /etc/shadow), and sshd refuses bob's key too
        assert cluster.add_user("bob", password="not used") == BOB_HOME
        yield cluster


def mnft(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def inventories(cluster, tmp_path: Path) -> tuple[str, str]:
    """Root's inventory of h1, and bob's (the system Python: root's lives under /root, which bob cannot read)."""
    root = cluster.write_inventory(tmp_path / "root.yaml")
    bob = cluster.write_inventory(tmp_path / "bob.yaml", user="bob", python="/usr/bin/python3", workdir=f"{BOB_HOME}/mnft")
    return str(root), str(bob)


def on_h1(cluster, path: str) -> Path:
    """A path inside h1 (under its /root or its /tmp) as this machine sees it."""
    h1 = cluster.hosts[0]
    return h1.home / path[len("/root/"):] if path.startswith("/root/") else h1.root / "tmp" / path[len("/tmp/"):]


def test_two_login_users_of_a_host_are_kept_apart_by_its_device_lease_and_a_sync_does_not_wait_for_the_other(lab, tmp_path, lab_scripts):
    from mnft.hosts import leases
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import load

    root_inv, bob_inv = inventories(lab, tmp_path)
    root_workdir, bob_workdir = on_h1(lab, "/root/mnft"), on_h1(lab, f"{BOB_HOME}/mnft")

    # bob's run holds h1's device (his controller's hold process, as bob on the host): root's train is refused naming bob
    with Fleet(load(bob_inv)) as fleet:
        bobs = leases.Leases("train", run_id="20260101-0900-b0b0", scope=leases.Scope())
        bobs.take(fleet, fleet.inventory.hosts)
        try:
            assert list(bobs.processes) == ["h1"] and bobs.devices == {"h1": [{"index": None, "uuid": None, "name": "cpu"}]}
            refused = mnft(tmp_path, "train", "--hosts", root_inv, "--src", str(lab_scripts), "--", "quick.py")
            line = [ln for ln in refused.stderr.splitlines() if "asked, 0 of 1 free" in ln]
            assert refused.returncode == 1 and line and "Traceback" not in refused.stderr, refused.stdout[-2000:] + refused.stderr[-2000:]
            controller = json.loads(on_h1(lab, DEVICE).read_text())["controller"]
            assert line[0].startswith("mnft: h1: every device of the host (no --gpus) asked, 0 of 1 free: the host's CPUs: "
                                      f"train run 20260101-0900-b0b0 by bob (root@{controller}) pid ")
            assert line[0].endswith("(--wait to wait in line; `mnft lab` shows the lab); nothing was changed on any host")
            assert latest_record(tmp_path)["state"] == "refused"
            assert not root_workdir.exists()  # nothing synced, nothing started
        finally:
            bobs.release()

    # bob let go: root's run gets h1, and its keeper holds the device while it runs (detached: no controller holds it)
    started = mnft(tmp_path, "train", "--hosts", root_inv, "--src", str(lab_scripts), "--detach", "--", "long.py")
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    run_id = started.stdout.strip().splitlines()[-1]
    assert (root_workdir / "outputs" / latest_record(tmp_path)["job_id"] / "long.py").is_file()  # its job's directory
    holder = json.loads(on_h1(lab, DEVICE).read_text())
    assert holder["run_id"] == run_id and holder["login"] == "root"
    assert on_h1(lab, DEVICE).stat().st_mode & 0o777 == 0o666  # made by root, usable by bob

    # bob's sync of his own workdir does not wait for root's run
    synced = mnft(tmp_path, "sync", "--hosts", bob_inv, "--src", str(lab_scripts))
    assert synced.returncode == 0, synced.stdout[-2000:] + synced.stderr[-2000:]
    assert (bob_workdir / "long.py").is_file() and (bob_workdir / "long.py").stat().st_uid != 0

    # bob cannot read root's processes' environments: the keeper's flock is what tells him the run holds the device
    with Fleet(load(bob_inv)) as fleet:
        with pytest.raises(leases.HostBusy, match=rf"^h1: every device of the host \(no --gpus\) asked, 0 of 1 free: the host's CPUs: train run {run_id} by root@"):
            leases.Leases("train", run_id="20260101-0901-b0b1", scope=leases.Scope()).take(fleet, fleet.inventory.hosts)
        lab_view = leases.lab(fleet, fleet.inventory.hosts)["h1"]["devices"][0]
        assert lab_view["state"] == "held" and [w.split(" pid ")[0] for w in lab_view["lockers"]] == ["root"]  # the kernel's word

    status = mnft(tmp_path, "status", run_id)
    assert f"h1: its CPUs held by train run {run_id} by root@" in status.stdout, status.stdout + status.stderr

    stopped = mnft(tmp_path, "stop", run_id, "--grace", "2")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    with Fleet(load(bob_inv)) as fleet:  # the run ended: bob gets h1's device
        with leases.hold(fleet, fleet.inventory.hosts, "train", "20260101-0902-b0b2", scope=leases.Scope()) as held:
            assert held.devices == {"h1": [{"index": None, "uuid": None, "name": "cpu"}]}
            assert json.loads(on_h1(lab, DEVICE).read_text())["login"] == "bob"


def test_a_link_planted_at_a_lease_path_by_a_user_is_refused_and_what_it_names_is_untouched(lab, tmp_path, lab_scripts):
    from mnft.onhost.leases import work_name

    root_inv, _ = inventories(lab, tmp_path)
    workdir_lease = "/tmp/" + work_name("/root/mnft")  # what a sync of /root/mnft takes
    (lab_scripts / "new-in-this-sync.txt").write_text("a file no sync has brought yet\n")
    precious = on_h1(lab, "/tmp/precious")  # a file of root's that bob knows the name of
    precious.write_text("root's, not a lease\n")
    lease = on_h1(lab, workdir_lease)
    if lease.exists():
        lease.unlink()
    bob = lab.run(lab.hosts[0], ["su", "bob", "-s", "/bin/sh", "-c", f"ln -s /tmp/precious {workdir_lease}"], check=False)
    assert bob.returncode == 0, bob.stderr
    try:
        refused = mnft(tmp_path, "sync", "--hosts", root_inv, "--src", str(lab_scripts))
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert (f"h1: no lease can be taken: {workdir_lease} is a symbolic link, never followed by mnft (owner bob): remove it (as bob or root) "
                "when no mnft runs on this host; nothing was changed on any host") in refused.stderr
        assert precious.read_text() == "root's, not a lease\n"
        assert not on_h1(lab, "/root/mnft/new-in-this-sync.txt").exists()
    finally:
        lease.unlink()
        precious.unlink()
    done = mnft(tmp_path, "sync", "--hosts", root_inv, "--src", str(lab_scripts))  # removed: the next operation makes its own
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert on_h1(lab, "/root/mnft/new-in-this-sync.txt").is_file()
    assert not lease.is_symlink() and lease.stat().st_nlink == 1
