"""Issue 38's pure parts: what counts as idle, durations, a session's spec and outcome, the usage sums."""

from __future__ import annotations

import os

import pytest

from mnft.core import durations
from mnft.core.errors import InputError
from mnft.hosts.settings import Host
from mnft.onhost import rootfiles, watches
from mnft.run.session import LOGIN_SHELL, ShellOptions, outcome, spec_for


def gpus(*rows):
    return [{"index": i, "util": u, "mem_mib": m} for i, u, m in rows]


def test_a_gpu_is_idle_when_its_utilisation_is_at_most_a_few_percent_and_its_memory_does_not_move():
    before = gpus((0, 0, 1000), (1, 0, 500))
    assert watches.idle_sample([0], before, gpus((0, 5, 1000), (1, 99, 900)))  # GPU 1 is not the run's
    assert not watches.idle_sample([0], before, gpus((0, 6, 1000)))  # above the threshold
    assert not watches.idle_sample([0], before, gpus((0, 0, 1300)))  # loading data: its memory moves
    assert not watches.idle_sample([0, 1], before, gpus((0, 0, 1000)))  # a GPU not answered for is never idle
    assert not watches.idle_sample([0], None, gpus((0, 0, 1000)))  # nothing to compare with yet


def test_the_keeper_ends_a_run_only_once_all_its_gpus_have_been_idle_for_idle_stop():
    now = [1000.0]
    answers = iter([gpus((0, 0, 10)), gpus((0, 0, 10)), gpus((0, 50, 10)), gpus((0, 0, 10)), gpus((0, 0, 10)), gpus((0, 0, 10))])
    watch = watches.IdleWatch({"devices": [0], "idle_stop": 12}, sample=lambda: next(answers), clock=lambda: now[0])
    assert watch.every == 2.0
    reasons = []
    for _ in range(6):
        reasons.append(watch.check())
        now[0] += 5
    assert reasons[:5] == [None] * 5 and "--idle-stop 12s" in reasons[5]
    assert watch.idle_seconds() == pytest.approx(10 + 20)  # idle from the first sample to the busy one, then from that one on


def test_durations_read_as_a_person_writes_them_and_anything_else_is_one_line():
    assert [durations.parse(t, "--time") for t in ("90", "90s", "15m", "2h", "7d", "1h30m")] == [90, 90, 900, 7200, 604800, 5400]
    for bad in ("", "0", "-5m", "2x", "m", "1.5.5h"):
        with pytest.raises(InputError, match="--time"):
            durations.parse(bad, "--time")
    assert [durations.shown(s) for s in (40, 300, 7800, 200000)] == ["40s", "5m", "2h10m", "2d07h"]


def test_a_session_runs_the_login_shell_in_the_workdir_on_its_gpus_and_its_end_is_named_by_its_reason():
    host = Host(name="h1", rank=0, address="10.0.0.1", workdir="/home/a/mnft")
    spec = spec_for("S1", host, (), [3], ["/run/lock/mnft-dev-gpu3.json"], ShellOptions(time=60, idle_stop=30))
    assert spec["cwd"] == "/home/a/mnft" and spec["run_dir"] == "/home/a/mnft/runs/S1/h1" and spec["tag"] == "S1@h1"
    assert spec["env"]["CUDA_VISIBLE_DEVICES"] == "3" and spec["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert spec["argv"] == list(LOGIN_SHELL) and (spec["time"], spec["idle_stop"], spec["devices"]) == (60, 30, [3])
    assert spec_for("S1", host, ("jupyter", "lab"), [], [], ShellOptions())["argv"] == ["jupyter", "lab"]
    assert [outcome(0, r) for r in (None, "stopped", "its time limit (--time 3s) was reached", "its GPUs were idle for 8s (--idle-stop 8s: …)",
                                   "no heartbeat from the controller for 25s")] == ["ended", "stopped", "timed-out", "idle-stopped", "lost"]


def test_usage_sums_gpu_seconds_per_user_and_host_within_the_window_with_the_idle_share_and_the_longest_waits():
    from mnft.hosts.usage import summarise

    lines = {"h1": [{"login": "alice", "devices": [0, 1], "start": 100.0, "end": 200.0, "idle_s": 50.0, "run_id": "R1", "command": "train"},
                    {"login": "bob", "devices": [2], "start": 150.0, "end": 160.0, "idle_s": 0, "queued": 90.0, "run_id": "S1", "command": "shell"},
                    {"login": "bob", "devices": [], "start": 0.0, "end": 300.0, "command": "sync"}],  # no GPU: no GPU-seconds
             "h2": [{"login": "alice", "devices": [0], "start": 50.0, "end": 120.0, "idle_s": 0, "queued": 49.0}]}
    summary = summarise(lines, since=100.0)  # h2's lease began before the window: only its last 20 s count
    assert [(u["user"], u["gpu_seconds"], u["idle_share"]) for u in summary["users"]] == [("alice", 220.0, round(100 / 220, 3)), ("bob", 10.0, 0.0)]
    assert [(h["host"], h["gpu_seconds"]) for h in summary["hosts"]] == [("h1", 210.0), ("h2", 20.0)]
    assert [(w["run"], w["waited_s"]) for w in summary["longest_waits"]] == [("S1", 60.0), (None, 1.0)]


def test_the_keeper_and_the_hosts_hold_process_write_the_same_usage_line(monkeypatch, tmp_path):
    from mnft.onhost import usage, usageread

    monkeypatch.setenv("MNFT_LEASE_DIR", str(tmp_path))
    ended = [{"run_id": "R", "command": "train", "user": "a", "controller": "c", "taken": 1.0, "queued": None, "device": {"index": 0},
              "idle_s": 3, "idle_since": None}, {"run_id": "R", "command": "train", "taken": 1.0, "workdir": "/w"}]
    line = usage.usage_line(ended)  # the one line both write: the hold's process and the keeper share mnft.onhost.usage
    assert line["devices"] == [0] and line["idle_s"] == 3
    for writer in ("hold", "keeper"):
        usage.log_usage(line, str(tmp_path))
    read = usageread.usage(0)
    assert [(entry["run_id"], entry["devices"], entry["login"]) for entry in read["lines"]] == [("R", [0], line["login"])] * 2
    assert oct((tmp_path / f"mnft-usage-{__import__('os').getuid()}.jsonl").stat().st_mode & 0o777) == "0o644"


def test_wait_looks_until_the_run_has_ended_and_exits_with_its_outcome(tmp_path, monkeypatch):
    from mnft.run import notify, records

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path))
    record = records.RunRecord.create("R1", state="running", hosts={})
    looks = []

    def look(r):  # the hosts say it ended on the third look (status writes a detached run's end into its record)
        looks.append(1)
        if len(looks) == 3:
            r.update(state="failed", reason="h1: exited (exit code 1)")

    assert notify.wait(record, look, sleep=lambda s: None) == "failed" and len(looks) == 3
    assert [notify.exit_code(s) for s in ("succeeded", "ended", "stopped", "failed", "timed-out", "idle-stopped")] == [0, 0, 130, 1, 1, 1]


# ------------------------------------------------------------------------------------------------ the lab's idle_stop


def test_a_users_idle_stop_may_lower_the_labs_but_never_raise_it():
    lab = {"path": "/etc/mnft/lab.yaml", "idle_stop": 7200.0}
    assert watches.idle_limit(None, {}) == (None, None, None)
    assert watches.idle_limit(1800, {}) == (1800.0, "--idle-stop 30m", None)
    assert watches.idle_limit(1800, lab) == (1800.0, "--idle-stop 30m", None)  # lowered by the user
    assert watches.idle_limit(5 * 3600, lab) == (7200.0, "the lab's idle_stop 2h00m, /etc/mnft/lab.yaml",
                                               "--idle-stop 5h00m is more than this host allows: ended once its GPUs have all been "
                                               "idle for 2h00m (the lab's idle_stop 2h00m, /etc/mnft/lab.yaml)")
    assert watches.idle_limit(None, lab)[:2] == (7200.0, "the lab's idle_stop 2h00m, /etc/mnft/lab.yaml")  # none asked: the lab's


def test_the_labs_rules_count_only_from_a_file_only_root_can_have_written(tmp_path):
    good = tmp_path / "lab.yaml"
    good.write_text("# set by the admins\nidle_stop: 2h   # nights and weekends\nother: 1\n")
    good.chmod(0o644)
    assert watches.lab_policy([str(good)]) == {"path": str(good), "idle_stop": 7200.0}
    good.chmod(0o664)  # the group may write it: anyone of it could lift the limit
    assert watches.lab_policy([str(good)]) == {}
    good.chmod(0o644)
    os.chown(good, 65534, 65534)  # a user's file (in the shared lease directory anyone may create one)
    assert watches.lab_policy([str(good)]) == {}
    link = tmp_path / "link.yaml"
    os.chown(good, 0, 0)
    link.symlink_to(good)
    assert watches.lab_policy([str(link)]) == {}
    bad = tmp_path / "bad.yaml"
    bad.write_text("idle_stop: soon\n")
    assert watches.lab_policy([str(tmp_path / "missing"), str(bad)]) == {
        "path": str(bad), "problem": f"{bad}: idle_stop 'soon' is not a duration (2h, 90m …) and is ignored"}


def test_durations_on_the_host_read_as_on_the_controller():
    for text in ("90", "90s", "15m", "2h", "1h30m", "7d", "1.5h"):
        assert rootfiles.parse_duration(text) == durations.parse(text, "x")
    for text in ("", "soon", "0", "2 h", "h2", "-5m"):
        assert rootfiles.parse_duration(text) is None


def test_a_runs_gpus_are_its_specs_else_those_its_device_leases_name():
    assert watches.devices_of({"devices": [2]}) == [2]
    assert watches.devices_of({"leases": ["/run/lock/mnft-dev-gpu3.json", "/run/lock/mnft-work-ab.json", "/run/lock/mnft-dev-gpu1.json",
                                        "/run/lock/mnft-dev-cpu.json"]}) == [1, 3]


def test_an_idle_stop_by_the_labs_limit_is_an_idle_stopped_session_and_a_detached_runs_end(tmp_path, monkeypatch):
    from mnft.run.control import write_back
    from mnft.run.records import RunRecord

    monkeypatch.setenv("MNFT_RUNS_DIR", str(tmp_path / "runs"))
    assert outcome(129, "its GPUs were idle for 2h00m (the lab's idle_stop 2h00m, /etc/mnft/lab.yaml: …)") == "idle-stopped"
    record = RunRecord.create("20260101-000000-idle", hosts={"h1": {}, "h2": {}}, state="running", job={"entry": ["x.py"]})
    write_back(record, {"h1": {"state": "exited", "exit_code": 143, "reason": "its GPUs were idle for 30s (--idle-stop 30s: …)"},
                        "h2": {"state": "exited", "exit_code": 143}})
    assert (record.data["state"], record.data["failed_host"]) == ("idle-stopped", "h1")
    assert record.data["reason"] == "h1: its GPUs were idle for 30s (--idle-stop 30s: …)"


def _runtime(kind, **kw):
    from mnft.image.runtime import Runtime

    paths = {"podman": "/usr/bin/podman", "docker": "/usr/bin/docker", "apptainer": "/usr/bin/apptainer"}
    return Runtime(kind=kind, path=paths[kind], uid=1001, gid=1001, home="/home/a", gpus=True,
                   image_id="sha256:" + "ab" * 32, **kw)


def test_a_session_in_an_image_is_the_runtimes_interactive_run_on_its_gpus_in_the_mounted_workdir_as_the_user():
    host = Host(name="h1", rank=0, address="10.0.0.1", workdir="~/mnft")
    options = ShellOptions(image="localhost/lab:1")
    spec = spec_for("S1", host, (), [2, 5], [], options, _runtime("podman", cdi=True))
    argv = spec["argv"]
    assert argv[:5] == ["/usr/bin/podman", "run", "-i", "-t", "--rm"]  # interactive, a tty of its own, removed at its exit
    assert argv[argv.index("--name") + 1] == "mnft-S1-h1" == spec["container"]["name"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--device"] == ["nvidia.com/gpu=2", "nvidia.com/gpu=5"]
    assert argv[argv.index("-v") + 1] == "/home/a/mnft:/home/a/mnft" and argv[argv.index("--workdir") + 1] == "/home/a/mnft"
    assert argv[argv.index("--user") + 1] == "1001:1001" and "--pull" in argv
    image_at = argv.index("ab" * 32)  # by the id the host's facts gave, never the name
    assert argv[image_at + 1:] == ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; fi; exec sh -l"]
    # the environment goes in by name; CUDA_VISIBLE_DEVICES as the container numbers its two GPUs, the tag for the reaper
    assert spec["env"] == {"CUDA_VISIBLE_DEVICES": "0,1", "MNFT_SESSION": "S1"}
    named = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert named == sorted(["CUDA_VISIBLE_DEVICES", "MNFT_SESSION", "MNFT_RUN_ID", "MNFT_RUN_TAG", "TERM"])
    assert spec["devices"] == [2, 5]  # the keeper's idle and collision watches read the host's numbers
    assert spec["container"]["teardown"] == ["/usr/bin/podman", "rm", "--force", "--time", "5", "mnft-S1-h1"]
    assert spec["cwd"] == "~/mnft"

    rootless = spec_for("S1", host, ("python", "x.py"), [0], [], options, _runtime("podman", cdi=True, rootless=True))["argv"]
    assert "--userns" in rootless and "--user" not in rootless and rootless[-2:] == ["python", "x.py"]

    docker = spec_for("S1", host, ("nvidia-smi",), [3], [], options, _runtime("docker"))
    assert docker["argv"][:4] == ["/usr/bin/docker", "run", "-i", "-t"] and docker["argv"][docker["argv"].index("--gpus") + 1] == '"device=3"'
    assert docker["container"]["teardown"] == ["/usr/bin/docker", "rm", "--force", "mnft-S1-h1"]

    sif = spec_for("S1", host, (), [3], [], ShellOptions(image="~/images/lab.sif"), _runtime("apptainer"))
    assert sif["argv"][:2] == ["/usr/bin/apptainer", "exec"] and "-t" not in sif["argv"]  # it runs in the keeper's terminal
    assert sif["argv"][sif["argv"].index("--pwd") + 1] == "/home/a/mnft" and "/home/a/images/lab.sif" in sif["argv"]
    assert sif["env"]["CUDA_VISIBLE_DEVICES"] == "3" and sif["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # --nv: the host's numbers
    assert sif["container"]["teardown"] is None  # no daemon: its processes are the keeper's children

    plain = spec_for("S1", host, (), [3], [], ShellOptions())
    assert "container" not in plain and plain["argv"][0] == "/bin/sh"


def test_a_podman_session_on_gpus_without_a_cdi_description_is_one_line_naming_the_fix():
    host = Host(name="h1", rank=0, address="10.0.0.1", workdir="/w")
    with pytest.raises(InputError, match="nvidia-ctk cdi generate"):
        spec_for("S1", host, (), [0], [], ShellOptions(image="localhost/lab:1"), _runtime("podman"))
