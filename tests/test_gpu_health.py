"""Real GPUs misbehave (issue 37): the host side reads each GPU's health once per look and judges it, so that a
GPU that breaks runs is never leased and everyone is told the same words. Read from the test bed's stand-in
nvidia-smi (tests/fakegpu.py), told what to get wrong: a GPU fallen off the bus (nvidia-smi's own text, exit 15),
uncorrectable ECC errors and remaps, throttling, persistence off with a slow driver, MIG, Xid lines in a kernel
log. NVML is turned off here (MNFT_NVML=0): this machine has no driver library, and the stand-in answers as
nvidia-smi."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import fakegpu
import pytest

from mnft.hosts import pyrun
from mnft.onhost import kernellog


from mnft.onhost import drain, gpuread, health, leasefiles, leasehost, smi
from mnft.onhost import leases as hostleases
FAKE = Path(fakegpu.__file__)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lease_dir: Path):
    """A host with 4 stand-in H100s on the PATH, its own kernel log, home and lease directory; returns a function
    that sets what its GPUs get wrong."""
    state = tmp_path / "mnft-fake-gpu"
    (state / "used").mkdir(parents=True)
    for index in range(4):
        (state / "used" / str(index)).mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").symlink_to(FAKE)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,100,-;Linux version 6.1.0\n")
    monkeypatch.setenv(fakegpu.STATE_ENV, str(state))
    monkeypatch.setenv(fakegpu.FAKE_KMSG_ENV, str(kmsg))
    monkeypatch.setenv(kernellog.KMSG_VAR, str(kmsg))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MNFT_NVML", "0")

    def faults(**given):
        config = fakegpu.default_config(4)
        config.update(given)
        (state / "config.json").write_text(json.dumps(config))

    faults()
    return faults


def by_index(devices):
    return {d["index"]: d for d in devices}


def problems(device, level=None):
    return [p["what"] for p in health.health_problems(device) if level is None or p["level"] == level]


def test_a_gpu_fallen_off_the_bus_is_answered_on_stderr_with_exit_15_and_read_as_lost_the_others_as_they_are(host):
    host(lost=[0])
    done = subprocess.run([str(FAKE), "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True)
    assert done.returncode == 15
    assert done.stderr == "Unable to determine the device handle for GPU 0000:18:00.0: Unknown Error\n"
    assert [line.split(",")[0] for line in done.stdout.splitlines()] == ["1", "2", "3"]
    devices = by_index(gpuread.read_devices()[0])
    assert sorted(devices) == [0, 1, 2, 3]
    assert devices[0]["health"]["lost"].startswith("Unable to determine the device handle for GPU 0000:18:00.0")
    assert health.broken(devices[0]).startswith("lost from the bus")
    assert [health.broken(devices[i]) for i in (1, 2, 3)] == [None, None, None]
    assert devices[1]["uuid"] == fakegpu.gpu_uuid(os.uname().nodename, 1) and devices[1]["memory_total_mib"] == 81559


@pytest.mark.parametrize("spelling", ["bus", "index"])
@pytest.mark.parametrize("where", ["stderr", "inline"])
@pytest.mark.parametrize("code", [15, 0])
def test_a_lost_gpu_other_than_the_first_is_placed_by_its_bus_or_index_never_by_where_its_line_came(host, spelling, where, code):
    """The real tool writes the handle error to stderr, which reaches a merged pipe before the rows; whether
    --query-gpu then exits 15 or 0 is not settled: both are read the same."""
    host(lost=[2], lost_spelling=spelling, lost_where=where, lost_exit=code)
    done = subprocess.run([str(FAKE), "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True)
    assert done.returncode == code
    devices = gpuread.read_devices()[0]
    assert [d["index"] for d in devices] == [0, 1, 2, 3]  # never two GPUs numbered alike
    assert [bool(d["health"].get("lost")) for d in devices] == [False, False, True, False]
    assert health.bus_key(devices[2]["bus_id"]) == "3a:00" and devices[3]["uuid"] == fakegpu.gpu_uuid(os.uname().nodename, 3)
    assert health.broken(devices[0]) is None and not any(d["health"].get("gone") for d in devices)


def test_the_handle_errors_line_names_the_gpu_by_bus_id_in_both_spellings_and_a_row_order_that_is_not_the_bus_order():
    rows = "0, GPU-a, 00000000:18:00.0, 1, 0, 0, NVIDIA H100\n1, GPU-b, 00000000:2A:00.0, 1, 0, 0, NVIDIA H100\n"
    old = "Unable to determine the device handle for GPU 0000:AB:00.0: Unknown Error\n"
    new = "Unable to determine the device handle for GPU3: 0000:5D:00.0: Unknown Error\n"
    placed = health.parse_gpu_read(old + new + rows, health.GPU_READ_BASIC)
    assert [(d["index"], health.bus_key(d["bus_id"]), bool(d["health"].get("lost"))) for d in placed] == [
        (0, "18:00", False), (1, "2a:00", False), (2, "ab:00", True), (3, "5d:00", True)]  # GPU3 as its line says; AB: the index left
    assert health.parse_lost(new) == (3, "0000:5D:00.0") and health.parse_lost(old) == (None, "0000:AB:00.0")


def test_a_lost_gpu_seen_earlier_this_boot_keeps_its_uuid_and_one_missing_from_the_list_is_gone(host):
    first = by_index(gpuread.read_devices()[0])
    host(lost=[0])
    assert by_index(gpuread.read_devices()[0])[0]["uuid"] == first[0]["uuid"]
    host(count=3)  # GPU 3 no longer listed at all (the driver reloaded without it)
    gone = [d for d in gpuread.read_devices()[0] if d["uuid"] == first[3]["uuid"]]
    assert len(gone) == 1 and gone[0]["health"] == {"gone": True} and gone[0]["index"] is None and gone[0]["gone_index"] == 3
    assert health.broken(gone[0]).startswith("gone: the host had it earlier this boot (GPU 3, ")


def test_a_gpu_that_fell_off_the_bus_and_renumbered_the_others_is_gone_by_its_uuid_with_its_xid_and_the_others_keep_theirs(host, lease_dir):
    before = gpuread.read_devices()[0]
    uuids = [d["uuid"] for d in before]
    fakegpu.write_xid(1, 79)
    host(gone=[1])  # the driver numbers the rest 0..2
    done = subprocess.run([str(FAKE), "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True)
    assert done.returncode == 0 and [line.split(", ") for line in done.stdout.splitlines()] == [
        ["0", uuids[0]], ["1", uuids[2]], ["2", uuids[3]]]
    devices = gpuread.read_devices()[0]
    listed = [d for d in devices if d["index"] is not None]
    assert [(d["index"], d["uuid"]) for d in listed] == [(0, uuids[0]), (1, uuids[2]), (2, uuids[3])]
    assert [health.broken(d) for d in listed] == [None, None, None]  # GPU 1 now is the healthy one that was GPU 2
    (fallen,) = [d for d in devices if d["index"] is None]
    assert fallen["uuid"] == uuids[1] and fallen["gone_index"] == 1 and health.bus_key(fallen["bus_id"]) == "2a:00"
    assert [x["xid"] for x in fallen["health"]["xids"]] == [79]
    assert health.device_label(fallen) == "the GPU gone from bus 00000000:2A:00.0 (GPU 1 earlier this boot)"
    reply = take(2, lease_dir)  # the fallen GPU is never had; the others are leased by their indices now
    assert reply["taken"] and [d["uuid"] for d in reply["devices"]] == [uuids[2], uuids[3]]
    every = take(None, lease_dir)
    assert every.get("what") == "unavailable"
    assert not any(name.startswith("mnft-dev-cpu") for name in os.listdir(lease_dir))


def test_ecc_remaps_throttling_persistence_and_mig_are_read_and_judged_with_their_fix(host):
    host(ecc={"1": [2, 5], "2": [0, 3]}, remap={"3": ["Yes", "No"]}, throttle={"2": ["hw_thermal_slowdown"]}, persistence=False, mig=[3])
    devices = by_index(gpuread.read_devices()[0])
    assert devices[1]["health"]["ecc_volatile"] == 2 and devices[1]["health"]["ecc_aggregate"] == 5
    assert problems(devices[1], "broken") == ["2 uncorrectable ECC error(s) since the driver loaded"]
    assert problems(devices[2], "broken") == []  # errors of its past only: a warning, still leased
    assert "3 uncorrectable ECC error(s) in its life (none since boot)" in problems(devices[2], "warning")
    assert "clocks throttled (HW thermal slowdown): the likely straggler of any gang it joins" in problems(devices[2], "warning")
    assert problems(devices[3], "broken") == ["a row remap is pending"]
    assert any(p.startswith("MIG mode on") for p in problems(devices[3], "warning"))
    persistence = [p for p in health.health_problems(devices[0]) if p["what"].startswith("persistence mode off")]
    assert persistence and persistence[0]["fix"] == "nvidia-smi -pm 1, or enable nvidia-persistenced"
    fix = [p["fix"] for p in health.health_problems(devices[1]) if p["level"] == "broken"][0]
    assert fix.startswith("drain it") and "reset it" in fix and "reboot" in fix


def test_xid_lines_of_the_kernel_log_are_the_gpus_they_name_and_a_reset_kind_breaks_it(host, tmp_path):
    fakegpu.write_xid(2, 79)
    fakegpu.write_xid(1, 13)
    devices = by_index(gpuread.read_devices()[0])
    assert [x["xid"] for x in devices[2]["health"]["xids"]] == [79]
    assert abs(devices[2]["health"]["xids"][0]["at"] - time.time()) < 60
    assert problems(devices[2], "broken")[0].startswith("Xid 79 (fallen off the bus) at ")
    assert problems(devices[1], "broken") == [] and problems(devices[1], "warning")[0].startswith("Xid 13 in the kernel log")
    assert "xids" not in devices[0]["health"]


def test_an_unreadable_kernel_log_is_said_not_passed_over(host, tmp_path, monkeypatch):
    monkeypatch.setenv(kernellog.KMSG_VAR, str(tmp_path / "no-such-log"))
    devices = gpuread.read_devices()[0]
    assert devices[0]["health"]["kmsg"].startswith(f"the kernel log ({tmp_path / 'no-such-log'})")


def test_the_stand_in_never_writes_the_machines_real_kernel_log(host, monkeypatch):
    monkeypatch.delenv(fakegpu.FAKE_KMSG_ENV)
    if os.path.exists(fakegpu.KMSG) and not os.path.isfile(fakegpu.KMSG):
        with pytest.raises(fakegpu.Refused, match="never written"):
            fakegpu.write_xid(0, 79)


def test_a_stalled_nvidia_smi_is_named_within_its_bound(host, monkeypatch):
    host(stall=3, persistence=False)
    monkeypatch.setattr(smi, "SMI_TIMEOUT", 0.5)
    with pytest.raises(smi.StalledRead) as stalled:
        gpuread.read_devices()
    assert str(stalled.value) == "nvidia-smi did not answer in 0.5 s: is persistence mode off? a wedged driver?"


def take(holder_gpus, lease_dir):
    """A run's take of `holder_gpus` devices on this host, as a hold process answers it (then let go)."""
    holder = {"op": "op-t", "command": "train", "run_id": "R", "user": "u", "controller": "c", "pid": 1, "started": time.time(),
              "scope": {"gpus": holder_gpus, "workdir": None}}
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
    proc.stdin.write(pyrun.payload("leasehost") + json.dumps(holder).encode() + b"\n")
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    proc.stdin.close()
    proc.wait(timeout=10)
    return reply


def test_gpus_2_on_a_host_with_gpu_0_lost_and_gpu_1_ecc_failed_takes_2_and_3_and_every_gpu_is_refused(host, lease_dir):
    host(lost=[0], ecc={"1": [1, 1]})
    assert [d["index"] for d in take(2, lease_dir)["devices"]] == [2, 3]
    refused = take(None, lease_dir)
    assert refused["busy"] and refused["what"] == "unavailable"
    states = by_index(refused["devices"])
    assert states[0]["state"] == states[1]["state"] == "unhealthy" and states[1]["broken"].startswith("1 uncorrectable ECC")
    assert take(3, lease_dir)["what"] == "unavailable"  # 2 healthy GPUs: waiting would not help


def test_a_gpu_back_from_the_bus_refreshes_the_links_cached_while_it_was_lost_and_its_nvlink_pair_is_picked(host, lease_dir):
    host(lost=[0])  # `topo -m` answers without GPU 0: the links the take caches lack it
    assert "GPU0" not in subprocess.run([str(FAKE), "topo", "-m"], capture_output=True, text=True).stdout
    assert [d["index"] for d in take(2, lease_dir)["devices"]] == [2, 3]
    host()  # GPU 0 is back: the cache does not know it at its index
    assert [d["index"] for d in take(2, lease_dir)["devices"]] == [0, 1]
    host(gone=[1])  # GPU 1 fell off the bus and the others were renumbered: the pair that was 2, 3 is 1, 2 now
    assert [d["index"] for d in take(2, lease_dir)["devices"]] == [1, 2]


def test_a_drained_gpu_is_never_taken_and_shows_who_drained_it_when_and_why(host, lease_dir):
    assert drain.set_drain({"gpus": [2], "reason": "fan noise", "by": "ops@ctl"})["drained"]["gpus"]["2"]["reason"] == "fan noise"
    assert [d["index"] for d in take(2, lease_dir)["devices"]] == [0, 1]
    assert [d["index"] for d in take(3, lease_dir)["devices"]] == [0, 1, 3]
    view = hostleases.lab()
    drained = by_index(view["devices"])[2]
    assert drained["state"] == "drained" and drained["drain"]["login"] == "root" and drained["drain"]["reason"] == "fan noise"
    drain.set_drain({"gpus": None, "reason": "rack move"})
    assert take(1, lease_dir)["what"] == "unavailable"
    drain.set_drain({"gpus": None, "undrain": True})
    assert drain.drain_marks()[0] == {"host": None, "gpus": {}}
    assert take(4, lease_dir)["devices"]


def test_a_drain_without_a_reason_is_refused(host):
    with pytest.raises(leasefiles.Refused, match="--reason"):
        drain.set_drain({"gpus": [0], "reason": " "})


def as_user(uid: int, code: str, env: dict) -> dict:
    def drop():
        os.setgid(uid)
        os.setuid(uid)

    done = subprocess.run(["/usr/bin/python3", "-S", "-c", code], capture_output=True, text=True, preexec_fn=drop, env=env, cwd="/", timeout=30)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch):
    """A lease directory as a host's /run/lock is (root's, sticky, world-writable), with the lease script beside it."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="mnft-drain-"))
    os.chmod(top, 0o755)
    (top / "leases").mkdir(mode=0o1777)
    os.chmod(top / "leases", 0o1777)
    shutil.copytree(Path(leasehost.__file__).parent, top / "onhost", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("MNFT_LEASE_DIR", str(top / "leases"))
    yield top
    shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_non_admins_drain_is_refused_and_a_mark_a_user_planted_is_ignored(host, shared):
    code = ("import json, sys; sys.path.insert(0, %r); from onhost import drain, leasefiles\n"
            "try:\n    print(json.dumps(drain.set_drain({'gpus': [0], 'reason': 'mine'})))\n"
            "except leasefiles.Refused as exc:\n    print(json.dumps({'refused': str(exc)}))\n") % str(shared)
    env = dict(os.environ, HOME="/nonexistent")
    refused = as_user(65534, code, env)["refused"]
    assert refused.startswith("nobody may not drain: only root (this host names no admin group") and "`mnft setup --admin-group NAME`" in refused
    assert not (shared / "leases" / drain.DRAIN_NAME).exists()
    planted = shared / "leases" / drain.DRAIN_NAME
    planted.write_text(json.dumps({"host": {"login": "root", "reason": "planted"}, "gpus": {}}))
    os.chown(planted, 65534, 65534)
    marks, problem = drain.drain_marks()
    assert marks == {"host": None, "gpus": {}} and "was not written by root or an admin of this host" in problem


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_member_of_the_group_the_host_names_drains_and_another_admin_undrains(host, shared):
    import grp

    group = grp.getgrgid(65534).gr_name  # nogroup: nobody's own group stands for the lab's admins
    names = shared / "leases" / drain.ADMIN_NAME
    names.write_text(group + "\n")
    os.chmod(names, 0o644)
    code = ("import json, sys; sys.path.insert(0, %r); from onhost import drain, leasefiles\n"
            "print(json.dumps(drain.set_drain({'gpus': [1], 'reason': 'Xid 79 twice'})))\n") % str(shared)
    assert as_user(65534, code, dict(os.environ, HOME="/nonexistent"))["drained"]["gpus"]["1"]["login"] == "nobody"
    marks, problem = drain.drain_marks()
    assert problem is None and marks["gpus"]["1"]["reason"] == "Xid 79 twice"
    drain.set_drain({"gpus": [1], "undrain": True})  # root
    assert drain.drain_marks()[0]["gpus"] == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to change a file's owner")
def test_a_drain_file_fits_the_admins_of_now_when_the_group_changes_and_a_file_linked_elsewhere_is_never_touched(host, shared):
    """mnft setup --admin-group, and its undo, fit the drain file to the admins of now (drain.fit_drain): a file root
    wrote before any group was named becomes theirs to write; undone, it is root's alone again; its marks stay."""
    import grp
    import stat as st

    def owner(path):
        found = os.stat(path)
        return found.st_uid, found.st_gid, st.S_IMODE(found.st_mode)

    group = grp.getgrgid(65534).gr_name
    mark, names = shared / "leases" / drain.DRAIN_NAME, shared / "leases" / drain.ADMIN_NAME
    drain.set_drain({"gpus": [1], "reason": "fan"})  # root, before any group is named
    assert owner(mark) == (0, 0, 0o644)
    names.write_text(group + "\n")
    os.chmod(names, 0o644)
    assert drain.fit_drain() is True and owner(mark) == (0, 65534, 0o664)
    assert drain.fit_drain() is False
    names.unlink()
    assert drain.fit_drain(group) is True and owner(mark) == (0, 0, 0o644)
    assert drain.drain_marks()[0]["gpus"]["1"]["reason"] == "fan"  # still honoured
    mark.unlink()
    elsewhere = shared / "elsewhere"
    elsewhere.write_text("root's own file")
    os.link(elsewhere, mark)  # a user's hard link in the lease directory (fs.protected_hardlinks=0)
    names.write_text(group + "\n")
    assert drain.fit_drain() is False and owner(elsewhere) == (0, 0, 0o644)


# ------------------------------------------------------------------------------------------------ the controller's side


def gpu(index, state="free", **health):
    return {"index": index, "uuid": f"GPU-{index}", "name": "H100", "memory_total_mib": 81559, "memory_used_mib": 0, "utilization": 0,
            "state": state, "processes": [], "health": health}


def lab_inventory():
    from mnft.hosts.inventory import parse

    return parse("hosts:\n  h1: {address: 10.0.0.1}\n  h2: {address: 10.0.0.2}\n")


def test_lab_shows_each_gpus_health_beside_its_lease_and_the_out_of_service_ones_with_why():
    from mnft.hosts import lab

    mark = {"login": "ops", "at": 1_800_000_000, "reason": "fan noise", "by": "ops@ctl", "scope": "gpu"}
    views = {"h1": {"devices": [
        dict(gpu(0, "unhealthy", lost="Unable to determine the device handle for GPU 0000:18:00.0: Unknown Error"), broken="lost from the bus (…)"),
        dict(gpu(1, "held", throttle=["hw_thermal_slowdown"]), holder={"run_id": "R", "command": "train", "login": "alice"}),
        dict(gpu(2, "drained"), drain=mark),
        gpu(3, persistence=False)]},
        "h2": {"devices_error": "nvidia-smi did not answer in 5 s: is persistence mode off? a wedged driver?"}}
    rows = {(r.host, r.device): r for r in lab.rows(lab_inventory(), views)}
    assert rows[("h1", "0")].state == "unhealthy" and rows[("h1", "0")].health.startswith("lost from the bus (Unable to determine")
    assert rows[("h1", "1")].state == "held" and rows[("h1", "1")].health.startswith("clocks throttled (HW thermal slowdown)")
    assert rows[("h1", "2")].state == "drained" and rows[("h1", "2")].detail.startswith("drained by ops (ops@ctl) at ")
    assert rows[("h1", "2")].detail.endswith(": fan noise")
    assert rows[("h1", "3")].state == "free" and rows[("h1", "3")].health.startswith("persistence mode off")
    assert rows[("h2", "-")].state == "failed" and rows[("h2", "-")].detail.startswith("GPUs not read: nvidia-smi did not answer in 5 s")


def test_lab_and_check_name_a_gpu_gone_from_the_bus_by_what_it_was_never_as_the_hosts_cpus():
    from mnft.check.rules import gpu_health
    from mnft.hosts import lab

    fallen = dict(gpu(None, "unhealthy", gone=True), gone_index=1, bus_id="00000000:2A:00.0", broken="gone: …")
    views = {"h1": {"devices": [gpu(0), gpu(1), gpu(2), fallen]}}
    rows = {(r.host, r.device): r for r in lab.rows(lab_inventory(), views)}
    assert rows[("h1", "gone")].state == "unhealthy" and ("h1", "cpu") not in rows
    assert rows[("h1", "gone")].health.startswith("gone: the host had it earlier this boot (GPU 1, GPU-None, bus 00000000:2A:00.0)")
    said = [p.message for p in gpu_health("h1", views["h1"])]
    assert said and said[0].startswith("the GPU gone from bus 00000000:2A:00.0 (GPU 1 earlier this boot): gone: ")


def test_nodes_skips_a_host_whose_free_gpus_are_all_unhealthy_and_every_gpu_of_such_a_host_is_never_had():
    from mnft.hosts import lab

    sick = {"devices": [dict(gpu(0, "unhealthy", ecc_volatile=1), broken="1 uncorrectable ECC error(s) since the driver loaded"),
                        dict(gpu(1, "held"), holder={"run_id": "R"})]}
    well = {"devices": [gpu(0), gpu(1)]}
    picked = lab.pick_nodes(lab_inventory(), {"h1": sick, "h2": well}, 1, 1)
    assert picked.hosts == ("h2",)
    assert dict(picked.why)["h1"] == "0 of 2 device(s) free (1 out of service), 1 needed"  # its healthy GPU may come free: wait for it
    every = lab.pick_nodes(lab_inventory(), {"h1": sick, "h2": well}, 2, None, wait=True)
    assert every.hosts is None and not every.waiting_helps
    assert dict(every.why)["h1"] == ("left out: 1 GPU(s) out of service, 1 of 2 in service, 2 needed "
                                     "(GPU 0: unhealthy: 1 uncorrectable ECC error(s) since the driver loaded)")


def test_a_run_asking_for_every_gpu_of_a_host_with_an_unhealthy_one_is_refused_naming_it_and_why():
    from mnft.hosts import leases

    reply = {"busy": True, "what": "unavailable", "want": None, "devices": [
        dict(gpu(0, "unhealthy"), broken="Xid 79 (fallen off the bus) at 10:02:03"), gpu(1),
        dict(gpu(2, "drained"), drain={"login": "root", "at": 1_800_000_000, "reason": "RMA"})]}
    line = leases.scope_busy_line("h1", reply)
    assert line.startswith("h1: every device of the host (no --gpus) asked, 1 of 3 in service: GPU 0: unhealthy: Xid 79 (fallen off the bus) at 10:02:03; "
                           "GPU 2: drained by root at ")
    assert line.endswith(": RMA (never leased, waiting would not help: --gpus 1 or fewer, or other hosts; `mnft lab` shows the lab)")


def test_check_judges_each_gpus_health_with_its_fix_and_names_a_drained_one():
    from mnft.check.rules import gpu_health

    view = {"devices": [gpu(0, lost="Unable to determine the device handle for GPU 0000:18:00.0: Unknown Error"),
                        gpu(1, throttle=["hw_power_brake_slowdown"]), gpu(2, persistence=False, kmsg="the kernel log (/dev/kmsg) is not readable"),
                        dict(gpu(3), drain={"login": "ops", "at": 1_800_000_000, "reason": "fan"})]}
    found = {(p.message.split(":")[0], p.severity): p for p in gpu_health("h1", view)}
    lost = found[("GPU 0", "error")]
    assert lost.fix.startswith("drain it (mnft drain HOST:GPU --reason …) and reset it") and "reboot" in lost.fix
    assert found[("GPU 1", "warning")].message == "GPU 1: clocks throttled (power brake): the likely straggler of any gang it joins"
    assert found[("GPU 2", "warning")].fix == "nvidia-smi -pm 1, or enable nvidia-persistenced"
    assert found[("GPU 3", "note")].message.startswith("GPU 3: drained by ops at ")
    assert not [p for p in gpu_health("h1", view) if "kernel log" in p.message]  # said once for every host: below
    assert gpu_health("h2", {"error": "nvidia-smi did not answer in 5 s: is persistence mode off? a wedged driver?"})[0].severity == "error"


def test_the_gpu_bench_reads_health_both_ways_side_by_side_and_says_which_it_could_not(host):
    """bench/gpu.py's health step, run here on the stand-in: nvidia-smi read and judged, NVML skipped and said so
    (no libnvidia-ml.so.1 on this machine; on a GPU machine both are timed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", Path(__file__).resolve().parent.parent / "bench" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    host(lost=[0])
    found = bench.health(repeats=2)
    assert found["nvml"]["skipped"].startswith("OSError: libnvidia-ml.so.1")
    assert found["nvidia-smi"]["gpus"] == 4 and found["nvidia-smi"]["median_ms"] > 0
    assert found["nvidia-smi"]["problems"]["0"][0].startswith("lost from the bus")
    assert "| nvidia-smi | " in "\n".join(bench.health_markdown(found))


def test_check_does_not_ask_a_host_again_whose_nvidia_smi_stalled_in_the_probe(monkeypatch):
    # the probe waited its whole bound for nvidia-smi: the lab's look would wait as long again (check took 2 × 5 s)
    from types import SimpleNamespace

    from mnft.check import gather
    from mnft.hosts import leases

    asked = []
    monkeypatch.setattr(leases, "lab", lambda fleet, hosts, timeout=30: asked.extend(h.name for h in hosts) or
                        {h.name: {"devices": [{"index": 0, "state": "free"}]} for h in hosts})
    stall = "nvidia-smi did not answer in 5 s: is persistence mode off? a wedged driver?"
    facts = {"h1": {"nvidia": {"gpus": [{"index": 0}]}}, "h2": {"nvidia": {}, "errors": {"nvidia": stall}}}
    gather.gpu_leases(None, [SimpleNamespace(name="h1"), SimpleNamespace(name="h2")], facts)
    assert asked == ["h1"]
    assert facts["h2"]["gpu_health"]["error"] == stall and facts["h1"]["gpu_health"]["devices"] == [{"index": 0, "state": "free"}]


def test_check_says_an_unreadable_kernel_log_once_for_every_host_it_holds_for():
    from mnft.check.rules import kernel_log_unread

    why = "the kernel log (/dev/kmsg) is not readable by bob (kernel.dmesg_restrict=1): Xid errors are not seen; an admin's …"
    views = {"h1": {"devices": [gpu(0, kmsg=why), gpu(1, kmsg=why)]}, "h2": {"devices": [gpu(0, kmsg=why)]}, "h3": {"devices": [gpu(0)]}, "h4": None}
    (said,) = kernel_log_unread(views)
    assert (said.host, said.field, said.message, said.severity) == ("h1, h2", "kernel-log", why, "note")
    assert kernel_log_unread({"h3": views["h3"]}) == []


def test_lab_says_an_unreadable_kernel_log_once_carries_it_in_json_and_does_not_fail_for_it(capsys):
    from mnft.hosts import report

    why = "the kernel log (/dev/kmsg) is not readable by bob (kernel.dmesg_restrict=1?): Xid errors are not seen"
    views = {h: {"devices": [gpu(0, kmsg=why), gpu(1, kmsg=why)]} for h in ("h1", "h2")}
    assert report.print_lab(lab_inventory(), views, True, 0.1) == 0
    assert json.loads(capsys.readouterr().out)["kernel_log"] == {"h1": why, "h2": why}
    assert report.print_lab(lab_inventory(), views, False, 0.1) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("is not readable by bob") == 1 and "h1, h2: the kernel log (/dev/kmsg) is not readable" in out


# ------------------------------------------------------------------------------------------------ where a member reads Xids


XID_LINE = "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
DENIED = ("No journal files were opened due to insufficient permissions.\n"
          "Hint: You are currently not seeing messages from other users and the system.\n"
          "      Users in groups 'adm', 'systemd-journal' can see all messages.\n")


@pytest.fixture
def restricted(tmp_path, monkeypatch):
    """A host under kernel.dmesg_restrict=1 (opening /dev/kmsg: EPERM), with stand-ins on the PATH that answer as the
    real ones: `sudo` (runs the command when given, a reader mnft's setup would have installed) and `journalctl`
    (the journal as a user who may not read it, unless told `readable`). Returns a function that places them."""
    import errno

    from mnft.onhost import xidreader

    def denied(*_, **__):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(kernellog, "kmsg_records", denied)
    monkeypatch.setattr(kernellog, "_kept", {})  # each test's look asked afresh
    monkeypatch.delenv(kernellog.KMSG_VAR, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv(kernellog.READER_VAR, str(tmp_path / "no-reader"))

    def place(reader=None, journal=None):
        (bin_dir / "sudo").write_text('#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n')
        (bin_dir / "sudo").chmod(0o755)
        if reader is not None:
            (tmp_path / "reader").write_text(reader)
            (tmp_path / "reader").chmod(0o755)
            monkeypatch.setenv(kernellog.READER_VAR, str(tmp_path / "reader"))
        out = journal if journal is not None else ""
        err = "" if journal is not None else DENIED
        (bin_dir / "journalctl").write_text(f"#!/bin/sh\nprintf %s {shlex.quote(out)}\nprintf %s {shlex.quote(err)} >&2\n")
        (bin_dir / "journalctl").chmod(0o755)
        return xidreader

    return place


def test_a_member_under_dmesg_restrict_is_told_once_what_lets_them_see_xids(restricted):
    restricted()
    found, why = kernellog.read_xids()
    assert found == {}
    assert why.startswith("the kernel log (/dev/kmsg) is not readable by root (kernel.dmesg_restrict=1): Xid errors are not seen; ")
    assert "an admin's `mnft setup --only kernel_log` lets every user read the driver's Xid lines" in why
    assert why.endswith("or add root to the systemd-journal group")


def test_a_member_reads_the_xids_through_the_reader_setup_installed(restricted):
    restricted(reader=f"#!/bin/sh\necho '3,812,5000000,-;{XID_LINE}'\n")
    found, why = kernellog.read_xids()
    assert why is None and [x["xid"] for x in found["1b:00"]] == [79]
    assert found["1b:00"][0]["text"].startswith("pid=1234")


def test_a_reader_sudo_will_not_run_is_named_with_what_sudo_said(restricted):
    restricted(reader="#!/bin/sh\necho 'sudo: a password is required' >&2\nexit 1\n")
    found, why = kernellog.read_xids()
    assert found == {}
    assert why.startswith("mnft's reader of Xid lines (") and "did not run for root: sudo: a password is required" in why
    assert why.endswith("an admin re-runs `mnft setup --only kernel_log`")


def test_a_member_of_the_journals_groups_reads_the_xids_from_the_journal(restricted):
    restricted(journal="[    1.000000] h1 kernel: Linux version 6.1.0\n[    5.250000] h1 kernel: " + XID_LINE + "\n"
               "[    6.000000] h1 kernel: python[77]: segfault at 0 ip 0 in " + XID_LINE.replace("1b:00", "2a:00") + "\n")
    found, why = kernellog.read_xids()
    assert why is None and [x["xid"] for x in found["1b:00"]] == [79]
    assert "2a:00" not in found  # words a user's process put in another kernel line are not the driver's Xid


def test_a_member_the_readers_rule_leaves_out_reads_the_journal_and_a_denial_is_asked_once_in_a_while(restricted, tmp_path):
    asked = tmp_path / "asked"
    restricted(reader=f"#!/bin/sh\necho x >> {asked}\necho 'sudo: a password is required' >&2\nexit 1\n",
               journal="[    5.250000] h1 kernel: " + XID_LINE + "\n")
    for _ in range(3):
        found, why = kernellog.read_xids()
        assert why is None and [x["xid"] for x in found["1b:00"]] == [79]
    assert asked.read_text().count("x") == 1  # kept KEEP_S seconds: a wait in line looks every second


def test_a_reader_that_does_not_answer_is_named_within_its_bound(restricted, monkeypatch):
    monkeypatch.setattr(kernellog, "READ_TIMEOUT", 0.5)
    restricted(reader="#!/bin/sh\nsleep 30\n")
    started = time.monotonic()
    found, why = kernellog.read_xids()
    assert found == {} and "did not run for root: did not answer in 0.5 s" in why
    assert time.monotonic() - started < 10


def test_the_reader_prints_the_xid_records_and_nothing_else_of_the_kernel_log(tmp_path, monkeypatch, capsys):
    from mnft.onhost import xidreader

    log = tmp_path / "kmsg"
    log.write_text(f"6,1,100,-;usb 1-1: new device\n3,2,200,-;{XID_LINE}\n4,3,300,-;Out of memory: Killed process 9 (secret-cmd)\n"
                   f"6,4,400,-;audit: name=\"{XID_LINE}\" by someone\n")
    monkeypatch.setattr(xidreader, "KMSG", str(log))
    monkeypatch.setattr(xidreader.kmsg_records, "__defaults__", (str(log), xidreader.MAX_BYTES))
    assert xidreader.main([]) == 0
    assert capsys.readouterr().out == f"3,2,200,-;{XID_LINE}\n"
    assert xidreader.main(["--anything"]) == 2
