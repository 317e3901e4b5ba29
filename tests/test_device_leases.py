"""A lab shared by many people (issue 29): what a run takes on a host is its devices and its workdir, not the host.

With `connection: local` hosts and MNFT_LEASE_DIR in a temporary directory (conftest's `lease_dir`), each other
controller a hold process of its own (as tests/test_leases.py does). On this machine there is no nvidia-smi: a
host's CPUs are its one device, so two runs of one CPU host are kept apart, and a run waits its turn in the
host's line (first come, first served; a waiter that leaves takes its ticket with it). The whole host (setup,
provision) is not taken while a run holds a device or a sync a workdir, and a sync of one directory never waits
for a run in another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mnft.hosts import leases, pyrun

from mnft.onhost import line
from mnft.onhost import leases as hostleases
from mnft.hosts.fleet import Fleet
from mnft.hosts.inventory import parse


def fleet_of(workdir: Path) -> Fleet:
    return Fleet(parse(f"hosts:\n  h1: {{connection: local, workdir: {json.dumps(str(workdir))}, python: {json.dumps(sys.executable)}}}\n"))


def other(lease_dir: Path, run_id: str, workdir: Path, *, wait: bool = False, queued: float | None = None) -> subprocess.Popen:
    """Another controller's hold process for a run on this host alone (its stdin is its channel)."""
    holder = {"op": f"op-{run_id}", "command": "train", "run_id": run_id, "user": "ana", "controller": "ctl2", "pid": 4242, "started": time.time(),
              "scope": {"gpus": None, "workdir": str(workdir)}}
    if wait:
        holder.update(wait=True, queued=queued or time.time(), ticket=f"t{run_id}", want=None, hosts=1)
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ, MNFT_LEASE_DIR=str(lease_dir)), cwd="/")
    proc.stdin.write(pyrun.payload("leasehost") + json.dumps(holder).encode() + b"\n")
    proc.stdin.flush()
    return proc


def answer(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def let_go(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=10)


def test_a_run_takes_the_hosts_cpus_as_one_device_and_its_workdir_and_a_second_run_is_refused_naming_the_first(lease_dir, tmp_path):
    first = other(lease_dir, "R1", tmp_path / "a")
    try:
        assert answer(first)["devices"] == [{"index": None, "uuid": None, "name": "cpu"}]
        with fleet_of(tmp_path / "b") as fleet, pytest.raises(leases.HostBusy) as refused:
            leases.Leases("train", "R2", leases.Scope()).take(fleet, fleet.inventory.hosts)
        line = str(refused.value)
        assert line.startswith("h1: every device of the host (no --gpus) asked, 0 of 1 free: the host's CPUs: train run R1 by ")
        assert "(--wait to wait in line; `mnft lab` shows the lab); nothing was changed on any host" in line
    finally:
        let_go(first)


def test_the_same_workdir_is_one_runs_or_one_syncs_at_a_time_and_another_directory_is_not_held_up(lease_dir, tmp_path):
    first = other(lease_dir, "R1", tmp_path / "a")
    try:
        answer(first)
        with fleet_of(tmp_path / "a") as fleet, pytest.raises(leases.HostBusy, match=rf"^h1: workdir {tmp_path / 'a'} is busy: train run R1 by "):
            leases.Leases("sync", scope=leases.sync_scope("code")).take(fleet, fleet.inventory.hosts)
        with fleet_of(tmp_path / "b") as fleet, leases.hold(fleet, fleet.inventory.hosts, "sync", scope=leases.sync_scope("code")) as held:
            assert held.devices == {"h1": []} and held.paths["h1"] == [str(lease_dir / hostleases.work_name(str(tmp_path / "b")))]
    finally:
        let_go(first)


def test_setup_and_provision_wait_for_no_run_they_are_refused_while_one_holds_a_device(lease_dir, tmp_path):
    first = other(lease_dir, "R1", tmp_path / "a")
    try:
        answer(first)
        with fleet_of(tmp_path / "b") as fleet, pytest.raises(leases.HostBusy) as refused:
            with leases.hold(fleet, fleet.inventory.hosts, "provision"):
                pytest.fail("provision ran under a run")
        line = str(refused.value)
        assert line.startswith(f"h1 is busy: the host's CPUs, workdir {tmp_path / 'a'}: train run R1 by ")
        assert ": the whole host is not changed under a run (wait for it to end, or ask its user); nothing was changed" in line
    finally:
        let_go(first)
    with fleet_of(tmp_path / "b") as fleet, leases.hold(fleet, fleet.inventory.hosts, "provision"):  # the run ended: it goes on
        with pytest.raises(leases.HostBusy, match=r"^h1 is busy: provision by .* since .*\(wait for it to end\)"):
            other_run = leases.Leases("train", "R3", leases.Scope())
            leases._held.clear()  # as another controller would
            other_run.take(fleet, fleet.inventory.hosts)


def test_waiting_runs_start_in_the_order_they_came_and_each_is_told_its_place(lease_dir, tmp_path):
    holder = other(lease_dir, "R1", tmp_path / "a")
    answer(holder)
    said: list[dict] = []
    taken, done = threading.Event(), threading.Event()
    second = leases.Leases("train", "R2", leases.Scope(wait=60), on_wait=lambda host, reply: said.append(reply))

    def wait_in_line():
        with fleet_of(tmp_path / "b") as fleet:  # its connection lives as long as the run
            second.take(fleet, fleet.inventory.hosts)
            taken.set()
            done.wait(30)

    waiter = threading.Thread(target=wait_in_line)
    waiter.start()
    try:
        deadline = time.monotonic() + 20
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        assert said[0]["position"] == 1 and said[0]["devices"][0]["holder"]["run_id"] == "R1"
        third = other(lease_dir, "R3", tmp_path / "c", wait=True)  # came later: behind R2
        try:
            place = answer(third)
            assert place["waiting"] and place["position"] == 2 and [a["run_id"] for a in place["ahead"]] == ["R2"]
            assert [t[1]["run_id"] for t in leasehost_tickets(lease_dir)] == ["R2", "R3"]
            let_go(holder)  # R1 ends: R2 (first in line) gets the host, not R3
            assert taken.wait(20)
            assert second.devices == {"h1": [{"index": None, "uuid": None, "name": "cpu"}]}
            place = answer(third)
            assert place.get("waiting") and place["position"] == 1 and place["devices"][0]["holder"]["run_id"] == "R2", place
            second.release()  # R2 ends: R3 starts
            assert answer(third)["taken"]
        finally:
            let_go(third)
    finally:
        second.release()
        done.set()
        waiter.join(timeout=20)


def leasehost_tickets(lease_dir: Path) -> list:
    os.environ["MNFT_LEASE_DIR"] = str(lease_dir)  # conftest's monkeypatch restores it
    return line.tickets()


def test_a_waiter_that_leaves_the_line_takes_its_ticket_with_it_and_a_wait_that_runs_out_is_refused(lease_dir, tmp_path):
    holder = other(lease_dir, "R1", tmp_path / "a")
    answer(holder)
    try:
        waiter = other(lease_dir, "R2", tmp_path / "b", wait=True)
        assert answer(waiter)["position"] == 1
        assert len(leasehost_tickets(lease_dir)) == 1
        let_go(waiter)  # Ctrl-C: the controller's channel closes
        assert leasehost_tickets(lease_dir) == [] and not list(lease_dir.glob("mnft-wait-*"))
        started = time.monotonic()
        with fleet_of(tmp_path / "b") as fleet, pytest.raises(leases.HostBusy, match=r"^still waiting after 1.5s: h1: every device"):
            leases.Leases("train", "R3", leases.Scope(wait=1.5)).take(fleet, fleet.inventory.hosts)
        assert time.monotonic() - started < 15
        assert leasehost_tickets(lease_dir) == []
    finally:
        let_go(holder)


def test_a_run_that_does_not_wait_is_refused_while_others_wait_in_line_first_come_first_served(lease_dir, tmp_path):
    holder = other(lease_dir, "R1", tmp_path / "a")
    answer(holder)
    waiter = other(lease_dir, "R2", tmp_path / "b", wait=True)
    answer(waiter)
    let_go(holder)  # free now, but R2 is first in line: it takes it within a second
    try:
        assert answer(waiter)["taken"]
    finally:
        let_go(waiter)


def test_a_run_whose_keeper_was_killed_leaves_its_devices_to_be_taken_over_said_once(lease_dir, tmp_path):
    dead = other(lease_dir, "R1", tmp_path / "a")
    answer(dead)
    dead.kill()  # its holder is gone without letting go (SIGKILL): nobody holds the flock any more
    dead.wait()
    said = []
    with fleet_of(tmp_path / "a") as fleet, leases.hold(fleet, fleet.inventory.hosts, "train", "R2", scope=leases.Scope(),
                                                        on_took_over=lambda host, previous: said.append((host, previous["run_id"]))):
        pass
    assert said == [("h1", "R1")]


# ------------------------------------------------------------------------------------------------ provision of one's own environment


def test_a_provision_in_the_users_own_home_takes_only_its_environment_and_a_shared_one_the_whole_host():
    home = parse("hosts:\n  h1: {connection: local, venv: ~/mnft-env}\n  h2: {connection: local, venv: /opt/lab-env}\n  h3: {connection: local, venv: none}\n")
    h1, h2, h3 = home.hosts
    assert leases.provision_scope(h1) == leases.Scope(gpus=0, directory="venv", own=True)
    assert leases.provision_scope(h1).on(h1) == {"gpus": 0, "workdir": "~/mnft-env", "own": True}
    assert leases.provision_scope(h2) is None and leases.provision_scope(h3) is None  # the whole host
    assert leases.in_own_home("~") and not leases.in_own_home("~alice/env") and not leases.in_own_home("/home/me/env")


def test_a_provision_of_ones_own_environment_goes_on_beside_others_runs_and_waits_only_for_ones_own(lease_dir, tmp_path, monkeypatch):
    inventory = parse(f"hosts:\n  h1: {{connection: local, workdir: {json.dumps(str(tmp_path / 'w'))}, venv: ~/mnft-env, "
                      f"python: {json.dumps(sys.executable)}}}\n")
    mine = other(lease_dir, "R1", tmp_path / "a")  # a run of this login (the hold runs as this user) holds the host's CPUs
    try:
        answer(mine)
        with Fleet(inventory) as fleet, pytest.raises(leases.HostBusy) as refused:
            leases.Leases("provision", per_host=leases.provision_scope).take(fleet, fleet.inventory.hosts)
        assert str(refused.value).startswith("h1: your environment ~/mnft-env is not changed under your own run: the host's CPUs, "
                                             f"workdir {tmp_path / 'a'}: train run R1 by ")
        assert "(it runs from that environment: wait for it to end, or mnft stop it); nothing was changed on any host" in str(refused.value)
    finally:
        let_go(mine)
    # another login's run: the host's lease script sees its holder's uid, not this one's
    theirs = {"op": "op-R2", "command": "train", "run_id": "R2", "uid": os.getuid() + 1, "login": "bob"}
    monkeypatch.setattr(hostleases, "held_leases", lambda op=None: [("mnft-dev-cpu.json", theirs, ["bob pid 7"])])
    reply, fds = hostleases.take_devices({"op": "op-p", "command": "provision", "scope": {"gpus": 0, "workdir": "~/mnft-env", "own": True}}, [], {})
    try:
        assert reply["taken"] and reply["devices"] == [] and reply["paths"] == [str(lease_dir / hostleases.work_name("~/mnft-env"))]
    finally:
        for fd in fds:
            os.close(fd)
    theirs["uid"] = os.getuid()  # the same holder as this login's: refused
    assert hostleases.take_devices({"op": "op-p", "command": "provision", "scope": {"gpus": 0, "workdir": "~/mnft-env", "own": True}}, [], {})[0]["what"] == "own-runs"


def test_a_lease_of_nothing_has_no_hold_left_to_run_an_operations_scripts(lease_dir, tmp_path):
    """A session of --gpus 0 takes no device and no directory: the host's hold ends at once, so the operation's host
    scripts (its code's tree hash) are never asked of it (they would wait for an answer that never comes)."""
    with fleet_of(tmp_path / "w") as fleet:
        with leases.hold(fleet, fleet.inventory.hosts, "shell", "S1", scope=leases.Scope(gpus=0, directory=None)) as held:
            assert held.devices == {"h1": []} and held.processes == {}
            assert leases.run_held(fleet.inventory.hosts[0], "treehash", [str(tmp_path / "none"), "--if-exists"], "[]\n") is None
