"""A fair line on every host, with the lab admin's per-user limits (issue 43).

A host's line of waiting runs is ordered by (over_limit, held, queued, ticket): between runs that wait for this host
alone, the user holding the fewest GPUs here goes first, one user's runs first come first served; runs over
several hosts stay first come first served among themselves (the same order on every host: no two of them ever hold
a host the other waits for); a user at the lab's `max_gpus_while_others_wait` waits behind the others, and
`max_waiting` bounds how many runs one user has waiting in a host's line. The host's side is exercised on this
test's lease directory (conftest's `lease_dir`, MNFT_LEASE_DIR), other users' tickets and leases made as their
files (chowned: root runs these tests) with their flocks held by this process; the controller's words are pure."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

import pytest

from mnft.hosts import lab, leases
from mnft.hosts.fleet import Fleet, HostResult, Status
from mnft.hosts.inventory import parse
from mnft.onhost import labpolicy, line, watches
from mnft.onhost import leases as hostleases

ALICE, BOB, CAROL = 1001, 1002, 1003
NAMES = {ALICE: "alice", BOB: "bob", CAROL: "carol", os.getuid(): "me"}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="other users' files are made by chown (root)")


def holder(run_id: str, uid: int, queued: float, hosts: int | None = 1, want: int = 1) -> dict:
    """A waiting run's ticket as its controller writes it (`hosts`: how many hosts the run waits for)."""
    found = {"op": f"op-{run_id}", "command": "train", "run_id": run_id, "user": NAMES[uid], "login": NAMES[uid], "uid": uid,
             "controller": "ctl", "pid": 7, "started": queued, "wait": True, "queued": queued, "ticket": f"t{run_id}", "want": want}
    if hosts is not None:
        found["hosts"] = hosts
    return found


def gpus_held(**by_user: int) -> list[dict]:
    """A host's device states: each user's count of held GPUs, then the rest free."""
    states = []
    for name, count in by_user.items():
        uid = next(u for u, n in NAMES.items() if n == name)
        states += [{"index": len(states), "state": "held", "holder": {"uid": uid, "login": name, "run_id": f"{name}-running"}}
                   for _ in range(count)]
    return states + [{"index": len(states), "state": "free"}]


def run_ids(ranked: list) -> list[str]:
    return [h["run_id"] for _, h in ranked]


# ------------------------------------------------------------------------------------------------ the order (pure)


def test_between_runs_for_one_host_the_user_holding_the_fewest_gpus_here_goes_first():
    held = line.held_by_user(gpus_held(alice=3))
    assert held == {ALICE: 3}
    ranked = line.fair_line([holder("A1", ALICE, 10.0), holder("B1", BOB, 20.0)], held, None)
    assert run_ids(ranked) == ["B1", "A1"]  # bob came later but holds nothing here
    assert [key for key, _ in ranked] == [(0, 0, 20.0, "tB1"), (0, 3, 10.0, "tA1")]


def test_one_users_runs_are_first_come_first_served():
    held = line.held_by_user(gpus_held(alice=2))
    ranked = line.fair_line([holder("A2", ALICE, 30.0), holder("A1", ALICE, 10.0), holder("A3", ALICE, 30.0)], held, None)
    assert run_ids(ranked) == ["A1", "A2", "A3"]  # the queue time, then the ticket


def test_runs_over_several_hosts_stay_first_come_first_served_whatever_their_users_hold_on_each_host():
    a, b = holder("A", ALICE, 10.0, hosts=2), holder("B", BOB, 20.0, hosts=2)
    h1, h2 = line.held_by_user(gpus_held(alice=4)), line.held_by_user(gpus_held(bob=4))  # alice heavy on h1, bob on h2
    assert run_ids(line.fair_line([a, b], h1, None)) == run_ids(line.fair_line([b, a], h2, None)) == ["A", "B"]
    assert line.fair_key(a, h1, {ALICE, BOB}, None) == line.fair_key(a, h2, {ALICE, BOB}, None) == (0, 0, 10.0, "tA")
    older = holder("O", ALICE, 5.0, hosts=None)  # an older controller's ticket does not say: it may span several
    assert not line.single_host(older) and line.fair_key(older, h1, set(), None)[:2] == (0, 0)


def test_a_run_over_several_hosts_counts_none_held_against_runs_for_one_host():
    held = line.held_by_user(gpus_held(alice=4, bob=1))
    ranked = line.fair_line([holder("B", BOB, 10.0), holder("A", ALICE, 20.0, hosts=2)], held, None)
    assert run_ids(ranked) == ["A", "B"]


def test_a_user_at_the_labs_limit_waits_behind_the_others_and_later_runs_over_several_hosts_stay_behind_it():
    held = line.held_by_user(gpus_held(alice=2, bob=1))
    a, b, c = holder("A", ALICE, 10.0, hosts=2), holder("B", BOB, 20.0), holder("C", CAROL, 30.0, hosts=2)
    assert run_ids(line.fair_line([a, b, c], held, None)) == ["A", "C", "B"]  # no limit: several-host runs count none
    limited = line.fair_line([a, b, c], held, 2)
    assert run_ids(limited) == ["B", "A", "C"]  # alice holds 2 >= 2 while others wait: behind bob; carol's came after hers
    assert [key[:2] for key, _ in limited] == [(0, 1), (1, 0), (0, 0)]
    alone = line.fair_line([a, holder("A2", ALICE, 15.0)], held, 2)
    assert [key[0] for key, _ in alone] == [0, 0]  # nobody else waits: no one to wait behind


# ------------------------------------------------------------------------------------------------ the host's side


def ticket(lease_dir: Path, found: dict) -> int:
    """Another waiter's ticket: its user's file, its flock held (by this process, through its own descriptor)."""
    fd = os.open(lease_dir / line.ticket_name(found), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, json.dumps(found).encode())
    os.fchown(fd, found["uid"], found["uid"])
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def lease(lease_dir: Path, index: int, uid: int) -> int:
    """GPU `index` held by a run of `uid` (its lease file, a shared flock on it)."""
    fd = os.open(lease_dir / f"mnft-dev-gpu{index}.json", os.O_RDWR | os.O_CREAT, 0o666)
    os.write(fd, json.dumps({"op": f"op-{uid}-{index}", "command": "train", "run_id": f"{NAMES[uid]}-running", "uid": uid,
                             "login": NAMES[uid], "user": NAMES[uid], "controller": "ctl", "pid": 7, "started": time.time()}).encode())
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def policy(lease_dir: Path, text: str) -> Path:
    """The lab's rules as its admin writes them in the lease directory (root's, 0644)."""
    path = lease_dir / labpolicy.LAB_NAME
    path.write_text(text)
    path.chmod(0o644)
    return path


GPUS = [{"index": i, "uuid": f"GPU-{i}", "name": "H100", "processes": []} for i in range(5)]


def my_take(run_id: str, queued: float) -> tuple[dict, list]:
    """This login's run (one host) taking 1 GPU with its ticket, as a waiting run's hold does each second."""
    found = {k: v for k, v in holder(run_id, os.getuid(), queued).items() if k != "uid"}
    return hostleases.take(dict(found, scope={"gpus": 1, "workdir": None}), GPUS, {})


@pytest.fixture
def held_fds():
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


@root_only
def test_a_waiting_run_takes_a_free_gpu_before_an_earlier_run_of_a_user_holding_more_here(lease_dir, held_fds):
    held_fds += [lease(lease_dir, i, ALICE) for i in (0, 1, 2)] + [lease(lease_dir, 3, CAROL), ticket(lease_dir, holder("A", ALICE, 10.0))]
    reply, fds = my_take("M", 20.0)  # GPU 4 free; alice's run came first but she holds 3 here, I hold none
    held_fds += fds
    assert reply["taken"] and [d["index"] for d in reply["devices"]] == [4]


@root_only
def test_a_waiting_run_of_a_user_holding_more_here_is_refused_naming_the_run_ahead(lease_dir, held_fds):
    me = os.getuid()
    held_fds += [lease(lease_dir, i, me) for i in (0, 1, 2)] + [ticket(lease_dir, holder("A", ALICE, 30.0))]
    reply, fds = my_take("M", 20.0)  # I came first, but hold 3 here; alice holds none
    assert fds == [] and reply["busy"] and reply["what"] == "devices" and [h["run_id"] for h in reply["ahead"]] == ["A"]
    assert line.waiting_reply(reply)["position"] == 2


@root_only
def test_one_users_own_earlier_run_is_ahead_of_its_later_one(lease_dir, held_fds):
    held_fds.append(ticket(lease_dir, holder("M1", os.getuid(), 10.0)))
    reply, fds = my_take("M2", 20.0)
    assert fds == [] and [h["run_id"] for h in reply["ahead"]] == ["M1"]


@root_only
def test_the_labs_limit_puts_a_run_over_several_hosts_behind_another_users_run(lease_dir, held_fds):
    me = os.getuid()
    held_fds += [lease(lease_dir, 0, me), lease(lease_dir, 1, me), ticket(lease_dir, holder("B", BOB, 30.0))]
    several = dict({k: v for k, v in holder("M", me, 20.0, hosts=2).items() if k != "uid"}, scope={"gpus": 1, "workdir": None})
    reply, fds = hostleases.take(several, GPUS, {})  # several hosts: counts none held, and came first
    held_fds += fds
    assert reply["taken"]
    hostleases.release(fds[0], several)
    held_fds.remove(fds[0])
    policy(lease_dir, "max_gpus_while_others_wait: 2\n")
    reply, fds = hostleases.take(several, GPUS, {})  # I hold 2 here and bob waits: behind him
    assert fds == [] and [h["run_id"] for h in reply["ahead"]] == ["B"]


@root_only
def test_lab_shows_the_line_in_its_fair_order_with_what_ordered_it_and_the_labs_rules(lease_dir, held_fds, monkeypatch):
    monkeypatch.setattr(hostleases, "read_devices", lambda *a, **k: ([dict(g) for g in GPUS], {}))
    path = policy(lease_dir, "max_gpus_while_others_wait: 3\nmax_waiting: 2\n")
    held_fds += [lease(lease_dir, i, ALICE) for i in (0, 1, 2)]
    held_fds += [ticket(lease_dir, holder("A", ALICE, 10.0)), ticket(lease_dir, holder("B", BOB, 20.0))]
    view = hostleases.lab()
    assert view["policy"] == {"path": str(path), "max_gpus_while_others_wait": 3, "max_waiting": 2}
    assert [w["run_id"] for w in view["line"]] == ["B", "A"]
    assert [w["fair"] for w in view["line"]] == [{"over_limit": 0, "held": 0, "holds": 0}, {"over_limit": 1, "held": 3, "holds": 3}]
    assert [w["uid"] for w in view["line"]] == [BOB, ALICE]  # the ticket file's owner, whatever its text says


# ------------------------------------------------------------------------------------------------ max_waiting


@root_only
def test_a_user_at_max_waiting_is_refused_a_place_in_line_at_once(lease_dir, held_fds):
    path = policy(lease_dir, "max_waiting: 2\n")
    me = os.getuid()
    held_fds += [ticket(lease_dir, holder("M1", me, 10.0)), ticket(lease_dir, holder("M2", me, 11.0)), ticket(lease_dir, holder("B", BOB, 12.0))]
    fd, made, full = line.join_line(holder("M3", me, 20.0))
    assert fd is None and made is None
    assert full == {"busy": True, "what": "line-full", "waiting": 2, "max_waiting": 2, "path": str(path)}
    assert not (lease_dir / line.ticket_name(holder("M3", me, 20.0))).exists()
    policy(lease_dir, "max_waiting: 3\n")  # under the limit: its ticket is made
    fd, made, full = line.join_line(holder("M3", me, 20.0))
    held_fds.append(fd)
    assert full is None and Path(made).exists() and line.tickets()[-1][1]["run_id"] == "M3"


@root_only
def test_a_run_refused_for_max_waiting_is_told_in_one_line_and_does_not_wait(lease_dir, held_fds, tmp_path):
    path = policy(lease_dir, "max_waiting: 1\n")
    held_fds += [os.open(lease_dir / "mnft-dev-cpu.json", os.O_RDWR | os.O_CREAT, 0o666)]
    os.write(held_fds[-1], json.dumps({"op": "x", "command": "train", "run_id": "R0", "uid": BOB, "login": "bob"}).encode())
    fcntl.flock(held_fds[-1], fcntl.LOCK_SH)  # the host's one device (its CPUs) held: a run would wait
    held_fds.append(ticket(lease_dir, holder("M1", os.getuid(), 10.0)))
    inventory = parse(f"hosts:\n  h1: {{connection: local, workdir: {json.dumps(str(tmp_path))}, python: {json.dumps(sys.executable)}}}\n")
    started = time.monotonic()
    with Fleet(inventory) as fleet, pytest.raises(leases.HostBusy) as refused:
        leases.Leases("train", "M2", leases.Scope(wait=60)).take(fleet, inventory.hosts)
    assert time.monotonic() - started < 20  # refused outright, not after the wait
    assert str(refused.value) == (f"h1: you have 1 run(s) waiting in line here, and the lab allows each user at most 1 (max_waiting "
                                  f"in {path}): wait for one of your waiting runs to start, or stop one (`mnft lab` shows the line); "
                                  f"nothing was changed on any host")
    assert [h["run_id"] for _, h in line.tickets()] == ["M1"]


def test_the_controller_takes_a_line_full_reply_for_a_refusal_not_for_a_place_in_line():
    class Hold:  # the host's hold process: nothing more is read from it
        stdout_ended = False

        def json_reply(self, timeout):
            raise AssertionError("a refused run does not wait")

    full = {"busy": True, "what": "line-full", "waiting": 2, "max_waiting": 2, "path": "/etc/mnft/lab.yaml"}
    assert leases.Leases("train", "R", leases.Scope(wait=60))._wait("h1", Hold(), full) is full


def test_the_line_full_reply_is_one_line_naming_the_host_the_count_the_limit_and_the_file():
    said = leases.scope_busy_line("h3", {"busy": True, "what": "line-full", "waiting": 3, "max_waiting": 3, "path": "/etc/mnft/lab.yaml"})
    assert said == ("h3: you have 3 run(s) waiting in line here, and the lab allows each user at most 3 (max_waiting in /etc/mnft/lab.yaml): "
                    "wait for one of your waiting runs to start, or stop one (`mnft lab` shows the line)")


# ------------------------------------------------------------------------------------------------ the policy file


def test_the_labs_policy_reads_the_two_limits_and_ignores_a_bad_value_saying_so(tmp_path):
    good = tmp_path / "lab.yaml"
    good.write_text("idle_stop: 2h\nmax_gpus_while_others_wait: 4  # per host\nmax_waiting: 3\n")
    good.chmod(0o644)
    assert labpolicy.lab_policy([str(good)]) == {"path": str(good), "idle_stop": 7200.0, "max_gpus_while_others_wait": 4, "max_waiting": 3}
    assert watches.lab_policy is labpolicy.lab_policy  # the keeper's idle_stop reads the same file the same way
    good.write_text("max_gpus_while_others_wait: 0\nmax_waiting: many\n")
    assert labpolicy.lab_policy([str(good)]) == {"path": str(good), "problem": (
        f"{good}: max_gpus_while_others_wait '0' is not a whole number from 1 up and is ignored; "
        f"{good}: max_waiting 'many' is not a whole number from 1 up and is ignored")}


def test_the_lease_side_looks_for_the_policy_in_etc_then_in_the_lease_directory(lease_dir, monkeypatch):
    assert labpolicy.policy_paths() == ("/etc/mnft/lab.yaml", str(lease_dir / "mnft-lab.yaml"))
    monkeypatch.setenv("MNFT_LEASE_DIR", "relative")  # no lease is taken there: no file to look for there either
    assert labpolicy.policy_paths() == ("/etc/mnft/lab.yaml",)


# ------------------------------------------------------------------------------------------------ the controller


def test_a_waiting_take_tells_every_host_how_many_hosts_the_run_waits_for(monkeypatch):
    told = []

    def take_one(self, fleet, host, holder, python=None):
        told.append((host.name, holder.get("hosts")))
        return HostResult(host.name, Status.OK, stdout=json.dumps({"taken": True, "paths": []}))

    monkeypatch.setattr(leases.Leases, "_take_one", take_one)
    two = parse("hosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2}\n  h2b: {address: 10.0.0.2, user: lab}\n")  # h2b: h2, another login
    with Fleet(two) as fleet:
        for run_id, scope, hosts in (("R", leases.Scope(wait=60), two.hosts), ("S", leases.Scope(wait=60), two.hosts[:1]),
                                     ("T", leases.Scope(), two.hosts[:1])):  # T does not wait: no ticket, no count
            taken = leases.Leases("train", run_id, scope)
            taken.take(fleet, hosts)
            taken.release()
    assert told == [("h1", 2), ("h2", 2), ("h1", 1), ("h1", None)]  # h2b is h2 (one machine): taken once


NOW = 1_800_000_000.0


def device(index: int, login: str | None = None) -> dict:
    """A GPU as a host's lab view has it: held by a running run of `login`, else free."""
    uid = next((u for u, n in NAMES.items() if n == login), None)
    holder = {"run_id": f"{login}-running", "command": "train", "login": login, "user": login, "uid": uid, "taken": NOW - 600} if login else None
    return {"index": index, "state": "held" if login else "free", "holder": holder, "lockers": [f"{login} pid 9"] if login else []}


def inventory(n: int = 2):
    return parse("hosts:\n" + "".join(f"  h{i}: {{address: 10.0.0.{i}}}\n" for i in range(1, n + 1)))


POLICY = {"path": "/etc/mnft/lab.yaml", "max_gpus_while_others_wait": 3, "max_waiting": 2}


def view(devices: list[dict], tickets: list[dict]) -> dict:
    """A host's lab view, its line in the order the host makes it (mnft.onhost.line.placed)."""
    return {"devices": devices, "policy": POLICY, "line": line.placed(tickets, devices, POLICY)}


# h1: bob holds 3 GPUs (at the limit), alice 1; bob's run RX over several hosts came before carol's RM.
# h2: alice holds 1 GPU; carol's RM (over several hosts) came after alice's RA2.
VIEWS = {
    "h1": view([device(0, "bob"), device(1, "bob"), device(2, "bob"), device(3, "alice")],
               [holder("RB", BOB, NOW - 90), holder("RX", BOB, NOW - 80, hosts=2), holder("RA", ALICE, NOW - 70),
                holder("RM", CAROL, NOW - 60, hosts=2)]),
    "h2": view([device(0, "alice"), device(1)], [holder("RA2", ALICE, NOW - 65), holder("RM", CAROL, NOW - 60, hosts=2)]),
}


def test_mnft_lab_says_why_each_waiting_run_waits_its_position_and_who_is_ahead_by_which_rule():
    assert [w["run_id"] for w in VIEWS["h1"]["line"]] == ["RA", "RX", "RM", "RB"]
    assert [w["run_id"] for w in VIEWS["h2"]["line"]] == ["RM", "RA2"]
    why = {(r.host, r.run): r.why for r in lab.rows(inventory(), VIEWS) if r.state == "waiting"}
    limit = "bob holds 3 GPU(s) here, the lab's max_gpus_while_others_wait is 3: their runs wait while others do"
    assert why["h1", "RA"] == "first in line: it starts once its devices are free"
    assert why["h1", "RX"] == f"position 2: behind alice's run RA ({limit})"
    assert why["h1", "RM"] == ("position 3: behind alice's run RA (before an earlier run over several hosts, which this one stays behind: "
                               "those start in the order they came); bob's run RX (first come, first served, as between all runs over "
                               "several hosts)")
    assert why["h1", "RB"] == (f"position 4: behind alice's run RA and carol's run RM ({limit}); bob's run RX (fewest GPUs held first: "
                               f"bob's run spans several hosts and counts none here, bob 3)")
    assert why["h2", "RA2"] == "position 2: behind carol's run RM (fewest GPUs held first: carol's run spans several hosts and counts none here, alice 1)"
    same = line.placed([holder("A2", ALICE, 20.0), holder("A1", ALICE, 10.0)], [], POLICY)
    assert lab.why_waits(same, 1, POLICY) == "position 2: behind alice's run A1 (first come, first served)"


def test_mnft_lab_sums_up_each_user_and_the_labs_limits():
    table = lab.rows(inventory(), VIEWS)
    summary = lab.users(inventory(), VIEWS, table)
    assert summary["users"] == [
        {"user": "alice", "gpus_held": 2, "held_on": {"h1": 1, "h2": 1}, "waiting": 2, "at_limit_on": []},
        {"user": "bob", "gpus_held": 3, "held_on": {"h1": 3}, "waiting": 2, "at_limit_on": ["h1"]},
        {"user": "carol", "gpus_held": 0, "held_on": {}, "waiting": 1, "at_limit_on": []},  # one run over two hosts: one run waiting
    ]
    assert summary["limits"]["max_gpus_while_others_wait"] == 3 and summary["limits"]["max_waiting"] == 2 and not summary["limits"]["differ"]
    assert lab.limits_line(summary["limits"]) == "the lab's limits: max_gpus_while_others_wait 3, max_waiting 2 (/etc/mnft/lab.yaml)"
    differ = dict(VIEWS, h2=dict(VIEWS["h2"], policy={}))
    limits = lab.lab_limits(inventory(), differ)
    assert limits["differ"] and limits["max_waiting"] is None
    assert lab.limits_line(limits) == ("the lab's limits differ by host: h1: max_gpus_while_others_wait 3, max_waiting 2 "
                                       "(/etc/mnft/lab.yaml); h2: none")


def test_mnft_lab_json_carries_the_users_and_the_limits_and_each_waiting_rows_why(capsys):
    from mnft.hosts.report import print_lab

    assert print_lab(inventory(), VIEWS, True, 0.1) == 0
    out = json.loads(capsys.readouterr().out)
    assert [u["user"] for u in out["users"]] == ["alice", "bob", "carol"] and out["limits"]["max_waiting"] == 2
    assert [r["why"] for r in out["devices"] if r["state"] == "waiting"][0] == "first in line: it starts once its devices are free"
    assert print_lab(inventory(), VIEWS, False, 0.1) == 0
    text = capsys.readouterr().out
    assert "position 4: behind alice's run RA and carol's run RM" in text and "the lab's limits: max_gpus_while_others_wait 3, max_waiting 2" in text
