"""The lab's second member (issue 45): what a new student meets in the first week, beyond the admin's path.

Pure pieces here, with data in and words out; the cluster tests (test_cluster_lab) run them on the test bed.
"""

from __future__ import annotations

import io
import json
import os

from rich.console import Console

from mnft.cli.tasks import undrain_lines
from mnft.run.train import WaitLine


def test_an_undrain_says_what_came_back_in_service_then_what_stays_drained():
    assert undrain_lines("node2", [1], []) == ["node2 GPU 1: back in service", "node2: nothing else drained"]
    assert undrain_lines("node2", None, []) == ["node2: back in service", "node2: nothing else drained"]
    still = ["node2 GPU 3: drained by root since 10:02: fan"]
    assert undrain_lines("node2", [0, 1], still) == ["node2 GPU 0, 1: back in service", "still drained: node2 GPU 3: drained by root since 10:02: fan"]


def test_a_waiting_run_says_its_place_once_per_change_not_once_per_reply():
    out = io.StringIO()
    line = WaitLine(Console(file=out, width=300, color_system=None))
    holder = {"command": "train", "run_id": "R1", "user": "alice", "controller": "ctl", "pid": 5, "started": 0}
    reply = {"position": 1, "devices": [{"index": 0, "state": "held", "holder": holder}]}
    for _ in range(3):
        line.update("h1", reply)
    line.update("h2", reply)
    line.update("h1", dict(reply, position=2))
    said = out.getvalue().splitlines()
    assert [s.split(" — ")[0] for s in said] == ["h1: waiting in line, position 1", "h2: waiting in line, position 1",
                                                 "h1: waiting in line, position 2"]


def test_usage_counts_gpu_leases_only_and_those_still_running_to_now():
    from mnft.hosts.usage import summarise

    lines = {"h1": [{"login": "root", "devices": [], "start": 0.0, "end": 50.0, "command": "setup"},
                    {"login": "root", "devices": [], "start": 60.0, "end": 90.0, "command": "provision"},
                    {"login": "alice", "devices": [0, 1], "start": 100.0, "end": 200.0, "idle_s": 0, "run_id": "R1", "command": "train"},
                    {"login": "alice", "devices": [2], "start": 150.0, "end": 250.0, "idle_s": 0, "run_id": "R2", "running": True}]}
    summary = summarise(lines, since=0.0)
    assert [(u["user"], u["gpu_seconds"], u["leases"], u["running"]) for u in summary["users"]] == [("alice", 300.0, 2, 1)]  # no root row


def test_a_host_reports_its_gpu_leases_held_now_counted_for_whom_the_kernel_says_holds_them(monkeypatch):
    from mnft.onhost import leases as hostleases
    from mnft.onhost import usageread

    held = [("mnft-dev-gpu0.json", {"op": "o1", "run_id": "R1", "command": "train", "user": "mallory", "login": "mallory", "taken": 10.0,
                                    "device": {"index": 0}, "idle_s": 4, "idle_since": None}, ["alice pid 5", "alice pid 6"]),
            ("mnft-dev-gpu1.json", {"op": "o1", "run_id": "R1", "command": "train", "taken": 10.0, "device": {"index": 1}, "idle_s": 2}, ["alice pid 5"]),
            ("mnft-dev-cpu.json", {"op": "o2", "command": "train", "taken": 10.0, "device": {"index": None}}, ["bob pid 7"])]
    monkeypatch.setattr(hostleases, "held_leases", lambda prefixes=None, op=None: held)
    [line] = usageread.running(100.0)
    assert (line["login"], line["run_id"], line["devices"], line["start"], line["end"], line["idle_s"], line["running"]) == \
        ("alice", "R1", [0, 1], 10.0, 100.0, 2.0, True)


def test_a_workdir_holding_other_code_is_a_note_naming_the_tree_not_a_warning_on_every_host():
    """Runs no longer use the workdir (each places its own code): check from another directory says what the
    workdir holds and that train does not read it, without a warning (issue 45)."""
    from mnft.check.gather import code_problems

    code = {"h1": {"hash": "a", "exists": True, "matches": False, "local_hash": "b", "source": "/home/me/other", "differing": ["x.py"]},
            "h2": {"hash": "b", "exists": True, "matches": True, "local_hash": "b", "source": "/home/me/other", "differing": []}}
    [problem] = code_problems(code)
    assert (problem.host, problem.field, problem.severity) == ("h1", "code", "note")
    assert problem.message.startswith("the workdir holds other code than /home/me/other (x.py); train runs the code it places for each run")


def test_lab_says_what_is_reserved_for_whom_beside_a_run_waiting_in_line():
    """A waiting run's GPUs taken on one host while it waits for another, and the free GPUs of a host whose line is
    not empty (a run that does not wait is refused them): both said, not shown as plain held and free (issue 45)."""
    from mnft.hosts.inventory import parse
    from mnft.hosts.lab import rows

    inventory = parse("hosts:\n  h1: {connection: local}\n  h2: {connection: local}\n")
    waiter = {"command": "train", "run_id": "R9", "user": "alice", "login": "alice", "wait": True, "queued": 5.0, "taken": 6.0}
    views = {"h1": {"now": 10.0, "devices": [{"index": 0, "state": "held", "holder": waiter, "run_started": False, "lockers": ["alice pid 5"]}],
                    "line": []},
             "h2": {"now": 10.0, "devices": [{"index": 0, "state": "free"}, {"index": 1, "state": "held", "holder": {"run_id": "R1", "login": "bob"}}],
                    "line": [dict(waiter, want=2)]}}
    table = {(r.host, r.device): r for r in rows(inventory, views)}
    assert table["h1", "0"].state == "held" and table["h1", "0"].detail.startswith("reserved: its run waits in line for its other hosts")
    assert table["h2", "0"].state == "free" and table["h2", "0"].detail == \
        "reserved for the line: alice's train R9 waits for 2 GPU(s) (--wait to queue behind it)"
    started = dict(views["h1"]["devices"][0], run_started=True)
    assert rows(inventory, {"h1": dict(views["h1"], devices=[started]), "h2": views["h2"]})[0].detail is None


def test_waiting_in_line_is_its_own_figure_never_launch_time_nor_the_runs_wall():
    """A run that waited 94 s in line for its GPUs, then took 10 s to its first step and trained 100 s: launch is
    10 s, the wall 110 s, the queue said beside them (issue 45: `launch 107.4s … goodput 3%`, 94 s of it the queue)."""
    from mnft.run import goodput
    from mnft.run.report import time_table

    attempts = [{"number": 1, "started": 1094.0, "ended": 1204.0, "state": "succeeded"}]
    times = {1: [(1104.0 + s, s) for s in range(0, 101)]}
    spent = goodput.measure(1000.0, 1204.0, attempts, times, waited=94.0)
    data = spent.to_json()
    assert (data["queue_s"], data["wall_s"], data["launch_s"], data["steps_s"]) == (94.0, 110.0, 10.0, 100.0)
    assert data["goodput"] == round(100.0 / 110.0, 4)
    assert "(after 94.0s waiting in line, counted in neither)" in str(time_table(data).title)
    assert "queue_s" not in goodput.measure(1000.0, 1204.0, attempts, times).to_json()  # a run that did not wait


def test_a_session_gets_the_environment_a_run_gets_first_on_path_for_a_command_and_after_a_login_shells_profile(tmp_path):
    import subprocess

    from mnft.hosts.settings import Host
    from mnft.run.session import LOGIN_SHELL, ShellOptions, spec_for

    provisioned = Host(name="h1", rank=0, address="10.0.0.1", workdir="~/mnft", python="~/mnft-env/bin/python")
    assert spec_for("S1", provisioned, (), [0], [], ShellOptions())["path_first"] == "~/mnft-env/bin"
    assert "path_first" not in spec_for("S1", Host(name="h1", rank=0, address="a", python="python3"), (), [0], [], ShellOptions())
    # the login shell's profile sets PATH anew (Debian's /etc/profile does): the environment goes first after it
    profile = tmp_path / ".profile"
    profile.write_text("PATH=/usr/bin:/bin; export PATH\n")
    env = {"HOME": str(tmp_path), "SHELL": "/bin/sh", "ENV": "", "PATH": "/usr/bin:/bin", "MNFT_PATH_FIRST": "/opt/lab/env/bin"}
    done = subprocess.run(list(LOGIN_SHELL), input="echo PATH=$PATH\n", env=env, capture_output=True, text=True, timeout=30)
    said = [line for line in done.stdout.splitlines() if "PATH=" in line]
    assert said and said[-1].split("PATH=", 1)[1].startswith("/opt/lab/env/bin:"), done.stdout + done.stderr


def test_uninstall_of_some_hosts_keeps_this_machines_stores_while_other_provisioned_hosts_use_them():
    from mnft.uninstall.plan import CONTROLLER, plan_items, still_used

    found = {"wheelhouse": {"path": "/h/.mnft/wheelhouse", "kind": "dir", "ours": True, "bytes": 10},
             "code_store": {"path": "/h/.mnft/code", "kind": "dir", "ours": True, "bytes": 5},
             "hash_cache": {"path": "/h/.mnft/cache", "kind": "dir", "ours": True}}
    kept = {i.key: (i.action, i.why) for i in still_used(plan_items(found, CONTROLLER), ["lab@10.0.0.2:22", "lab@10.0.0.3:22"])}
    assert kept["wheelhouse"][0] == kept["code_store"][0] == "keep" and kept["hash_cache"][0] == "remove"
    assert kept["wheelhouse"][1].startswith("still used by 2 other provisioned host(s) (lab@10.0.0.2:22, lab@10.0.0.3:22)")
    assert all(i.action == "remove" for i in still_used(plan_items(found, CONTROLLER), []))  # the last of them: all goes


def test_uninstall_only_names_hosts_of_the_inventory_or_says_which_are_not():
    import pytest

    from mnft.cli.tasks import _named_hosts
    from mnft.core.errors import InputError
    from mnft.hosts.inventory import parse

    inventory = parse("hosts:\n  h1: {connection: local}\n  h2: {connection: local}\n  h3: {connection: local}\n")
    assert _named_hosts(inventory, "h3,h1", "--only") == ["h1", "h3"]
    with pytest.raises(InputError, match=r"^--only h1,h9: h9 is not a host of the inventory \(it has: h1, h2, h3\)$"):
        _named_hosts(inventory, "h1,h9", "--only")


def test_setup_undo_of_one_host_says_which_peers_still_let_it_in():
    from mnft.setup.steps.firewall import plan_undo, table_body, table_peers

    table = "table inet mnft {\n" + table_body("eth0", ["10.0.0.1", "10.0.0.2", "10.0.0.3"], 22, (29500,), (), ()) + "}\n"
    assert table_peers(table) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    plan = plan_undo({"table": table}, ("10.0.0.1", "10.0.0.3"))
    assert plan.changes == ["delete nftables table inet mnft"]
    assert plan.notes == ["10.0.0.1, 10.0.0.3 (not in this undo) still let this host through their firewall and trust its mesh key: "
                          "`mnft setup` on them with an inventory without this host takes it out"]
    assert plan_undo({"table": table}).notes == []  # the whole lab undone: nothing to say


def test_a_runs_progress_in_its_lease_is_numbers_only_whatever_a_lease_file_says():
    from mnft.hosts.lab import progress_of
    from mnft.onhost.leases import progress_of as told

    assert told(b'{"step": 12, "loss": 0.5, "at": 1800000000.5}') == {"step": 12, "loss": 0.5, "at": 1800000000.5}
    assert told(b'{"step": "<b>12</b>", "loss": NaN, "text": "secret"}') is None
    assert told(b'[[[[') is None and told(b'{"loss": true}') is None
    assert told(b'{"step": 1' + b'0' * 400 + b', "loss": 1e999}') is None  # a thousands-digit step, an infinite loss: no number at all
    assert progress_of({"progress": {"step": 3.0, "loss": "x", "at": 1e300}}) == {"step": 3}
    assert progress_of({"progress": "step 3"}) is None and progress_of({}) is None


def test_the_boards_row_of_another_members_run_takes_the_newest_step_its_hosts_hold():
    from mnft.board.runs import others

    rows = [{"host": "h1", "device": "0", "state": "held", "user": "alice", "run": "R1", "command": "train", "since": 100.0,
             "progress": {"step": 40, "loss": 1.5, "at": 200.0}},
            {"host": "h2", "device": "0", "state": "held", "user": "alice", "run": "R1", "command": "train", "since": 100.0,
             "progress": {"step": 42, "loss": 1.4, "at": 210.0}},
            {"host": "h3", "device": "0", "state": "held", "user": "bob", "run": "R2", "command": "train", "since": 100.0}]
    alice, bob = others(rows, set())
    assert (alice["step"], alice["loss"]) == (42, 1.4) and "progress_at" not in alice
    assert (bob["step"], bob["loss"]) == (None, None)


def test_a_hold_writes_the_progress_its_controller_tells_into_its_leases_in_place_never_emptied(tmp_path, monkeypatch):
    from mnft.onhost import hold, leasefiles, leases

    monkeypatch.setenv(leasefiles.LEASE_DIR_VAR, str(tmp_path))
    path = tmp_path / "mnft-lease.json"
    path.write_text(json.dumps({"op": "o1", "run_id": "R1", "user": "alice"}))
    fd = os.open(path, os.O_RDWR)
    try:
        seen = []
        request, rest, stop = hold._next_request(b'hb\nprogress {"step": 7, "loss": 0.25, "at": 5.0}\nprogress [oops]\nhb\n', seen.append)
        assert (request, rest, stop) == (None, b"", False) and seen == [{"step": 7, "loss": 0.25, "at": 5.0}]
        leases.note_progress([fd], seen[0])
        assert json.loads(path.read_text()) == {"op": "o1", "run_id": "R1", "user": "alice", "progress": {"step": 7, "loss": 0.25, "at": 5.0}}
        leases.note_progress([fd], {"step": 8})  # shorter: padded over the old bytes, never truncated first
        assert json.loads(path.read_text())["progress"] == {"step": 8} and path.read_text().endswith(" ")
    finally:
        os.close(fd)
