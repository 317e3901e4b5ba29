"""Issue 19, class 6, on a real simulated cluster: two login users of one host are kept apart by its lease.

Root (with torch, as the lab's admin would run a job) and bob (a plain login user of the host, whose Python has no
torch: what he takes there is the lease, through mnft's own controller code over SSH, and `sync`) share h1. While
one of them holds h1, the other's train or sync is refused naming him, and nothing changes on the host for the one
refused; once the holder is done, the other gets the host. A file planted at the lease path by a user is refused
and nothing is written through it. One private host: users are added to its copies of /etc/passwd."""

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
LEASE = "/tmp/mnft-lease.json"  # the host has no /run/lock: the lease directory is /tmp


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


def busy_line(done: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in done.stderr.splitlines() if "is busy" in ln]
    assert done.returncode == 1 and lines and "Traceback" not in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    return lines[0]


def test_two_login_users_of_a_host_are_kept_apart_by_its_lease(lab, tmp_path, lab_scripts):
    from mnft.hosts import leases
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import load

    root_inv, bob_inv = inventories(lab, tmp_path)
    root_workdir, bob_workdir = on_h1(lab, "/root/mnft"), on_h1(lab, f"{BOB_HOME}/mnft")

    # bob holds h1 (his controller's hold process, as bob on the host): root's train is refused naming bob
    with Fleet(load(bob_inv)) as fleet:
        bobs = leases.Leases("train", run_id="20260101-0900-b0b0")
        bobs.take(fleet, fleet.inventory.hosts)
        try:
            assert list(bobs.processes) == ["h1"]
            refused = mnft(tmp_path, "train", "--hosts", root_inv, "--src", str(lab_scripts), "--", "quick.py")
            line = busy_line(refused)
            assert line.startswith("mnft: h1 is busy: train run 20260101-0900-b0b0 by bob (")
            assert line.endswith("(wait, or ask bob; `mnft status 20260101-0900-b0b0` on " + json.loads(on_h1(lab, LEASE).read_text())["controller"]
                                 + " shows it); nothing was changed on any host")
            assert latest_record(tmp_path)["state"] == "refused"
            assert not root_workdir.exists()  # nothing synced, nothing started
        finally:
            bobs.release()

    # bob let go: root's run gets h1, and its keeper holds it while it runs (detached: no controller holds it)
    started = mnft(tmp_path, "train", "--hosts", root_inv, "--src", str(lab_scripts), "--detach", "--", "long.py")
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    run_id = started.stdout.strip().splitlines()[-1]
    assert (root_workdir / "long.py").is_file()
    holder = json.loads(on_h1(lab, LEASE).read_text())
    assert holder["run_id"] == run_id and holder["login"] == "root"
    assert on_h1(lab, LEASE).stat().st_mode & 0o777 == 0o666  # made by root, usable by bob

    # bob cannot read root's processes' environments: the keeper's flock is what tells him the run is alive
    line = busy_line(mnft(tmp_path, "sync", "--hosts", bob_inv, "--src", str(lab_scripts)))
    assert line.startswith(f"mnft: h1 is busy: train run {run_id} by root@")
    assert f"(wait, or ask root; `mnft status {run_id}` on " in line
    assert not bob_workdir.exists()

    status = mnft(tmp_path, "status", run_id)
    assert f"h1: lease held by train run {run_id} by root@" in status.stdout, status.stdout + status.stderr

    stopped = mnft(tmp_path, "stop", run_id, "--grace", "2")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    synced = mnft(tmp_path, "sync", "--hosts", bob_inv, "--src", str(lab_scripts))  # the run ended: bob gets h1
    assert synced.returncode == 0, synced.stdout[-2000:] + synced.stderr[-2000:]
    assert (bob_workdir / "long.py").is_file() and (bob_workdir / "long.py").stat().st_uid != 0
    assert json.loads(on_h1(lab, LEASE).read_text())["login"] == "bob"


def test_a_link_planted_at_the_lease_path_by_a_user_is_refused_and_what_it_names_is_untouched(lab, tmp_path, lab_scripts):
    root_inv, _ = inventories(lab, tmp_path)
    (lab_scripts / "new-in-this-sync.txt").write_text("a file no sync has brought yet\n")
    precious = on_h1(lab, "/tmp/precious")  # a file of root's that bob knows the name of
    precious.write_text("root's, not a lease\n")
    lease = on_h1(lab, LEASE)
    if lease.exists():
        lease.unlink()
    bob = lab.run(lab.hosts[0], ["su", "bob", "-s", "/bin/sh", "-c", f"ln -s /tmp/precious {LEASE}"], check=False)
    assert bob.returncode == 0, bob.stderr
    try:
        refused = mnft(tmp_path, "sync", "--hosts", root_inv, "--src", str(lab_scripts))
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert (f"h1: no lease can be taken: {LEASE} is a symbolic link, never followed by mnft (owner bob): remove it (as bob or root) "
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
