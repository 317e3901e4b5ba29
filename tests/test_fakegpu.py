"""The test bed's GPUs that are not there (tests/fakegpu.py, `Cluster.create(gpus=N)`): a stand-in for nvidia-smi that
answers as the real one formats its answers, so mnft's own readers (the probe, the device leases) read it as they
read a GPU server; a process uses a device while it is registered and alive; a login user made with torch=True runs
torch and nvidia-smi on the hosts. The unit tests run the stand-in here on a state directory of their own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import fakegpu
import pytest

from mnft.onhost import facts
from mnft.onhost import gpuread, health, procs

FAKE = Path(fakegpu.__file__)
UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
CSV = "--format=csv,noheader,nounits"


@pytest.fixture
def gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host with 4 fake H100s, as the test bed makes one: config.json and a 1777 registry per device."""
    state = tmp_path / "mnft-fake-gpu"
    (state / "used").mkdir(parents=True)
    (state / "config.json").write_text(json.dumps(fakegpu.default_config(4)))
    for index in range(4):
        (state / "used" / str(index)).mkdir()
        os.chmod(state / "used" / str(index), 0o1777)
    monkeypatch.setenv(fakegpu.STATE_ENV, str(state))
    return state


def smi(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The stand-in as a host runs it: an executable on its shebang, Debian's /usr/bin/python3."""
    done = subprocess.run([str(FAKE), *args], capture_output=True, text=True, timeout=30)
    if check:
        assert done.returncode == 0 and done.stderr == "", done.stderr
    return done


def wait_until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


@pytest.fixture
def on_gpu1(gpus: Path):
    """`nvidia-smi --fake-use 1 -- sleep 30`: someone ran a process by hand on GPU 1 (its pid is sleep's, by exec)."""
    proc = subprocess.Popen([str(FAKE), "--fake-use", "1", "--", "sleep", "30"])
    try:
        wait_until(lambda: (gpus / "used" / "1" / str(proc.pid)).exists())
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_executable_is_one_file_of_the_standard_library_run_by_the_system_python():
    assert FAKE.read_text().startswith("#!/usr/bin/python3\n") and os.access(FAKE, os.X_OK)
    done = subprocess.run(["/usr/bin/python3", "-I", "-c", f"import sys; sys.path.insert(0, {str(FAKE.parent)!r}); import fakegpu; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mnft', 'yaml', 'torch')))"],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "[]", done.stderr


def test_a_hosts_nvidia_smi_runs_the_stand_ins_compiled_code_and_answers_as_the_file_does(gpus: Path, tmp_path: Path):
    """The test bed's nvidia-smi (fakegpu.STUB) runs this file's bytecode, compiled once by the hosts' Python, from
    the host's state directory: the same answers, exit codes and errors as the file itself; a host whose state is
    gone answers as a host without a driver."""
    stub = tmp_path / "nvidia-smi"
    stub.write_text(fakegpu.STUB)
    stub.chmod(0o755)
    (gpus / fakegpu.CODE_NAME).write_bytes(fakegpu.compiled())
    fakegpu.set_utilization(str(gpus), 2, 40)
    for args in (["--query-gpu=" + health.GPU_READ, CSV], ["--query-gpu=index,uuid,memory.used", "--format=csv"],
                 ["--query-compute-apps=" + gpuread.SMI_APPS, CSV], ["topo", "-m"], ["-L"], ["--query-gpu=bogus", CSV]):
        mine, theirs = smi(*args, check=False), subprocess.run([str(stub), *args], capture_output=True, text=True, timeout=30)
        assert (theirs.returncode, theirs.stdout, theirs.stderr) == (mine.returncode, mine.stdout, mine.stderr), args
    (gpus / fakegpu.CODE_NAME).unlink()
    gone = subprocess.run([str(stub), "-L"], capture_output=True, text=True, timeout=30)
    assert gone.returncode == fakegpu.NO_DRIVER_EXIT and gone.stdout.strip() == fakegpu.NO_DRIVER


def test_the_config_is_read_as_json_reads_it_and_anything_else_is_no_driver(gpus: Path):
    config = dict(fakegpu.default_config(2), ecc={"1": [2, 5]}, persistence=False, latency_ms=40.5, name="NVIDIA \u00e9 \"x\"")
    text = json.dumps(config, indent=1) + "\n"
    assert fakegpu.parse_json(text) == json.loads(text)
    for bad in ("", "{", '{"count": 2} trailing', "{'count': 2}", "[1, 2,]"):
        with pytest.raises(ValueError):
            fakegpu.parse_json(bad)
    (gpus / "config.json").write_text('{"count": 2,')
    assert fakegpu.load_config(str(gpus)) is None


def test_uuids_are_sha256_of_the_host_and_index_as_hashlib_makes_it():
    import hashlib

    digest = hashlib.sha256(b"h1:3").hexdigest()
    assert fakegpu.gpu_uuid("h1", 3) == "GPU-%s-%s-%s-%s-%s" % (digest[:8], digest[8:12], digest[12:16], digest[16:20], digest[20:32])


def test_uuids_are_the_real_form_and_the_same_every_time_for_one_host_and_index():
    assert UUID.match(fakegpu.gpu_uuid("h1", 0))
    assert fakegpu.gpu_uuid("h1", 0) == fakegpu.gpu_uuid("h1", 0)
    assert len({fakegpu.gpu_uuid("h1", 0), fakegpu.gpu_uuid("h1", 1), fakegpu.gpu_uuid("h2", 0), fakegpu.gpu_uuid("h11", 1)}) == 4


def test_the_probe_reads_every_device_of_the_host(gpus):
    found = facts._parse_gpus(smi("--query-gpu=" + facts.GPU_QUERY, CSV).stdout)
    assert [(g["index"], g["name"], g["memory_total_mib"], g["memory_used_mib"], g["driver"]) for g in found] == [
        (i, "NVIDIA H100 80GB HBM3", 81559, 0, "550.54.15") for i in range(4)]
    assert [g["uuid"] for g in found] == [fakegpu.gpu_uuid(os.uname().nodename, i) for i in range(4)]
    assert all(UUID.match(g["uuid"]) for g in found)
    assert facts._parse_apps(smi("--query-compute-apps=" + facts.APP_QUERY, CSV).stdout) == []


def test_a_process_run_on_gpu_1_by_hand_shows_there_with_its_memory_and_nowhere_else(gpus, on_gpu1):
    uuid1 = fakegpu.gpu_uuid(os.uname().nodename, 1)
    apps = facts._parse_apps(smi("--query-compute-apps=" + facts.APP_QUERY, CSV).stdout)
    assert [(uuid, app["pid"], app["name"], app["used_mib"], app["mine"]) for uuid, app in apps] == [
        (uuid1, on_gpu1.pid, "/usr/bin/sleep", fakegpu.DEFAULT_MIB, True)]
    rows = smi("--query-gpu=index,memory.used,memory.free,utilization.gpu", CSV).stdout.splitlines()
    assert rows == ["0, 0, 81559, 0", f"1, {fakegpu.DEFAULT_MIB}, {81559 - fakegpu.DEFAULT_MIB}, 97", "2, 0, 81559, 0", "3, 0, 81559, 0"]

    # mnft's device leases read the same answers: GPU 1 is in use, by this very process
    devices = gpuread.parse_devices(smi("--query-gpu=" + gpuread.SMI_QUERY, CSV).stdout)
    assert [(d["index"], d["memory_used_mib"], d["utilization"]) for d in devices] == [(0, 0, 0), (1, 1024, 97), (2, 0, 0), (3, 0, 0)]
    assert gpuread.parse_apps(smi("--query-compute-apps=" + gpuread.SMI_APPS, CSV).stdout) == [(uuid1, on_gpu1.pid, 1024)]


def test_once_the_process_is_gone_the_device_is_free_and_its_stale_entry_is_removed(gpus, on_gpu1):
    on_gpu1.kill()
    on_gpu1.wait()
    assert smi("--query-compute-apps=pid,used_memory", CSV).stdout == ""
    assert smi("--query-gpu=memory.used,utilization.gpu", CSV, "-i", "1").stdout == "0, 0\n"
    assert not (gpus / "used" / "1" / str(on_gpu1.pid)).exists()  # its owner (this user) read it: tidied away


def test_a_zombie_or_a_reused_pid_uses_no_device(gpus):
    zombie = subprocess.Popen(["true"])
    wait_until(lambda: fakegpu.start_time(zombie.pid) is None)  # exited, not yet waited for: a zombie
    (gpus / "used" / "0" / str(zombie.pid)).write_text("1 500\n")
    began = fakegpu.start_time(os.getpid())
    (gpus / "used" / "2" / str(os.getpid())).write_text(f"{began - 1} 500\n")  # this pid, but an earlier process's
    try:
        assert smi("--query-compute-apps=pid", CSV).stdout == ""
        assert fakegpu.uses(str(gpus), 4) == {0: [], 1: [], 2: [], 3: []}
    finally:
        zombie.wait()


def test_the_answers_with_a_header_and_units_are_the_real_ones(gpus, on_gpu1):
    fields = "index,name,uuid,memory.total,memory.used,memory.free,utilization.gpu,utilization.memory,driver_version,pci.bus_id,count"
    lines = smi("--query-gpu=" + fields, "--format=csv").stdout.splitlines()
    assert lines[0] == ("index, name, uuid, memory.total [MiB], memory.used [MiB], memory.free [MiB], utilization.gpu [%], "
                        "utilization.memory [%], driver_version, pci.bus_id, count")
    assert re.fullmatch(r"1, NVIDIA H100 80GB HBM3, GPU-[0-9a-f-]{36}, 81559 MiB, 1024 MiB, 80535 MiB, 97 %, \d+ %, 550\.54\.15, "
                        r"00000000:[0-9A-F]{2}:00\.0, 4", lines[2]), lines[2]
    assert len(lines) == 5
    assert smi("--query-gpu=index,memory.used", "--format=csv,noheader").stdout.splitlines()[1] == "1, 1024 MiB"
    apps = smi("--query-compute-apps=gpu_uuid,gpu_bus_id,pid,process_name,used_memory", "--format=csv").stdout.splitlines()
    assert apps[0] == "gpu_uuid, gpu_bus_id, pid, process_name, used_gpu_memory [MiB]"
    assert apps[1:] == [f"{fakegpu.gpu_uuid(os.uname().nodename, 1)}, {fakegpu.bus_id(1)}, {on_gpu1.pid}, /usr/bin/sleep, 1024 MiB"]


def test_topo_prints_the_real_tab_separated_matrix_and_legend_and_the_leases_pick_an_nvlink_pair(gpus):
    text = smi("topo", "-m").stdout
    lines = text.splitlines()
    assert lines[0] == "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"
    assert lines[1].startswith("GPU0\t X \tNV18\tSYS\tSYS\t") and lines[1].endswith("\t0\t\tN/A")
    assert lines[4].startswith("GPU3\tSYS\tSYS\tNV18\t X \t") and lines[4].endswith("\t1\t\tN/A")
    assert lines[5:8] == ["", "Legend:", ""]
    assert "  X    = Self" in lines and "  NV#  = Connection traversing a bonded set of # NVLinks" in lines
    assert any(line.startswith("  SYS  = Connection traversing PCIe as well as the SMP interconnect") for line in lines)
    links = gpuread.parse_topology(text)
    assert links[(0, 1)] == links[(3, 2)] == gpuread.link_score("NV18") and links[(1, 2)] == gpuread.link_score("SYS")
    assert gpuread.pick([0, 1, 2, 3], 2, links) == [0, 1] and gpuread.pick([1, 2, 3], 2, links) == [2, 3]


def test_the_leases_find_the_devices_on_the_path_as_on_a_gpu_server(gpus, tmp_path, monkeypatch, on_gpu1):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").symlink_to(FAKE)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    devices, links = gpuread.read_devices(topology=True)
    assert [d["index"] for d in devices] == [0, 1, 2, 3]
    assert devices[1]["processes"] == [{"pid": on_gpu1.pid, "user": procs.user_name(os.getuid()), "used_mib": 1024}]
    assert gpuread.pick([0, 2, 3], 2, links) == [2, 3]


def test_a_take_of_a_busy_host_asks_nvidia_smi_two_questions_once_this_boots_links_are_cached(gpus, tmp_path, monkeypatch, on_gpu1):
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\necho "$1" >> {asked}\nexec {FAKE} "$@"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def questions() -> list[str]:
        text = asked.read_text() if asked.exists() else ""
        asked.unlink(missing_ok=True)
        return sorted(text.split())

    monkeypatch.setenv("MNFT_NVML", "0")  # should this machine have the driver's library
    first, links = gpuread.read_devices(topology=True, live=False)
    assert questions() == ["--query-compute-apps=gpu_uuid,pid,used_memory", "--query-gpu=" + health.GPU_READ, "topo"]
    again, cached = gpuread.read_devices(topology=True, live=False)
    # the devices' health and (a GPU has memory in use) their processes, asked each time; the links from the cache
    assert questions() == ["--query-compute-apps=gpu_uuid,pid,used_memory", "--query-gpu=" + health.GPU_READ]
    assert cached == links and [d["uuid"] for d in again] == [d["uuid"] for d in first]
    assert [d["processes"] for d in again][1] == [{"pid": on_gpu1.pid, "user": procs.user_name(os.getuid()), "used_mib": 1024}]
    gpuread.read_devices()  # `mnft lab`: memory in use and utilisation now, never from the cache
    assert "--query-gpu=" + health.GPU_READ in questions()


def test_the_processes_are_asked_only_when_some_gpu_has_memory_in_use_and_never_missed(gpus, tmp_path, monkeypatch):
    """A look asks nvidia-smi for the compute processes only when a GPU it just read reports memory in use: on a
    host whose GPUs are all idle that is one nvidia-smi instead of two. A process with a context on any GPU, the
    smallest one the stand-in registers (1 MiB), is seen every time, with its pid, on its GPU."""
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f'#!/bin/sh\necho "$1" >> {asked}\nexec {FAKE} "$@"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MNFT_NVML", "0")

    def questions() -> list[str]:
        text = asked.read_text() if asked.exists() else ""
        asked.unlink(missing_ok=True)
        return sorted(text.split())

    for live in (True, False):  # lab's look, a take's
        devices, _ = gpuread.read_devices(live=live)
        assert [d["processes"] for d in devices] == [[], [], [], []]
        assert "--query-compute-apps=" + gpuread.SMI_APPS not in questions()
    me = procs.user_name(os.getuid())
    for index in range(4):
        proc = subprocess.Popen([str(FAKE), "--fake-use", str(index), "--mib", "1", "--", "sleep", "30"])
        try:
            wait_until(lambda: (gpus / "used" / str(index) / str(proc.pid)).exists())
            for live in (True, False):
                devices, _ = gpuread.read_devices(live=live)
                assert [d["processes"] for d in devices] == [[{"pid": proc.pid, "user": me, "used_mib": 1}] if i == index else []
                                                             for i in range(4)]
                assert "--query-compute-apps=" + gpuread.SMI_APPS in questions()
        finally:
            proc.kill()
            proc.wait()
    with pytest.raises(subprocess.CalledProcessError):  # a CUDA context takes memory: the stand-in has none of 0 MiB
        subprocess.run([str(FAKE), "--fake-use", "0", "--mib", "0", "--", "true"], check=True, capture_output=True)


@pytest.mark.parametrize("devices, asked", [
    ([{"memory_used_mib": 0}, {"memory_used_mib": 0}], False),
    ([{"memory_used_mib": 0}, {"memory_used_mib": 1}], True),  # any memory in use: a process may hold it
    ([{"memory_used_mib": 0}, {"memory_used_mib": None}], True),  # [N/A]: not known to be idle
    ([{"memory_used_mib": 0}, {}], True),
    ([{"memory_used_mib": 0}, {"memory_used_mib": "[Unknown Error]"}], True),
    ([{"memory_used_mib": 0, "health": {"mig": True}}], True),  # MIG slices: their use is theirs
    ([{"memory_used_mib": 0}, {"health": {"lost": "Unable to determine the device handle for GPU 0000:3B:00.0"}}], False),
    ([], False),
])
def test_which_reads_may_show_a_compute_process(devices, asked):
    assert gpuread.may_have_processes(devices) is asked


def test_list_and_banner_name_every_device_the_driver_and_who_uses_what(gpus, on_gpu1):
    listed = smi("-L").stdout.splitlines()
    assert listed == [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {fakegpu.gpu_uuid(os.uname().nodename, i)})" for i in range(4)]
    banner = smi().stdout
    assert "Driver Version: 550.54.15     CUDA Version: 12.4" in banner
    assert re.search(r"CUDA Version:\s*([0-9.]+)", banner).group(1) == "12.4"  # as the probe reads it
    assert re.search(rf"\|\s+1\s+N/A\s+N/A\s+{on_gpu1.pid}\s+C\s+/usr/bin/sleep\s+1024MiB \|", banner)
    assert "1024MiB /  81559MiB" in banner and len({len(line) for line in banner.splitlines()[1:]}) == 1  # one width


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "Invalid combination of input arguments"),
    (["topo", "-x"], "Invalid combination of input arguments"),
    (["--query-gpu=index,bogus", CSV], 'Field "bogus" is not a valid field to query.'),
    (["--query-gpu=index", "--format=xml"], "not a valid format"),
    (["--fake-use", "7", "--", "true"], "no device 7"),
    (["--fake-use", "1", "true"], "usage: nvidia-smi --fake-use"),
])
def test_what_nvidia_smi_refuses_exits_2_with_a_message_on_stderr(gpus, args, message):
    done = smi(*args, check=False)
    assert (done.returncode, done.stdout) == (2, "") and message in done.stderr


def test_a_host_without_its_config_answers_as_one_whose_driver_is_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv(fakegpu.STATE_ENV, str(tmp_path / "none"))
    done = smi("--query-gpu=index", CSV, check=False)
    assert done.returncode == 9 and "couldn't communicate with the NVIDIA driver" in done.stdout


def worker(env: dict, script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)


def test_a_torchrun_worker_with_the_rank_snippet_uses_its_local_ranks_device_and_says_what_it_saw(gpus):
    proc = worker({"RANK": "3", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"},
                  fakegpu.RANK_SNIPPET + "import time\ntime.sleep(30)\n")
    try:
        assert proc.stdout.readline() == "mnft-test: rank 3 local 1 sees CUDA_VISIBLE_DEVICES=2,3\n"
        wait_until(lambda: fakegpu.uses(str(gpus), 4)[3])
        assert fakegpu.uses(str(gpus), 4) == {0: [], 1: [], 2: [], 3: [(proc.pid, fakegpu.DEFAULT_MIB)]}
    finally:
        proc.kill()
        proc.wait()


def test_without_fake_gpus_the_rank_snippet_only_prints(tmp_path):
    proc = worker({fakegpu.STATE_ENV: str(tmp_path / "none"), "RANK": "0", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "5"},
                  fakegpu.RANK_SNIPPET + "print('trained; the snippet left', [n for n in globals() if 'mnft' in n], flush=True)\n")
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (0, "mnft-test: rank 0 local 0 sees CUDA_VISIBLE_DEVICES=5\ntrained; the snippet left []\n")


# --------------------------------------------------------------------------------------------------- on the cluster


@pytest.mark.cluster
def test_a_cluster_without_gpus_has_no_nvidia_smi(cluster):
    assert cluster.gpus == 0
    assert cluster.run(cluster.hosts[0], ["sh", "-c", "command -v nvidia-smi"], check=False).returncode != 0


@pytest.mark.cluster
def test_on_a_gpu_cluster_root_and_a_torch_user_see_the_gpus_and_the_user_trains_on_the_ones_it_is_given(fresh_cluster_factory):
    cluster = fresh_cluster_factory(1, gpus=4)
    h1 = cluster.hosts[0]
    home = cluster.add_user("ada", torch=True)

    def ssh(argv, user="root", timeout=60):
        done = subprocess.run(cluster.ssh_argv(h1, argv, user=user), capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    assert h1.home.stat().st_mode & 0o7777 == 0o711  # root's home: passable, not listable; sshd (StrictModes) still lets root in
    assert "Driver Version: 550.54.15" in ssh(["nvidia-smi"])
    assert ssh(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"], user="ada").splitlines() == [
        f"{i}, NVIDIA H100 80GB HBM3" for i in range(4)]
    assert ssh([cluster.python, "-c", "import torch, getpass; print(getpass.getuser(), torch.__version__)"], user="ada").startswith("ada ")
    assert subprocess.run(cluster.ssh_argv(h1, ["ls", "/root"], user="ada"), capture_output=True, timeout=30).returncode != 0

    # ada trains with torchrun on GPUs 2 and 3: each rank registers on its own device and says what it saw
    script = h1.root / "tmp" / home.removeprefix("/tmp/") / "train.py"
    script.write_text(fakegpu.RANK_SNIPPET + "import os, time\nwhile not os.path.exists('stop'):\n    time.sleep(0.1)\n")
    train = subprocess.Popen(cluster.ssh_argv(h1, ["env", "CUDA_VISIBLE_DEVICES=2,3", cluster.python, "-m", "torch.distributed.run",
                                                   "--standalone", "--nproc-per-node", "2", "train.py"], user="ada"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        used = wait_until(lambda: (lambda u: u if u[2] and u[3] else None)(cluster.gpu_users(h1)), timeout=120)
        assert used[0] == used[1] == [] and len(used[2]) == len(used[3]) == 1
        assert {os.stat(f"/proc/{pid}").st_uid for pid in used[2] + used[3]} == {pwd_uid(h1, "ada")}
        apps = facts._parse_apps(ssh(["nvidia-smi", "--query-compute-apps=" + facts.APP_QUERY, CSV]))  # root sees ada's
        assert sorted(app["pid"] for _, app in apps) == sorted(used[2] + used[3])
    finally:
        (script.parent / "stop").write_text("")
        out, err = train.communicate(timeout=120)
    assert train.returncode == 0, out[-2000:] + err[-2000:]
    assert sorted(line for line in out.splitlines() if line.startswith("mnft-test:")) == [
        "mnft-test: rank 0 local 0 sees CUDA_VISIBLE_DEVICES=2,3", "mnft-test: rank 1 local 1 sees CUDA_VISIBLE_DEVICES=2,3"]
    assert cluster.gpu_users(h1) == {0: [], 1: [], 2: [], 3: []}


def pwd_uid(host, name: str) -> int:
    """A cluster user's uid, from the host's own copy of /etc/passwd."""
    for line in (host.root / "tmp" / ".mnft-users" / "passwd").read_text().splitlines():
        if line.split(":")[0] == name:
            return int(line.split(":")[2])
    raise KeyError(name)


def test_a_test_sets_what_utilisation_a_device_reports_whoever_uses_it_and_the_keepers_sample_reads_it(gpus, on_gpu1):
    from mnft.onhost import rungpus

    fakegpu.set_utilization(str(gpus), 1, 0)  # in use, and idle: a shell holding memory, computing nothing
    fakegpu.set_utilization(str(gpus), 2, 80)  # busy without a registered process
    query = "--query-gpu=index,utilization.gpu,memory.used"
    assert rungpus.parse_gpu_util(smi(query, CSV).stdout) == [
        {"index": 0, "util": 0.0, "mem_mib": 0.0}, {"index": 1, "util": 0.0, "mem_mib": 1024.0},
        {"index": 2, "util": 80.0, "mem_mib": 0.0}, {"index": 3, "util": 0.0, "mem_mib": 0.0}]
    fakegpu.set_utilization(str(gpus), 1, None)
    assert smi("--query-gpu=utilization.gpu", CSV, "-i", "1").stdout == "97\n"  # as its use says again
