"""Issue 37 on the simulated cluster: GPUs that misbehave as real ones do (tests/fakegpu.py told what to get wrong)
are never leased, are shown with their health and who drained them, and a stalled nvidia-smi is named within its
bound. Two hosts with 4 stand-in GPUs each; bob is a login user who is not an admin of the hosts."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from fakegpu import RANK_SNIPPET
from test_cluster_lab import HOLD, Person, end, finished, held, wait_held

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def sick(testbed, tmp_path_factory):
    work = tmp_path_factory.mktemp("sick-lab")
    with testbed.Cluster.create(2, work, outsider=False, gpus=4) as cluster:
        cluster.add_user("bob", password="not used", torch=True)
        cluster.add_user("ann", groups=["labops"])  # the lab's operator: named its admin by setup --admin-group
        yield cluster


# attempt 1 holds its GPU until the test kills it; a later attempt registers on its GPU, says which, and ends
ONCE = RANK_SNIPPET + '''
import os, sys, time

deadline = time.time() + (120 if os.environ.get("MNFT_ATTEMPT") == "1" else 0)
while time.time() < deadline:
    time.sleep(0.2)
print("done", flush=True)
'''


@pytest.fixture
def src(tmp_path: Path) -> Path:
    tree = tmp_path / "lab-src"
    tree.mkdir()
    (tree / "hold.py").write_text(HOLD)
    (tree / "once.py").write_text(ONCE)
    return tree


def test_gpus_2_on_a_host_with_a_lost_gpu_0_and_an_ecc_failed_gpu_1_gets_2_and_3_and_nodes_skips_it(sick, tmp_path, src):
    """As bob, a member who is not bob, on hosts under kernel.dmesg_restrict=1."""
    h1, h2 = sick.hosts
    sick.gpu_faults(h1, lost=[0], ecc={"1": [1, 1]})
    bob = Person(sick, tmp_path, "bob", [h1])
    (tmp_path / "both").mkdir()
    both = Person(sick, tmp_path / "both", "bob", [h1, h2])
    try:
        run = bob.train(src, "sick", "--gpus", "2")
        rows = wait_held(bob, h1.name, 2)
        run_id = bob.run_ids()[-1]
        states = {r["device"]: r for r in rows if r["host"] == h1.name}
        assert (states["2"]["state"], states["3"]["state"]) == ("held", "held")
        assert states["0"]["state"] == "unhealthy" and states["0"]["health"].startswith("lost from the bus (Unable to determine the device handle")
        assert states["1"]["state"] == "unhealthy" and states["1"]["health"] == "1 uncorrectable ECC error(s) since the driver loaded"
        dry = both.mnft("train", "--hosts", both.inventory, "--src", str(src), "--nodes", "1", "--gpus", "2", "--dry-run", "--", "hold.py", "n")
        assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
        assert f"{h1.name}: 0 of 4 device(s) free (2 out of service), 2 needed" in dry.stdout + dry.stderr
        assert f"{h2.name}: picked" in dry.stdout + dry.stderr
        every = bob.mnft("train", "--hosts", bob.inventory, "--src", str(src), "--", "hold.py", "all")
        assert every.returncode != 0 and "GPU 0: unhealthy: lost from the bus" in every.stdout + every.stderr
        end(sick, "sick", [h1])
        finished(run)
        assert bob.seen(run_id, h1) == {"2,3"}
    finally:
        end(sick, "sick", [h1])
        sick.gpu_faults(h1, lost=None, ecc=None)


def test_a_drained_gpu_is_never_picked_and_shown_with_its_reason_and_a_non_admins_drain_is_refused(sick, tmp_path, src):
    h1, h2 = sick.hosts
    root, bob = Person(sick, tmp_path, "root", [h2]), Person(sick, tmp_path, "bob", [h2])
    refused = bob.mnft("drain", f"{h2.name}:0", "--reason", "mine now", "--hosts", bob.inventory)
    assert refused.returncode == 1 and "bob may not drain: only root" in refused.stdout + refused.stderr
    drained = root.mnft("drain", f"{h2.name}:0", "--reason", "Xid 79 twice this week", "--hosts", root.inventory)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    try:
        row = {r["device"]: r for r in bob.lab() if r["host"] == h2.name}["0"]
        assert row["state"] == "drained" and row["detail"].startswith("drained by root") and row["detail"].endswith(": Xid 79 twice this week")
        run = bob.train(src, "d", "--gpus", "3")
        rows = wait_held(bob, h2.name, 3)
        assert [d for d, (state, _, _) in sorted(held(rows, h2.name).items()) if state == "held"] == ["1", "2", "3"]
        end(sick, "d", [h2])
        finished(run)
    finally:
        end(sick, "d", [h2])
        assert root.mnft("undrain", h2.name, "--hosts", root.inventory).returncode == 0


def test_a_15_s_stall_of_nvidia_smi_is_named_within_the_reads_bound(sick, tmp_path):
    h1, h2 = sick.hosts
    sick.gpu_faults(h2, stall=15, persistence=False)
    root = Person(sick, tmp_path, "root", [h1, h2])
    try:
        started = time.monotonic()
        done = root.mnft("lab", "--hosts", root.inventory, "--json", timeout=60)
        took = time.monotonic() - started
        rows = json.loads(done.stdout)["devices"]
        assert done.returncode == 1
        assert [r["detail"] for r in rows if r["host"] == h2.name] == [
            "GPUs not read: nvidia-smi did not answer in 5 s: is persistence mode off? a wedged driver?"]
        assert {r["state"] for r in rows if r["host"] == h1.name} == {"free"}
        print(f"mnft lab with a 15 s stall answered in {took:.1f} s")
    finally:
        sick.gpu_faults(h2, stall=None, persistence=None)


def test_a_run_whose_gpu_logs_an_xid_mid_run_is_restarted_on_the_spare_never_on_that_gpu_again(sick, tmp_path, src):
    """bob's run, on hosts under kernel.dmesg_restrict=1 where the admin's setup installed the reader of Xid lines."""
    h1, h2 = sick.hosts
    admin = Person(sick, tmp_path, "root", [h1, h2])
    installed = admin.mnft("setup", "--hosts", admin.inventory, "--only", "kernel_log")
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    bob = Person(sick, tmp_path, "bob", [h1, h2])
    bob.inventory = str(sick.write_inventory(bob.dir / "lab.yaml", hosts=[h1, h2], user="bob", workdir=bob.workdir, spare={h2.name: True}))
    run = bob.start("train", "--hosts", bob.inventory, "--src", str(src), "--gpus", "1", "--max-restarts", "1", "--backoff", "0.5",
                    "--", "once.py")
    try:
        deadline = time.monotonic() + 180
        while not (used := {i: pids for i, pids in sick.gpu_users(h1).items() if pids}) and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.5)
        assert len(used) == 1, used
        ((gpu, (pid, *_)),) = used.items()
        sick.xid(h1, gpu, 79)  # the driver's word for the GPU that just failed the rank on it
        sick.gpu_faults(h1, gone=[gpu])  # and the GPU falls off the bus: the driver renumbers the others
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        out = finished(run, timeout=240)
        record = json.loads((bob.dir / "runs" / bob.run_ids()[-1] / "run.json").read_text())
        first, second = record["attempts"]
        assert first["cause"]["kind"] == "gpu-xid" and first["hosts"] == [h1.name]
        assert [(x["host"], x["gpu"], x["xid"]) for x in first["cause"]["xids"]] == [(h1.name, gpu, 79)]
        assert f"Xid 79 (fallen off the bus) on {h1.name} GPU {gpu} at " in first["cause"]["detail"]
        assert first["diagnosis"]["kind"] == "gpu-xid" and first["diagnosis"]["fix"].startswith("Xid 79 needs the GPU reset")
        assert second["hosts"] == [h2.name] and second["state"] == "succeeded"
        assert f"{h1.name} replaced by the spare {h2.name} (Xid 79 on its GPU {gpu}: not used again in this run)" in out
        # what the ranks themselves were given: h1's GPU in attempt 1 only, the spare's leased GPU in attempt 2
        run_id = record["run_id"]
        assert bob.seen(run_id, h1) == {str(gpu)}
        assert bob.seen(f"{run_id}-a2", h2) == {str(i) for i in record["devices"][h2.name]}
        assert not (h1.root / "tmp" / "home-bob" / "mnft" / "runs" / f"{run_id}-a2").exists()  # nothing of attempt 2 on h1
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        (h1.root / "kmsg").write_text("")  # the stand-in kernel log: the next test's GPUs without this Xid
        sick.gpu_faults(h1, gone=None)
        admin.mnft("setup", "--hosts", admin.inventory, "--only", "kernel_log", "--undo")


def test_a_member_sees_no_xid_under_dmesg_restrict_until_an_admins_setup_installs_the_reader_and_undo_takes_it_away(sick, tmp_path):
    """Hosts as Debian ships them (kernel.dmesg_restrict=1: /dev/kmsg is root's): bob's look says once that he cannot
    see Xids, and what fixes it; root's `mnft setup --only kernel_log` says what it chose and installs the reader of
    Xid lines only; bob's look then refuses the GPU with the Xid; undo takes the reader and its sudo rule away."""
    h1, h2 = sick.hosts
    root, bob = Person(sick, tmp_path, "root", [h1, h2]), Person(sick, tmp_path, "bob", [h1, h2])
    assert sick.run(h1, ["cat", "/proc/sys/kernel/dmesg_restrict"]).stdout.strip() == "1"
    sick.xid(h1, 2, 79)
    sick.run(h1, ["sh", "-c", "echo '6,9,200,-;usb 1-1: new device of someone' >> /dev/kmsg"])
    try:
        look = bob.mnft("lab", "--hosts", bob.inventory, "--json")
        assert look.returncode == 0, look.stdout[-2000:] + look.stderr[-2000:]
        said = json.loads(look.stdout)
        assert set(said["kernel_log"]) == {h1.name, h2.name}
        assert said["kernel_log"][h1.name].startswith("the kernel log (/dev/kmsg) is not readable by bob (kernel.dmesg_restrict=1)")
        assert "`mnft setup --only kernel_log`" in said["kernel_log"][h1.name]
        assert {r["device"]: r["state"] for r in said["devices"] if r["host"] == h1.name}["2"] == "free"  # the Xid unseen
        table = bob.mnft("lab", "--hosts", bob.inventory)
        assert (table.stdout + table.stderr).count("is not readable by bob") == 1  # said once, for both hosts

        setup = root.mnft("setup", "--hosts", root.inventory, "--only", "kernel_log")
        assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
        assert "through mnft's reader (/usr/local/libexec/mnft-kernel-xids" in setup.stdout
        for host in (h1, h2):
            mode = sick.run(host, ["stat", "-c", "%U %a", "/usr/local/libexec/mnft-kernel-xids", "/etc/sudoers.d/mnft-kernel-xids"]).stdout.split()
            assert mode == ["root", "755", "root", "440"], mode
        mine = bob.mnft("lab", "--hosts", bob.inventory, "--json")
        said = json.loads(mine.stdout)
        assert said["kernel_log"] == {}
        rows = {r["device"]: r for r in said["devices"] if r["host"] == h1.name}
        assert rows["2"]["state"] == "unhealthy" and "Xid 79 (fallen off the bus)" in rows["2"]["health"]
        assert {rows[d]["state"] for d in ("0", "1", "3")} == {"free"}
        # what the reader shows bob: the Xid lines and nothing else of the kernel log
        shown = sick.run(h1, ["su", "bob", "-c", "sudo -n /usr/local/libexec/mnft-kernel-xids"])
        assert "NVRM: Xid" in shown.stdout and "usb" not in shown.stdout
        assert sick.run(h1, ["su", "bob", "-c", "sudo -n /usr/local/libexec/mnft-kernel-xids --any-argument"], check=False).returncode != 0

        undo = root.mnft("setup", "--hosts", root.inventory, "--only", "kernel_log", "--undo")
        assert undo.returncode == 0, undo.stdout[-3000:] + undo.stderr[-3000:]
        assert sick.run(h1, ["ls", "/etc/sudoers.d", "/usr/local/libexec"]).stdout.split() == ["/etc/sudoers.d:", "/usr/local/libexec:"]
        assert set(json.loads(bob.mnft("lab", "--hosts", bob.inventory, "--json").stdout)["kernel_log"]) == {h1.name, h2.name}
    finally:
        (h1.root / "kmsg").write_text("")


def test_setup_admin_group_names_the_admins_on_every_host_whose_members_then_drain_and_undo_takes_it_back(sick, tmp_path):
    h1, h2 = sick.hosts
    root, ann, bob = (Person(sick, tmp_path, user, [h1, h2]) for user in ("root", "ann", "bob"))
    refused = ann.mnft("drain", f"{h2.name}:0", "--reason", "fan", "--hosts", ann.inventory)
    assert refused.returncode == 1 and "ann may not drain: only root" in refused.stdout + refused.stderr
    missing = root.mnft("setup", "--hosts", root.inventory, "--admin-group", "nosuch")
    assert missing.returncode == 1 and "group nosuch does not exist on this host: create it (groupadd nosuch)" in missing.stdout
    named = root.mnft("setup", "--hosts", root.inventory, "--admin-group", "labops")
    assert named.returncode == 0, named.stdout[-3000:] + named.stderr[-3000:]
    assert f"{h1.name} 1. admin_group: name group labops the admins in /etc/mnft/admin-group" in named.stdout
    assert "0 changed" in root.mnft("setup", "--hosts", root.inventory, "--admin-group", "labops").stdout
    assert sick.run(h1, ["stat", "-c", "%U %a", "/etc/mnft/admin-group"]).stdout.split() == ["root", "644"]
    try:
        drained = ann.mnft("drain", f"{h2.name}:0", "--reason", "fan", "--hosts", ann.inventory)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        not_bob = bob.mnft("undrain", f"{h2.name}:0", "--hosts", bob.inventory)
        assert not_bob.returncode == 1 and "only root or a member of group labops" in not_bob.stdout + not_bob.stderr
        assert ann.mnft("undrain", f"{h2.name}:0", "--hosts", ann.inventory).returncode == 0
    finally:
        root.mnft("undrain", f"{h2.name}:0", "--hosts", root.inventory)
    undo = root.mnft("setup", "--hosts", root.inventory, "--only", "admin_group", "--undo")
    assert undo.returncode == 0 and "delete /etc/mnft/admin-group" in undo.stdout, undo.stdout
    again = ann.mnft("drain", f"{h2.name}:0", "--reason", "fan", "--hosts", ann.inventory)
    assert again.returncode == 1 and "ann may not drain: only root" in again.stdout + again.stderr
