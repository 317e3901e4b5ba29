"""A lab shared by many people (issue 29), the pure parts: which GPUs a run picks on a host (the fastest-linked
free ones), what nvidia-smi's answers read as, which hosts `--nodes N` takes, what `mnft lab` shows, and the one
line that says why a run cannot have its devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mnft.core.errors import InputError
from mnft.hosts import lab, leases
from mnft.onhost import gpuread, line
from mnft.onhost import leases as hostleases
from mnft.hosts.inventory import parse

TOPO = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV18\tSYS\tSYS\t0-31\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\tSYS\t0-31\t0\t\tN/A\n"
    "GPU2\tSYS\tSYS\t X \tNV18\t32-63\t1\t\tN/A\n"
    "GPU3\tSYS\tSYS\tNV18\t X \t32-63\t1\t\tN/A\n"
    "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)


def test_topology_reads_every_pair_of_gpus_and_ranks_nvlink_above_pcie_above_the_smp_link():
    links = gpuread.parse_topology(TOPO)
    assert links[(0, 1)] == links[(1, 0)] == links[(2, 3)] == 118
    assert links[(0, 2)] == links[(1, 3)] == 10
    assert (0, 0) not in links
    assert gpuread.link_score("NV4") > gpuread.link_score("PIX") > gpuread.link_score("PXB") > gpuread.link_score("PHB") \
        > gpuread.link_score("NODE") > gpuread.link_score("SYS") > gpuread.link_score("???")


def test_two_gpus_are_picked_from_one_nvlink_pair_not_across_sockets():
    links = gpuread.parse_topology(TOPO)
    assert gpuread.pick([0, 1, 2, 3], 2, links) == [0, 1]
    assert gpuread.pick([1, 2, 3], 2, links) == [2, 3]  # GPU 0 taken: the other pair, not 1 and 2
    assert gpuread.pick([0, 2], 2, links) == [0, 2]  # what is free, when nothing better is
    assert gpuread.pick([0, 3], 3, links) is None  # fewer free than asked
    assert gpuread.pick([3, 1, 2], 1, {}) == [1]  # no topology: the lowest indices


def test_nvidia_smi_answers_read_as_devices_and_their_compute_processes():
    devices = gpuread.parse_devices("0, GPU-aa, NVIDIA H100 80GB HBM3, 81559, 1024, 97\n1, GPU-bb, NVIDIA, Inc. X, 81559, 0, 0\nbad line\n")
    assert [(d["index"], d["uuid"], d["name"], d["memory_used_mib"], d["utilization"]) for d in devices] == [
        (0, "GPU-aa", "NVIDIA H100 80GB HBM3", 1024, 97), (1, "GPU-bb", "NVIDIA, Inc. X", 0, 0)]
    assert gpuread.parse_apps("GPU-aa, 4242, 1024\nGPU-bb, [N/A], 3\n") == [("GPU-aa", 4242, 1024)]


def test_a_lease_file_is_named_for_its_device_and_a_workdir_for_its_path():
    assert hostleases.device_name({"index": 3}) == "mnft-dev-gpu3.json"
    assert hostleases.device_name({"index": None}) == "mnft-dev-cpu.json"
    assert hostleases.work_name("/root/mnft") == hostleases.work_name("/root/./mnft/") != hostleases.work_name("/root/mnft2")
    assert hostleases.work_name("/root/mnft").startswith("mnft-work-")


def test_the_line_is_first_come_first_served_by_the_controllers_queue_time_then_the_ticket():
    assert sorted([{"queued": 20.0, "ticket": "a"}, {"queued": 10.0, "ticket": "z"}, {"queued": 10.0, "ticket": "b"}, {}],
                  key=line.order) == [{"queued": 10.0, "ticket": "b"}, {"queued": 10.0, "ticket": "z"}, {"queued": 20.0, "ticket": "a"}, {}]


# ------------------------------------------------------------------------------------------------ the lab's views

NOW = 1_800_000_000.0


def gpu(index, state="free", run=None, login=None, lockers=None, processes=()):
    holder = {"run_id": run, "command": "train", "user": login, "login": login, "controller": "ctl", "pid": 7, "taken": NOW - 600} if run else None
    return {"index": index, "uuid": f"GPU-{index}", "name": "H100", "memory_total_mib": 81559, "memory_used_mib": 1000 if state != "free" else 0,
            "utilization": 97 if state != "free" else 0, "processes": list(processes), "state": state, "holder": holder,
            "lockers": lockers if lockers is not None else ([f"{login} pid 99"] if run else [])}


def inventory(n=4):
    return parse("hosts:\n" + "".join(f"  h{i}: {{address: 10.0.0.{i}}}\n" for i in range(1, n + 1)))


VIEWS = {
    "h1": {"devices": [gpu(0, "held", "R1", "alice"), gpu(1, "held", "R1", "alice"), gpu(2, "held", "R2", "bob"), gpu(3, "held", "R2", "bob")], "line": []},
    "h2": {"devices": [gpu(0), gpu(1), gpu(2, "outside", processes=[{"pid": 4242, "user": "carol", "used_mib": 900}]), gpu(3)],
           "line": [{"run_id": "R3", "command": "train", "login": "dave", "queued": NOW - 60, "want": 2}]},
    "h3": {"devices": [gpu(0), gpu(1), gpu(2), gpu(3)], "line": []},
    "h4": {"error": "connection refused", "status": "unreachable"},
}


def test_lab_rows_show_each_device_free_held_or_used_outside_mnft_and_each_hosts_line():
    rows = {(r.host, r.device): r for r in lab.rows(inventory(), VIEWS)}
    assert (rows["h1", "0"].state, rows["h1", "0"].user, rows["h1", "0"].run, rows["h1", "0"].command) == ("held", "alice", "R1", "train")
    assert rows["h1", "2"].user == "bob" and rows["h1", "0"].memory == "1000/81559 MiB" and rows["h1", "0"].utilization == 97
    assert (rows["h2", "2"].state, rows["h2", "2"].user, rows["h2", "2"].detail) == ("outside", "carol", "in use outside mnft: pid 4242")
    assert (rows["h2", "#1"].state, rows["h2", "#1"].user, rows["h2", "#1"].run, rows["h2", "#1"].detail) == ("waiting", "dave", "R3", "wants 2 GPU(s)")
    assert (rows["h4", "-"].state, rows["h4", "-"].detail) == ("unreachable", "connection refused")
    assert [r.device for r in lab.rows(inventory(), VIEWS) if r.host == "h3"] == ["0", "1", "2", "3"]


def test_who_holds_a_device_is_the_lock_holders_owner_not_what_the_lease_file_claims():
    forged = {"h1": {"devices": [gpu(0, "held", "R1", "alice", lockers=["mallory pid 66"])]}}
    row = lab.rows(inventory(1), forged)[0]
    assert row.user == "mallory" and row.detail == "the lease file names alice"
    assert leases.verified({"login": "alice"}, ["mallory pid 66"]) == " (its lock is held by mallory pid 66)"
    assert leases.verified({"login": "alice"}, ["alice pid 5"]) == ""


def test_nodes_picks_hosts_with_the_devices_free_in_inventory_order_and_says_why_for_each():
    pick = lab.pick_nodes(inventory(), VIEWS, 2, 2)
    assert pick.hosts == ("h2", "h3")
    why = dict(pick.why)
    assert why["h1"] == "0 of 4 device(s) free, 2 needed"
    assert why["h2"] == "picked: 3 of 4 device(s) free" and why["h4"].startswith("left out: unreachable")
    assert lab.pick_nodes(inventory(), VIEWS, 1, None).hosts == ("h3",)  # every device: only a host with all free


def test_nodes_beyond_what_is_free_is_refused_unless_the_run_waits_and_beyond_the_inventory_is_bad_input():
    pick = lab.pick_nodes(inventory(), VIEWS, 3, 2)
    assert pick.hosts is None
    line = lab.not_picked_line(pick, 3, 2)
    assert line.splitlines()[0].startswith("--nodes 3: h4: unreachable: connection refused")  # the host not reached first
    assert line.splitlines()[1].startswith("--nodes 3: fewer than 3 host(s) have 2 free GPU(s) (of those reached: h1: 0 of 4 device(s) free, 2 needed; h2: ")
    assert lab.pick_nodes(inventory(), VIEWS, 3, 2, wait=True).hosts == ("h1", "h2", "h3")
    with pytest.raises(InputError, match=r"^--nodes 5: .* has 4 training host\(s\)$"):
        lab.pick_nodes(inventory(), VIEWS, 5, 2)
    with pytest.raises(InputError, match=r"^--gpus 0: "):
        lab.check_gpus(0)


def test_a_run_refused_its_devices_is_told_who_holds_each_and_who_waits_before_it():
    reply = {"busy": True, "what": "devices", "want": 2, "devices": VIEWS["h1"]["devices"],
             "ahead": [{"run_id": "R3", "command": "train", "user": "dave", "login": "dave", "controller": "ctl", "pid": 8, "started": NOW}]}
    line = leases.scope_busy_line("h1", reply)
    assert line.startswith("h1: 2 GPU(s) asked, 0 of 4 free: GPU 0, 1: train run R1 by alice@ctl pid 7 since ")
    assert "; GPU 2, 3: train run R2 by bob@ctl pid 7 since " in line
    assert "; 1 run(s) wait in line before this one: train run R3 by dave@ctl pid 8 since " in line
    assert line.endswith(" (--wait to wait in line; `mnft lab` shows the lab)")
    outside = leases.scope_busy_line("h2", {"what": "devices", "want": 4, "devices": VIEWS["h2"]["devices"]})
    assert "GPU 2: in use outside mnft (pid 4242 of carol)" in outside
    assert leases.scope_busy_line("h1", {"what": "no-gpus", "want": 2}).startswith("h1 has no GPUs (no nvidia-smi) for --gpus 2")


def test_the_whole_host_is_refused_while_a_run_holds_devices_there_naming_each():
    reply = {"what": "runs", "held": [dict(VIEWS["h1"]["devices"][0]["holder"], device={"index": 0}, lockers=["alice pid 99"]),
                                      dict(VIEWS["h1"]["devices"][2]["holder"], device=None, workdir="/home/bob/mnft", lockers=["bob pid 98"])]}
    line = leases.scope_busy_line("h1", reply)
    assert line.startswith("h1 is busy: GPU 0: train run R1 by alice@ctl pid 7 since ")
    assert "; workdir /home/bob/mnft: train run R2 by bob@ctl pid 7 since " in line
    two = leases.scope_busy_line("h1", {"what": "runs", "held": [dict(reply["held"][0], device={"index": i}) for i in (0, 1)]
                                        + [dict(reply["held"][0], device=None, workdir="/home/alice/mnft")]})
    assert two.startswith("h1 is busy: GPU 0, 1, workdir /home/alice/mnft: train run R1 by alice@ctl pid 7 since ")
    assert line.endswith(": the whole host is not changed under a run (wait for it to end, or ask its user)")
    job = leases.scope_busy_line("h1", {"what": "runs", "held": [dict(reply["held"][0], device=None, workdir="/home/alice/mnft/outputs/J1")]})
    assert job.startswith("h1 is busy: job directory /home/alice/mnft/outputs/J1: train run R1 by alice@ctl pid 7 since ")


def test_the_same_job_twice_at_once_is_refused_naming_the_run_that_holds_its_directory():
    holder = VIEWS["h1"]["devices"][0]["holder"]
    line = leases.scope_busy_line("h1", {"what": "workdir", "workdir": "/home/alice/mnft/outputs/J1", "holder": holder})
    assert line.startswith("h1: the job's working directory /home/alice/mnft/outputs/J1 is in use by train run R1 by alice@ctl pid 7 since ")
    assert "one job runs once at a time, as both runs would write its files" in line
    assert line.endswith("(mnft stop R1, or wait for it; a new run without --resume gets a directory of its own)")
    sync = leases.scope_busy_line("h1", {"what": "workdir", "workdir": "/home/alice/mnft", "holder": dict(holder, command="sync", run_id=None)})
    assert sync.startswith("h1: workdir /home/alice/mnft is busy: sync by alice@ctl") and sync.endswith("(wait)")


def test_a_job_files_gpus_is_a_whole_number_of_gpus_per_host(tmp_path: Path):
    from mnft.run.job import load_job_file

    (tmp_path / "train.py").write_text("print('hi')\n")
    good = tmp_path / "good.yaml"
    good.write_text("script: train.py\ngpus: 2\n")
    assert load_job_file(good).gpus == 2
    for bad in ("0", "true", "'2'", "65"):
        path = tmp_path / "bad.yaml"
        path.write_text(f"script: train.py\ngpus: {bad}\n")
        with pytest.raises(InputError, match=r"key 'gpus': .*a whole number of GPUs per host from 1 to 64"):
            load_job_file(path)


def test_a_run_on_gpus_sees_exactly_its_devices_numbered_as_nvidia_smi_numbers_them():
    from mnft.run import launch
    from mnft.run.job import cli_job

    inv = lab.with_gpus(inventory(2), 2)
    plans = launch.plan(inv, master_addr="10.0.0.1", port=29502, run_id="R", job_id="R", options=launch.LaunchOptions(job=cli_job(("t.py",))),
                        ifaces={}, env={}, secret_names=(), visible={"h1": (2, 3), "h2": (0, 1)},
                        held={"h1": ("/run/lock/mnft-dev-gpu2.json",)})
    assert [(p.env["CUDA_VISIBLE_DEVICES"], p.env["CUDA_DEVICE_ORDER"], p.slots) for p in plans] == [("2,3", "PCI_BUS_ID", 2), ("0,1", "PCI_BUS_ID", 2)]
    assert "--nproc-per-node" in plans[0].argv and plans[0].argv[plans[0].argv.index("--nproc-per-node") + 1] == "2"
    assert plans[0].spec("R", {}, launch.LaunchOptions())["leases"] == ["/run/lock/mnft-dev-gpu2.json"]
    assert json.dumps(plans[1].spec("R", {}, launch.LaunchOptions())["leases"]) == "[]"


def test_check_tells_another_users_run_from_a_leftover_of_your_own_and_judges_only_a_runs_own_gpus():
    from mnft.check.rules import gpus_in_use

    leftover = {"index": 0, "processes": [{"pid": 11, "user": "root", "mine": True}]}
    theirs = {"index": 1, "processes": [{"pid": 12, "user": "bob", "mine": False}]}
    held = {"index": 2, "processes": [{"pid": 13, "user": "bob", "mine": False}],
            "lease": {"holder": {"run_id": "R2", "command": "train", "user": "bob", "login": "bob", "controller": "ctl", "pid": 9,
                                 "started": NOW}, "lockers": ["bob pid 98"]}}
    found = {p.message: (p.severity, p.fix) for p in gpus_in_use("h1", [leftover, theirs, held, {"index": 3, "processes": []}])}
    assert found["GPU 0 is held by your process(es) 11"][0] == "warning"
    assert found["GPU 1 is in use by bob (pid 12)"][0] == "note"
    message = next(m for m in found if m.startswith("GPU 2 is held by another user's train run R2 by bob@ctl pid 9 since "))
    assert found[message][0] == "note"
    assert len(found) == 3
    assert [p.message for p in gpus_in_use("h1", [leftover, theirs, held], own=(1,))] == ["GPU 1 is in use by bob (pid 12)"]


def test_two_runs_on_one_master_search_for_their_rendezvous_port_from_different_places():
    from mnft.run.train import rendezvous_port

    inv = inventory(2)
    assert rendezvous_port(inv, {"h1": (2, 3), "h2": (0, 1)}) == inv.rendezvous_port + 2
    assert rendezvous_port(inv, {"h1": (0, 1)}) == inv.rendezvous_port
    assert rendezvous_port(inv, {}) is None  # no --gpus: the inventory's port, as before


@pytest.mark.parametrize("free, picked", [
    (("h2", "h3"), ("h2",)),  # the first host (the master) left out
    (("h4",), ("h4",)),  # every host but the last
    (("h1", "h3"), ("h1",)),  # the master kept
])
def test_a_pick_that_leaves_the_master_out_runs_on_a_master_it_has(free, picked):
    """--nodes 1 --gpus 2 over hosts whose GPUs are held by others: the run lands on a picked host, which is its
    master (was: KeyError 'h1' from the check's master address, the inventory's master cut away)."""
    from mnft.check.rules import master_address

    full = {"devices": [gpu(i, "held", "R1", "alice") for i in range(4)], "line": []}
    views = {f"h{i}": ({"devices": [gpu(d) for d in range(4)], "line": []} if f"h{i}" in free else full) for i in range(1, 5)}
    pick = lab.pick_nodes(inventory(), views, 1, 2)
    assert pick.hosts == picked
    cut = inventory().only(pick.hosts)
    assert [h.name for h in cut.hosts] == list(picked) and cut.master_name == picked[0]
    facts = {"interfaces": [{"name": "eth0", "up": True, "ipv4": [f"10.0.0.{picked[0][1]}/24"]}]}
    assert master_address(cut, facts) == (f"10.0.0.{picked[0][1]}", None)
    assert cut.gang().master.name == picked[0]


def test_an_inventorys_named_master_stays_master_when_it_is_picked():
    named = parse("master: h3\nhosts:\n" + "".join(f"  h{i}: {{address: 10.0.0.{i}}}\n" for i in range(1, 5)))
    assert named.only(["h2", "h3"]).master_name == "h3"
    assert named.only(["h2", "h4"]).master_name == "h2"


def test_nodes_before_the_host_keys_are_trusted_names_that_cause_first_whole_and_offers_no_wait():
    """Was: `fewer than 2 host(s) have 2 free GPU(s): node1: left out: host-key-rejected (unknown host key … if that
    is the host's ); … (--wait to wait in line; …)`: the GPUs first, the fix cut mid-sentence, --wait that cannot help."""
    error = ("unknown host key for h1 (ssh-ed25519 SHA256:abc): if that is the host's key, record it with "
             "`mnft trust-hosts --hosts lab.yaml` and run again")
    views = {f"h{i}": {"error": error.replace("h1", f"h{i}"), "status": "host-key-rejected"} for i in range(1, 5)}
    pick = lab.pick_nodes(inventory(), views, 2, 2)
    line = lab.not_picked_line(pick, 2, 2)
    first, *rest = line.splitlines()
    assert first == f"--nodes 2: h1: host-key-rejected: {error}"  # whole: its fix is there
    assert all("trust-hosts --hosts lab.yaml` and run again" in one for one in line.splitlines()[:4])
    assert "--wait" not in line and "waiting would not help" in line
    busy = dict(VIEWS, h3=VIEWS["h1"])  # h1 and h3 held by runs, h2 has 3 free, h4 unreachable
    waits = lab.not_picked_line(lab.pick_nodes(inventory(), busy, 2, 2), 2, 2)
    assert waits.splitlines()[0].startswith("--nodes 2: h4: unreachable: connection refused") and "--wait to wait in line" in waits


def test_ctrl_c_while_a_host_hangs_ends_mnft_lab_at_once(tmp_path, hanging_host):
    """Issue 36: a host that accepts TCP and never speaks SSH held Ctrl-C up for its whole connect timeout (the
    interpreter joined the thread still waiting on it): now that question is abandoned (mnft.core.threads)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "-r", str(Path(__file__).resolve().parent.parent), "lab", "--hosts",
                             str(hanging_host.inventory(tmp_path / "lab.yaml")), "--connect-timeout", "120"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not hanging_host.accepted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hanging_host.accepted
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)  # generous: it waited out the 120 s before
        finally:
            proc.kill()
    assert proc.returncode == 130 and out.strip().splitlines()[-1] == "mnft: interrupted (Ctrl-C)", out

