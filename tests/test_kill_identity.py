"""Kill only what is provably ours (issue 19, class 4): the agent signals a process group only while its leader
still is the run's keeper (start time recorded at launch, and the run's tag in its environment or the run
directory on its command line), or while a process of the run is still a member; any other process only if its
own environment carries the tag. An unrelated process that reuses the recorded group number survives `stop`, and
stopping an ended run is a no-op that says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mnft.hosts import pyrun
from mnft.onhost import runfiles, runprocs

SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


def alive(pid: int) -> bool:
    return runprocs.start_time(pid) is not None


def execed(proc: subprocess.Popen, marker: str = "time.sleep(300)") -> subprocess.Popen:
    """The process once it runs its program (before its exec, /proc shows the parent's environment and command)."""
    deadline = time.monotonic() + 30
    while marker not in " ".join(runprocs._cmdline(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc


def group_leader(env_extra: dict | None = None) -> subprocess.Popen:
    """A process that leads its own process group (pgid = its pid), like a run's keeper or an unrelated daemon."""
    env = dict(os.environ, **(env_extra or {}))
    env.pop(runfiles.TAG_VAR, None) if not env_extra else None
    return execed(subprocess.Popen(SLEEP, start_new_session=True, env=env))


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def ended_run_dir(tmp_path: Path, tag: str, pgid: int, start: int | None) -> Path:
    """A run directory as the agent leaves it after the run ended: spec, pgid, its start time and the exit code."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps({"run_id": tag.split("@")[0], "tag": tag}))
    (run_dir / "pgid").write_text(f"{pgid}\n")
    if start is not None:
        (run_dir / "pgid_start").write_text(f"{start}\n")
    (run_dir / "exit_code").write_text("0\n")
    return run_dir


def test_start_time_is_field_22_of_stat_and_none_for_a_gone_process(procs):
    p = group_leader()
    procs.append(p)
    fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert runprocs.start_time(p.pid) == int(fields[19])
    p.kill()
    p.wait()
    assert runprocs.start_time(p.pid) is None


def test_a_process_is_the_runs_only_with_its_recorded_start_time_and_the_runs_tag(procs):
    tagged = group_leader({runfiles.TAG_VAR: "R1@h1"})
    other = group_leader()
    procs += [tagged, other]
    start = runprocs.start_time(tagged.pid)
    assert runprocs.is_run_process(tagged.pid, start, "R1@h1")
    assert not runprocs.is_run_process(tagged.pid, start + 1, "R1@h1")  # the number reused by a later process
    assert not runprocs.is_run_process(tagged.pid, None, "R1@h1")  # no start time recorded: not provably ours
    assert not runprocs.is_run_process(tagged.pid, start, "R2@h1")  # another run's
    assert not runprocs.is_run_process(other.pid, runprocs.start_time(other.pid), "R1@h1")  # right time, no tag


def test_the_keeper_is_recognised_by_its_command_line_when_its_environment_is_not_readable(tmp_path, procs):
    run_dir = str(tmp_path / "run")
    keeper = execed(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "keep", run_dir], start_new_session=True))
    procs.append(keeper)
    start = runprocs.start_time(keeper.pid)
    assert runprocs.is_run_process(keeper.pid, start, None, run_dir)
    assert not runprocs.is_run_process(keeper.pid, start, None, run_dir + "-other")


def test_an_unrelated_group_that_reuses_the_recorded_number_survives_stop_and_stop_says_the_run_ended(tmp_path, procs):
    unrelated = group_leader()
    procs.append(unrelated)
    # the run's keeper had this number, and another start time: the number was reused
    run_dir = ended_run_dir(tmp_path, "R1@h1", unrelated.pid, runprocs.start_time(unrelated.pid) - 1)
    result = runprocs.terminate(str(run_dir), grace=0.5)
    assert result["ended"] is True and result["killed"] == [] and result["remaining"] == []
    time.sleep(0.2)
    assert unrelated.poll() is None


def test_a_recorded_group_without_its_start_time_is_never_signalled(tmp_path, procs):
    unrelated = group_leader()
    procs.append(unrelated)
    run_dir = ended_run_dir(tmp_path, "R1@h1", unrelated.pid, None)  # a run dir from before pgid_start
    assert runprocs.terminate(str(run_dir), grace=0.5)["ended"] is True
    assert unrelated.poll() is None


def test_a_group_whose_leader_is_gone_is_still_the_runs_while_a_process_of_the_run_is_in_it(tmp_path, procs):
    # the leader (an untagged shell) started a tagged member in its group, as a keeper starts torchrun
    script = f"{runfiles.TAG_VAR}=R1@h1 {sys.executable} -c 'import time; time.sleep(300)' & wait"
    leader = subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True, env={k: v for k, v in os.environ.items() if k != runfiles.TAG_VAR})
    procs.append(leader)
    deadline = time.monotonic() + 10
    while not runprocs.run_pids("R1@h1") and time.monotonic() < deadline:
        time.sleep(0.05)
    run_dir = ended_run_dir(tmp_path, "R1@h1", leader.pid, None)
    assert runprocs.group_is_ours(str(run_dir), leader.pid, "R1@h1")
    assert not runprocs.group_is_ours(str(run_dir), leader.pid, "R2@h1")
    result = runprocs.terminate(str(run_dir), grace=2)
    assert result["remaining"] == [] and leader.pid in result["killed"]
    leader.wait(timeout=10)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK), reason="needs root and /usr/bin/python3 (another user cannot run root's Python)")
def test_an_unprivileged_stop_of_an_ended_run_whose_number_another_user_took_is_a_quiet_no_op(procs):
    import shutil
    import tempfile

    unrelated = group_leader()  # root's
    procs.append(unrelated)
    where = Path(tempfile.mkdtemp(prefix="mnft-kill-"))  # pytest's tmp_path is root's alone
    try:
        where.chmod(0o755)
        run_dir = ended_run_dir(where, "R1@h1", unrelated.pid, runprocs.start_time(unrelated.pid))  # even the same start time
        for path in (run_dir, *run_dir.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        done = subprocess.run(["/usr/bin/python3", "-c", pyrun.BOOTSTRAP, "stop", str(run_dir), "0.5"], input=pyrun.payload("agent"),
                              capture_output=True, timeout=60, user=65534, group=65534, cwd="/")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr and b"PermissionError" not in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["ended"] is True
    assert unrelated.poll() is None


def test_the_run_itself_is_still_stopped_whole(tmp_path, procs):
    tagged = group_leader({runfiles.TAG_VAR: "R1@h1"})
    procs.append(tagged)
    run_dir = ended_run_dir(tmp_path, "R1@h1", tagged.pid, runprocs.start_time(tagged.pid))
    (run_dir / "exit_code").unlink()
    result = runprocs.terminate(str(run_dir), grace=2)
    assert tagged.pid in result["killed"] and result["remaining"] == [] and not result.get("ended")
    assert tagged.wait(timeout=10) == -signal.SIGTERM


def test_stop_of_a_run_ended_everywhere_says_so_and_one_still_running_somewhere_gets_the_table():
    from types import SimpleNamespace

    from mnft.run.report import ended_note

    record = SimpleNamespace(run_id="R1")
    ended = {"killed": [], "remaining": [], "ended": True}
    assert ended_note(record, {"h1": ended, "h2": ended}) == "run R1 already ended on h1, h2: nothing to stop"
    assert ended_note(record, {"h1": ended, "h2": {"killed": [42], "remaining": []}}) is None
    assert ended_note(record, {"h1": ended, "h2": {"state": "unreachable", "error": "no route"}}) is None


def test_stop_waits_for_killed_processes_to_be_gone_and_kills_any_the_run_forked_since():
    """A SIGKILLed process lingers while the kernel frees it (64 torchrun trees on 2 busy cores: longer than the
    0.1 s stop once allowed, and stop said processes remained that were gone a moment later); one of the run's
    that appeared after the kill's scan is killed too, by its tag."""
    tag = "run-settle-test"
    late = execed(subprocess.Popen(SLEEP, env=dict(os.environ, **{runfiles.TAG_VAR: tag})))
    unrelated = execed(subprocess.Popen(SLEEP))
    try:
        assert runprocs._after_kill(tag, [], settle=0) == [late.pid]  # no time to settle: named, not yet killed
        killed = []
        assert runprocs._after_kill(tag, killed, settle=10) == [] and killed == [late.pid]
        assert late.wait(timeout=10) == -signal.SIGKILL and unrelated.poll() is None
    finally:
        for proc in (late, unrelated):
            proc.kill()
            proc.wait()


def test_stop_asks_again_a_host_whose_killed_processes_are_still_going_and_exits_0_once_they_are_gone(tmp_path, monkeypatch):
    """At 64 hosts on 2 busy cores, a host's SIGKILLed torchrun trees outlived the agent's settle, and `stop` said
    they remained (exit 1) though nothing was left a moment later. The controller asks that host again (each round
    kills again what is left of the run and waits for it) and reports remaining only what outlived every round."""
    from mnft.hosts.fleet import HostResult, Status
    from mnft.run import control, records
    from mnft.run.report import print_stop

    run_dir = str(tmp_path / "host-run")
    record = records.RunRecord(tmp_path, {"run_id": "R1", "state": "running",
                                          "hosts": {"h1": {"run_dir": run_dir, "state": "running"}, "h2": {"run_dir": run_dir, "state": "running"}}})
    replies = {  # what each host's agent answers, round after round
        "h1": [{"killed": [100], "remaining": []}],
        "h2": [{"killed": [200, 201], "remaining": [201, 202]}, {"killed": [201], "remaining": [202]}, {"killed": [], "remaining": [], "ended": True}],
    }
    asked: list[set[str]] = []

    def query(record, fleet, mode, *args, only=None):
        names = sorted(only) if only is not None else ["h1", "h2"]
        asked.append(set(names))
        return [HostResult(n, Status.OK, 0, json.dumps(replies[n].pop(0)) + "\n") for n in names]

    monkeypatch.setattr(control, "query", query)
    result = control.stop(record, fleet=None, grace=1)
    assert asked == [{"h1", "h2"}, {"h2"}, {"h2"}]  # only the host with processes still going is asked again
    assert result["h2"]["killed"] == [200, 201] and result["h2"]["remaining"] == [] and not result["h2"]["ended"]
    assert (result["h1"]["asked"], result["h2"]["asked"]) == (1, 3) and record.data["stop"]["h2"]["asked"] == 3
    assert print_stop(record, result, as_json=True) == 0
    assert record.data["state"] == "stopped" and record.data["hosts"]["h2"]["state"] == "stopped"

    replies["h2"] = [{"killed": [300], "remaining": [301]} for _ in range(control.STOP_ROUNDS)]  # one that never goes
    record.data["state"] = "running"
    asked.clear()
    replies["h1"] = [{"killed": [], "remaining": [], "ended": True}]
    result = control.stop(record, fleet=None, grace=1)
    assert len(asked) == control.STOP_ROUNDS and result["h2"]["remaining"] == [301]
    assert print_stop(record, result, as_json=True) == 1


def test_stop_marks_a_run_still_going_so_status_says_stopped_not_its_signals_exit_code(tmp_path, procs, capsys):
    """Issue 45: `mnft status` of a stopped detached run said `exited 1 … got signal: 15`. The agent's stop marks a run
    that has not ended before its first signal; the host's status then says `stopped`, whatever code the signal left."""
    from mnft.onhost import agent, queries

    tagged = group_leader({runfiles.TAG_VAR: "R1@h1"})
    procs.append(tagged)
    run_dir = ended_run_dir(tmp_path, "R1@h1", tagged.pid, runprocs.start_time(tagged.pid))
    (run_dir / "exit_code").unlink()
    assert agent.main(["stop", str(run_dir), "2"]) == 0
    assert tagged.pid in json.loads(capsys.readouterr().out.splitlines()[-1])["killed"]
    (run_dir / "exit_code").write_text("1\n")  # what the keeper records of torchrun's end by SIGTERM
    state = queries.status(str(run_dir))
    assert (state["state"], state["exit_code"], state["stopped_by"]) == ("stopped", 1, "mnft stop")


def test_stop_of_a_run_that_had_ended_by_itself_leaves_no_mark(tmp_path, procs, capsys):
    from mnft.onhost import agent, queries

    run_dir = ended_run_dir(tmp_path, "R1@h1", 999999, None)  # exit code recorded: it ended on its own
    assert agent.main(["stop", str(run_dir), "0.5"]) == 0
    assert not (run_dir / runfiles.STOPPED_BY).exists() and queries.status(str(run_dir))["state"] == "exited"
    (run_dir / "exit_code").unlink()  # its keeper killed before it recorded one: nothing of it alive, no mark either
    assert agent.main(["stop", str(run_dir), "0.5"]) == 0
    assert not (run_dir / runfiles.STOPPED_BY).exists() and queries.status(str(run_dir))["state"] == "killed"
