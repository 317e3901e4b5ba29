"""Collisions (issue 38): a process that computes on a GPU another run or session holds (it ignored
CUDA_VISIBLE_DEVICES). The judgment of whose a process is (`foreign`: its run tag where its environment is readable,
else its descent from the lease's lockers), as the host's `mnft lab` view (mnft.onhost.leasehost) and the run's
keeper (mnft.onhost.watches) both make it with mnft.onhost.procs; what `mnft lab` says of it; what the
keeper says in the run's output, once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mnft.hosts import lab

from mnft.onhost import runs
from mnft.hosts.inventory import parse
from mnft.onhost import procs, rungpus, watches


def facts(pid=4242, readable=False, run=None, ancestors=()):
    return {"pid": pid, "readable": readable, "run": run, "ancestors": list(ancestors)}


JUDGED = [  # (facts, run id, keepers, in an image) -> foreign
    (facts(readable=True, run="R1"), "R1", [99], False, False),  # the run's tag
    (facts(readable=True, run="R1-a2"), "R1", [99], False, False),  # an attempt of it
    (facts(readable=True, run="R1-ab"), "R1", [99], False, True),  # not an attempt: another run's
    (facts(readable=True, run="R10"), "R1", [99], False, True),
    (facts(readable=True, run=""), "R1", [99], False, True),  # the user's own notebook, no tag
    (facts(readable=True, run="", ancestors=[99]), "R1", [99], False, True),  # readable: the tag decides, not descent
    (facts(ancestors=[300, 200, 99]), "R1", [99], False, False),  # not readable: below the keeper
    (facts(ancestors=[300, 200]), "R1", [99], False, True),  # not readable, not below: another's
    (facts(ancestors=[300, 200]), "R1", [99], True, None),  # beside a run in an image: cannot be told
    (facts(pid=99), "R1", [99], False, False),  # the keeper itself
    (facts(readable=True, run="", ancestors=[99]), None, [99], False, False),  # no run id in the lease: descent
]


@pytest.mark.parametrize("case", JUDGED)
def test_a_process_is_the_runs_by_its_tag_where_readable_else_by_descent_from_the_keeper_the_same_on_both_sides(case):
    fact, run_id, keepers, in_image, expected = case
    assert procs.foreign(fact, run_id, keepers, in_image) is expected


def test_the_facts_of_a_process_are_its_run_tag_where_readable_and_its_ancestors():
    env = dict(os.environ, MNFT_RUN_ID="R7-a1")
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"up\n"  # running its own program (its environment is its exec's, not its fork's)
        got = procs.process_facts(child.pid)
        assert got["readable"] and got["run"] == "R7-a1" and got["ancestors"][0] == os.getpid()
        assert procs.foreign(got, "R7", [os.getpid()]) is False and procs.foreign(got, "R8", [os.getpid()]) is True
    finally:
        child.communicate(b"")
    untagged = procs.process_facts(os.getpid())
    assert untagged["readable"] and untagged["run"] == (os.environ.get("MNFT_RUN_ID") or "")


def held(processes, image=None):
    return {"index": 3, "uuid": "GPU-3", "memory_total_mib": 81559, "memory_used_mib": 2000, "utilization": 90, "state": "held",
            "holder": {"run_id": "R1", "command": "train", "login": "alice", "taken": 1_800_000_000.0 - 60, "image": image},
            "lockers": ["alice pid 99", "alice pid 98"], "processes": processes}


def test_the_lab_view_names_the_processes_on_a_held_gpu_that_are_not_of_its_run():
    known = {10: facts(10, ancestors=[50, 99]), 11: facts(11, ancestors=[60, 98]), 4242: facts(4242, ancestors=[7]),
             77: facts(77, readable=True, run="R2")}
    procs = [{"pid": p, "user": u, "used_mib": 900} for p, u in ((10, "alice"), (11, "alice"), (4242, "bob"), (77, "carol"))]
    assert runs.collisions(held(procs), known.__getitem__) == [procs[2], procs[3]]
    assert runs.collisions(held(procs, image="img:1"), known.__getitem__) == [procs[3]]  # 4242 cannot be told there
    assert runs.locker_pids(["alice pid 99", "bob pid x", "pid 5"]) == [99]


def test_mnft_lab_says_who_else_uses_a_held_gpu_beside_its_holder_and_under_the_table():
    inventory = parse("hosts:\n  h1: {address: 10.0.0.1}\n")
    device = dict(held([]), collisions=[{"pid": 4242, "user": "bob", "used_mib": 900}])
    row = lab.rows(inventory, {"h1": {"devices": [device], "now": 1_800_000_000.0}})[0]
    assert (row.state, row.user, row.run, row.also, row.detail) == ("held", "alice", "R1", "also used by bob pid 4242", "also used by bob pid 4242")
    assert lab.collision_line(row) == "h1 GPU 3: held by alice's run R1; also used by bob pid 4242"
    session = dict(device, holder=dict(device["holder"], command="shell", session="jupyter lab"))
    assert lab.collision_line(lab.rows(inventory, {"h1": {"devices": [session]}})[0]) == \
        "h1 GPU 3: held by alice's session R1; also used by bob pid 4242"
    many = dict(device, collisions=[{"pid": p, "user": "bob"} for p in range(1, 7)])
    assert lab.rows(inventory, {"h1": {"devices": [many]}})[0].also == "also used by bob pid 1, bob pid 2, bob pid 3, bob pid 4 and 2 more"
    assert lab.rows(inventory, {"h1": {"devices": [held([])]}})[0].also is None
    assert lab.rows(inventory, {"h1": {"devices": [device]}})[0].to_json()["also"] == "also used by bob pid 4242"


def test_the_keeper_says_once_in_the_runs_output_each_process_of_another_on_its_gpus():
    said = []
    on_gpus = [(0, 10), (1, 4242), (2, 5151), (1, 77)]
    known = {10: facts(10, ancestors=[99]), 4242: facts(4242, ancestors=[7]), 5151: facts(5151), 77: facts(77, readable=True, run="R1-a1")}
    clock = [100.0]
    watch = watches.CollisionWatch({"run_id": "R1", "devices": [0, 1]}, said.append, keeper=99, processes=lambda: on_gpus,
                                 facts=known.__getitem__, user_of={4242: "bob"}.get, clock=lambda: clock[0])
    assert watch.check() == said == [
        "GPU 1 of this run is also used by bob pid 4242, a process not of this run (it ignored CUDA_VISIBLE_DEVICES): "
        "both compete for its memory and time; `mnft lab` names it"]
    clock[0] += watches.COLLISION_EVERY
    assert watch.check() == [] and len(said) == 1  # said once
    on_gpus.append((0, 6000))
    known[6000] = facts(6000)
    assert watch.check() == []  # not due yet
    clock[0] += watches.COLLISION_EVERY
    assert [line.split(",")[0] for line in watch.check()] == ["GPU 0 of this run is also used by ? pid 6000"]
    session = watches.CollisionWatch({"run_id": "S1", "devices": [1], "kind": "session"}, said.append, keeper=99,
                                   processes=lambda: [(1, 4242)], facts=known.__getitem__, user_of={4242: "bob"}.get)
    assert session.check()[0].startswith("GPU 1 of this session is also used by bob pid 4242, a process not of this session")


def test_the_keeper_reads_which_gpu_each_compute_process_is_on_by_its_bus_id():
    buses = rungpus.parse_gpu_buses("0, 00000000:18:00.0\n1, 00000000:2A:00.0\n")
    assert buses == {"00000000:18:00.0": 0, "00000000:2A:00.0": 1}
    assert rungpus.parse_bus_apps("00000000:2a:00.0, 4242\nNo running processes found\n") == [("00000000:2A:00.0", 4242)]
    assert watches._collision_watch({"run_id": "R1"}, print) is None  # no GPUs of its own here: nothing to watch
