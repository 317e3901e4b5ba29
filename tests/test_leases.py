"""One operation per host at a time (issue 19, class 6): the host leases, with `connection: local` hosts (a local
shell per host, the host side shipped through pyrun as to any host) and MNFT_HOME in a temporary directory.

A lease is held while a process holds a flock on the host's lease file: the controller's `hold` process (as long
as its channel lives), or a run's keeper. A second operation is refused naming the holder; a lease whose holder
is gone is taken over, said once; nested takes in one controller are no-ops."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mnft.hosts import leasehost, leases, pyrun
from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import parse


@pytest.fixture
def home(tmp_path, monkeypatch):
    state = tmp_path / "mnft-home"
    monkeypatch.setenv("MNFT_HOME", str(state))
    return state


def fleet_of(*names: str) -> Fleet:
    return Fleet(parse("hosts:\n" + "".join(f"  {n}: {{connection: local, python: {json.dumps(sys.executable)}}}\n" for n in names)))


def holder_on_disk(home: Path) -> dict:
    return json.loads((home / "lease.json").read_text())


def hold_process(home: Path, holder: dict) -> subprocess.Popen:
    """Another controller's hold process on this host (its stdin is its channel)."""
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ, MNFT_HOME=str(home)))
    proc.stdin.write(pyrun.payload(leasehost.source()) + json.dumps(holder).encode() + b"\n")
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    assert reply.get("taken"), reply
    return proc


OTHER = {"op": "other-op", "command": "sync", "run_id": None, "user": "ana", "controller": "ctl2", "pid": 4242, "started": time.time()}


def test_a_free_host_is_leased_for_the_block_and_the_lease_names_its_holder(home):
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync") as held:
        on_disk = holder_on_disk(home)
        assert on_disk["command"] == "sync" and on_disk["pid"] == os.getpid() and on_disk["op"] == held.op
        assert leases.show(fleet, fleet.inventory.hosts)["h1"]["held"] is True
    assert holder_on_disk(home)["released"]  # let go at the end of the block
    with fleet_of("h1") as fleet:
        assert leases.show(fleet, fleet.inventory.hosts)["h1"]["held"] is False


def test_a_second_operation_on_a_busy_host_is_refused_naming_the_host_and_the_holder(home):
    other = hold_process(home, dict(OTHER, command="train", run_id="20260101-1200-ab12"))
    try:
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy) as refused:
            with leases.hold(fleet, fleet.inventory.hosts, "provision"):
                pytest.fail("the block ran on a busy host")
        line = str(refused.value)
        assert line.startswith("h1 is busy: train run 20260101-1200-ab12 by ana@ctl2 pid 4242 since ")
        assert "(mnft stop 20260101-1200-ab12, or wait)" in line and "\n" not in line
        assert refused.value.exit_code == 1
        assert holder_on_disk(home)["op"] == "other-op"  # untouched
    finally:
        other.stdin.close()
        other.wait(timeout=10)


def test_a_refusal_lets_go_of_the_hosts_taken_before_it(home, tmp_path, monkeypatch):
    other_home = tmp_path / "other-home"
    other = hold_process(other_home, OTHER)  # h2 is busy, h1 free
    python2 = tmp_path / "python-h2"  # h2: another machine, as far as its lease is concerned
    python2.write_text(f"#!/bin/sh\nMNFT_HOME={other_home} exec {sys.executable} \"$@\"\n")
    python2.chmod(0o755)
    monkeypatch.setattr(leases, "host_key", lambda host: host.name)
    inv = parse(f"hosts:\n  h1: {{connection: local, python: {json.dumps(sys.executable)}}}\n  h2: {{connection: local, python: {python2}}}\n")
    try:
        with Fleet(inv) as fleet:
            taking = leases.Leases("setup")
            with pytest.raises(leases.HostBusy, match=r"^h2 is busy: sync by ana@ctl2 pid 4242 since .*\(wait for it to end\); nothing was changed"):
                taking.take(fleet, inv.hosts)
            assert taking.processes == {} and "h1" not in leases._held
            assert holder_on_disk(home)["released"]  # h1's, taken and let go
            with leases.hold(fleet, inv.hosts[:1], "sync"):
                pass
    finally:
        other.stdin.close()
        other.wait(timeout=10)


def test_a_lease_whose_holder_is_gone_is_taken_over_and_that_is_said_once(home):
    other = hold_process(home, OTHER)
    other.kill()  # its controller vanished: the channel closed, the hold process is gone, nothing was released
    other.wait()
    assert "released" not in holder_on_disk(home)
    said = []
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "setup", on_took_over=lambda h, prev: said.append((h, prev["op"]))):
        assert holder_on_disk(home)["command"] == "setup"
    assert said == [("h1", "other-op")]


def test_a_lease_released_by_its_holder_is_taken_without_a_word(home):
    other = hold_process(home, OTHER)
    other.stdin.close()
    other.wait(timeout=10)
    said = []
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync", on_took_over=lambda h, prev: said.append(h)):
        pass
    assert said == []


def test_a_run_whose_processes_live_on_holds_its_lease_after_its_holders_are_gone(home):
    other = hold_process(home, dict(OTHER, command="train", run_id="R7"))
    other.kill()
    other.wait()
    # a worker of attempt 2 of the run, orphaned (its keeper killed): the run is not over on this host
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=dict(os.environ, MNFT_RUN_ID="R7-a2"))
    try:
        deadline = time.monotonic() + 30
        while not leasehost.run_processes("R7") and time.monotonic() < deadline:  # until its exec is done
            time.sleep(0.05)
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy, match=r"^h1 is busy: train run R7 by ana@ctl2"):
            leases.Leases("sync").take(fleet, fleet.inventory.hosts)
    finally:
        worker.kill()
        worker.wait()
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync"):
        pass


def test_a_keeper_sharing_the_lock_keeps_the_host_busy_after_the_controller_let_go(home):
    # the agent gives a run's keeper the lease (mnft.run.agent.lease_fd): a detached run holds its host
    from mnft.run import agent

    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "train", run_id="R8"):
        assert agent.lease_path() == leasehost.lease_path() == str(home / "lease.json")
        fd = agent.lease_fd("R8-a2")
        assert fd is not None and agent.lease_fd("R9") is None
    try:
        assert "released" not in holder_on_disk(home)  # somebody else still holds it
        with fleet_of("h1") as fleet, pytest.raises(leases.HostBusy, match=r"^h1 is busy: train run R8 "):
            leases.Leases("sync").take(fleet, fleet.inventory.hosts)
    finally:
        os.close(fd)
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync"):
        pass


def test_takes_nested_in_one_controller_are_no_ops_and_two_names_for_one_login_share_one_lease(home):
    with fleet_of("a", "b") as fleet, leases.hold(fleet, fleet.inventory.hosts, "train", run_id="R1") as outer:
        assert list(outer.processes) == ["a"]  # b is the same login on the same machine
        with leases.hold(fleet, fleet.inventory.hosts, "sync") as inner:  # train's own sync
            assert inner.processes == {}
        assert leases.show(fleet, fleet.inventory.hosts[:1])["a"]["held"] is True
    assert holder_on_disk(home)["released"]


def test_a_hold_without_heartbeat_lets_go_after_its_deadman(home):
    proc = hold_process(home, dict(OTHER, deadman=0.5))
    assert proc.wait(timeout=30) == 0  # its stdin is still open: the controller is silent, not gone
    assert holder_on_disk(home)["released"]


def test_the_lease_file_is_the_users_alone_and_never_followed_through_a_link(home, tmp_path):
    home.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_text("{}")
    (home / "lease.json").symlink_to(target)
    with fleet_of("h1") as fleet:
        taken = leases.Leases("sync")
        taken.take(fleet, fleet.inventory.hosts)  # the host's script refuses it: no lease there, the operation goes on
        assert taken.processes == {}
    assert target.read_text() == "{}"
    (home / "lease.json").unlink()
    shutil.rmtree(home)
    with fleet_of("h1") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync"):
        assert oct((home / "lease.json").stat().st_mode & 0o777) == "0o600" and oct(home.stat().st_mode & 0o777) == "0o700"


def test_what_a_busy_line_says():
    started = time.mktime((2026, 1, 2, 10, 2, 0, 0, 0, -1))
    holder = {"command": "train", "run_id": "R", "user": "u", "controller": "ctl", "pid": 123, "started": started}
    assert leases.busy_line("h1", holder) == "h1 is busy: train run R by u@ctl pid 123 since 2026-01-02 10:02 (mnft stop R, or wait)"
    now = dict(holder, command="provision", run_id=None, started=time.time())
    assert leases.busy_line("h2", now) == f"h2 is busy: provision by u@ctl pid 123 since {time.strftime('%H:%M')} (wait for it to end)"


def test_flock_semantics_the_lease_relies_on(tmp_path):
    """A shared flock taken on one open file refuses another's exclusive one, not another shared one."""
    path = tmp_path / "f"
    path.write_text("")
    a, b = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    fcntl.flock(a, fcntl.LOCK_SH)
    with pytest.raises(BlockingIOError):
        fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(b, fcntl.LOCK_SH | fcntl.LOCK_NB)
    os.close(a), os.close(b)
