"""Issue 38 on a real simulated cluster: interactive sessions on leased GPUs (`mnft shell`), their lifetime, idle
holds, the usage log, notices.

One host h1 with 2 stand-in GPUs (tests/fakegpu.py), the login users alice and bob, each with a controller of their
own. A session's command, hold.py, registers on the GPU it was given (fakegpu.RANK_SNIPPET: CUDA_VISIBLE_DEVICES)
and waits; what is asserted is what the session saw, what `mnft lab` shows, what is left on the host, and what the
records say."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakegpu import RANK_SNIPPET

from mnft.onhost.watches import COLLISION_EVERY

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
HOLD = RANK_SNIPPET + '''
import time
time.sleep(600)
'''


@pytest.fixture(scope="module")
def lab(testbed, tmp_path_factory):
    work = tmp_path_factory.mktemp("sessions")
    with testbed.Cluster.create(1, work, outsider=False, gpus=2) as cluster:
        for name in ("alice", "bob"):
            cluster.add_user(name, password="not used", torch=True)
        home = cluster.hosts[0].root / "tmp" / "home-alice"
        (home / "mnft").mkdir(exist_ok=True)
        (home / "mnft" / "hold.py").write_text(HOLD)
        os.chown(home / "mnft", *_ids(home))
        os.chown(home / "mnft" / "hold.py", *_ids(home))
        yield cluster


def _ids(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid


class Person:
    def __init__(self, cluster, tmp_path: Path, user: str):
        self.cluster, self.user = cluster, user
        self.dir = tmp_path / f"ctl-{user}"
        self.dir.mkdir(exist_ok=True)
        self.inventory = str(cluster.write_inventory(self.dir / "lab.yaml", user=user, workdir=f"/tmp/home-{user}/mnft"))
        self.src = self.dir / "project"  # the user's project: a session opens in it, placed as train places a run's code
        self.src.mkdir(exist_ok=True)
        (self.src / "hold.py").write_text(HOLD)

    def env(self) -> dict:
        home = self.dir / "home"
        home.mkdir(exist_ok=True)
        return dict(os.environ, HOME=str(home), MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(self.dir / "runs"), PYTHONUNBUFFERED="1",
                    TERM="xterm")

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "invoke", "-r", str(REPO), *args]

    def mnft(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=REPO, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False)

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), cwd=REPO, env=self.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def lab(self) -> list[dict]:
        done = self.mnft("lab", "--hosts", self.inventory, "--json")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(done.stdout)["devices"]

    def record(self, session: str) -> dict:
        return json.loads((self.dir / "runs" / session / "run.json").read_text())


def held_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["state"] == "held"]


def until(predicate, timeout: float = 90, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def session_id(proc: subprocess.Popen) -> tuple[str, str]:
    """The session id and the GPU from the controller's first line (read as it comes)."""
    line = proc.stdout.readline()
    while line and not line.startswith("session "):
        line = proc.stdout.readline()
    assert line.startswith("session "), line
    words = line.split()
    return words[1], words[5]


def tagged(cluster, host, session: str) -> list[int]:
    """Processes on the host whose environment carries the session's tag (what a session's end must leave none of)."""
    found = []
    for pid, _ in cluster.processes(host):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"MNFT_RUN_ID={session}".encode() in env:
            found.append(pid)
    return found


def test_a_shell_in_a_real_terminal_sees_its_gpu_ctrl_c_interrupts_a_remote_sleep_lab_shows_it_and_exit_frees_it(lab, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    alice, bob = Person(lab, tmp_path, "alice"), Person(lab, tmp_path, "bob")
    argv = alice.argv("shell", "--hosts", alice.inventory, "--gpus", "1")
    child = pexpect.spawn(argv[0], argv[1:], env=dict(alice.env(), SHELL="/bin/bash"), cwd=str(REPO), timeout=90, encoding="utf-8",
                          dimensions=(30, 100))
    try:
        child.expect(r"session (\S+) on h1: GPU (\d)")
        session, gpu = child.match.group(1), child.match.group(2)
        child.expect(r"[$#] ")
        child.sendline("echo CVD=$CUDA_VISIBLE_DEVICES $(pwd) $(stty size)")
        child.expect(r"CVD=(\S*) (\S+) (\d+) (\d+)\r\n")
        assert child.match.group(1) == gpu
        assert child.match.group(2) == f"/tmp/home-alice/mnft/outputs/{session}"  # alice's code as of now, placed as train places a run's
        assert (child.match.group(3), child.match.group(4)) == ("30", "100")  # this terminal's window size
        child.expect(r"[$#] ")
        child.sendline("test -f pyproject.toml && echo code-is-here; echo PY=$(command -v python3)")
        child.expect("code-is-here")
        child.expect(r"PY=(\S+)\r\n")  # the environment a run gets, first on PATH after the login profile
        assert os.path.dirname(child.match.group(1)) == os.path.dirname(lab.python), child.match.group(1)
        rows = held_rows(bob.lab())
        assert [(r["device"], r["user"], r["run"], r["command"]) for r in rows] == [(gpu, "alice", session, "shell")]
        child.expect(r"[$#] ")
        child.sendline("sleep 300")
        child.expect("sleep 300")
        time.sleep(1)
        child.sendintr()  # Ctrl-C reaches the remote sleep, not the session: the shell prompts again
        child.expect(r"[$#] ")
        child.sendline("echo after-sleep-$?")
        child.expect(r"after-sleep-130")
        child.expect(r"[$#] ")
        child.sendline("exit 3")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 3
    assert held_rows(bob.lab()) == []
    assert tagged(lab, lab.hosts[0], session) == []
    record = alice.record(session)
    assert (record["kind"], record["state"], record["exit_code"]) == ("session", "ended", 3)


def test_a_sessions_command_sees_its_gpu_and_killing_the_controller_frees_it_within_the_dead_man_and_leaves_nothing(lab, tmp_path):
    alice, bob = Person(lab, tmp_path, "alice"), Person(lab, tmp_path, "bob")
    proc = alice.start("shell", "--hosts", alice.inventory, "--gpus", "1", "--src", str(alice.src), "--", "python3", "hold.py")
    try:
        session, gpu = session_id(proc)
        users = until(lambda: lab.gpu_users(lab.hosts[0]).get(int(gpu)))
        assert users, "the session's command never used its GPU"
        assert [(r["device"], r["run"]) for r in held_rows(bob.lab())] == [(gpu, session)]
        os.killpg(proc.pid, signal.SIGKILL)  # the controller and its SSH client, gone at once
        proc.wait()
        assert until(lambda: not held_rows(bob.lab()), timeout=60), "the GPU was not freed"
        assert until(lambda: not tagged(lab, lab.hosts[0], session), timeout=30)
        assert not lab.gpu_users(lab.hosts[0]).get(int(gpu))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_process_of_another_user_on_a_sessions_gpu_is_named_by_mnft_lab_and_said_once_in_the_sessions_output(lab, tmp_path):
    alice, bob = Person(lab, tmp_path, "alice"), Person(lab, tmp_path, "bob")
    proc = alice.start("shell", "--hosts", alice.inventory, "--gpus", "1", "--src", str(alice.src), "--", "python3", "hold.py")
    by_hand = None
    try:
        session, gpu = session_id(proc)
        assert until(lambda: lab.gpu_users(lab.hosts[0]).get(int(gpu))), "the session's command never used its GPU"
        assert [r.get("also") for r in held_rows(bob.lab())] == [None]  # its own command is no collision
        # bob ignores CUDA_VISIBLE_DEVICES: a process of his on alice's GPU (setpriv execs: its pid is this Popen's)
        by_hand = lab.popen(lab.hosts[0], ["setpriv", "--reuid=bob", "--regid=bob", "--init-groups", "nvidia-smi", "--fake-use", gpu,
                                           "--", "sleep", "120"], start_new_session=True)
        also = f"also used by bob pid {by_hand.pid}"
        rows = until(lambda: [r for r in held_rows(bob.lab()) if r.get("also")])
        assert [(r["device"], r["user"], r["run"], r["also"]) for r in rows] == [(gpu, "alice", session, also)]
        shown = alice.mnft("lab", "--hosts", alice.inventory)
        assert f"h1 GPU {gpu}: held by alice's session {session}; {also}" in " ".join(shown.stdout.split()), shown.stdout
        time.sleep(2 * COLLISION_EVERY)  # two more of the keeper's looks at the same process: it is said once
        done = alice.mnft("stop", session)
        assert done.returncode == 0, done.stdout + done.stderr
        out, _ = proc.communicate(timeout=60)
        assert out.count(f"GPU {gpu} of this session is {also}") == 1, out
    finally:
        if by_hand is not None:
            by_hand.kill()
            by_hand.wait()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_time_ends_a_session_with_its_reason_recorded_and_stop_ends_another(lab, tmp_path):
    alice = Person(lab, tmp_path, "alice")
    timed = alice.start("shell", "--hosts", alice.inventory, "--gpus", "1", "--time", "3s", "--", "sleep", "300")
    session, _ = session_id(timed)
    out, _ = timed.communicate(timeout=90)
    record = alice.record(session)
    assert record["state"] == "timed-out", out
    assert "--time 3s" in record["reason"] and "time limit" in out
    assert tagged(lab, lab.hosts[0], session) == []

    stopped = alice.start("shell", "--hosts", alice.inventory, "--gpus", "1", "--", "sleep", "300")
    other, _ = session_id(stopped)
    done = alice.mnft("stop", other)
    assert done.returncode == 0, done.stdout + done.stderr
    stopped.communicate(timeout=60)
    assert alice.record(other)["state"] == "stopped"
    assert tagged(lab, lab.hosts[0], other) == []


def test_idle_stop_ends_a_session_whose_gpu_computes_nothing_with_the_reason_and_lab_shows_it_idle_but_not_a_busy_one(lab, tmp_path):
    import fakegpu

    alice, bob = Person(lab, tmp_path, "alice"), Person(lab, tmp_path, "bob")
    state = str(lab._fake_gpu_state(lab.hosts[0]))
    for index in (0, 1):
        fakegpu.set_utilization(state, index, 0)
    try:
        idle = alice.start("shell", "--hosts", alice.inventory, "--gpus", "1", "--idle-stop", "8s", "--src", str(alice.src), "--", "python3", "hold.py")
        session, gpu = session_id(idle)
        shown = until(lambda: [r for r in held_rows(bob.lab()) if (r.get("detail") or "").startswith("idle ")], timeout=60)
        assert [(r["device"], r["run"]) for r in shown] == [(gpu, session)]
        out, _ = idle.communicate(timeout=90)
        record = alice.record(session)
        assert record["state"] == "idle-stopped", out
        assert "--idle-stop 8s" in record["reason"] and "idle" in out
        assert tagged(lab, lab.hosts[0], session) == []

        for index in (0, 1):
            fakegpu.set_utilization(state, index, 80)
        busy = alice.start("shell", "--hosts", alice.inventory, "--gpus", "1", "--idle-stop", "8s", "--time", "20s", "--src", str(alice.src), "--", "python3", "hold.py")
        other, _ = session_id(busy)
        busy.communicate(timeout=90)
        assert alice.record(other)["state"] == "timed-out"  # 20 s at 80%: never idle, ended by its time limit only
    finally:
        for index in (0, 1):
            fakegpu.set_utilization(state, index, None)


def test_usage_counts_exactly_the_gpu_time_a_session_held_for_its_user_and_another_user_cannot_erase_it(lab, tmp_path):
    bob, alice = Person(lab, tmp_path, "bob"), Person(lab, tmp_path, "alice")

    def usage() -> dict:
        done = alice.mnft("lab", "--hosts", alice.inventory, "--usage", "--since", "1h", "--json")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(done.stdout)

    assert "bob" not in [u["user"] for u in usage()["users"]]  # bob has held no GPU yet
    began = time.time()
    proc = bob.start("shell", "--hosts", bob.inventory, "--gpus", "2", "--time", "2s", "--", "sleep", "300")
    session, _ = session_id(proc)
    proc.communicate(timeout=90)
    wall = time.time() - began
    record = bob.record(session)
    held = record["ended"] - record["started"]
    mine = [u for u in usage()["users"] if u["user"] == "bob"]
    assert len(mine) == 1 and mine[0]["leases"] == 1
    assert 2 * held <= mine[0]["gpu_seconds"] <= 2 * wall  # 2 GPUs, from before the session started to after it ended

    # alice cannot erase bob's lines: his log is his (0644 in the sticky lease directory)
    erase = "import glob, os; p = [f for f in glob.glob('/run/lock/mnft-usage-*.jsonl') + glob.glob('/tmp/mnft-usage-*.jsonl') if os.stat(f).st_uid != os.getuid()][0]\n" \
            "for how in (lambda: open(p, 'w'), lambda: os.unlink(p), lambda: os.rename(p, p + '.x')):\n" \
            "    try:\n        how(); print('erased')\n    except OSError as exc:\n        print(exc.errno)\n"
    done = subprocess.run(lab.ssh_argv(lab.hosts[0], ["python3", "-c", erase], user="alice"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "erased" not in done.stdout and done.stdout.split() == ["13", "1", "1"], done.stdout + done.stderr
    assert [u["gpu_seconds"] for u in usage()["users"] if u["user"] == "bob"] == [mine[0]["gpu_seconds"]]


def test_a_train_run_is_ended_by_the_labs_idle_stop_which_a_users_longer_idle_stop_cannot_raise(lab, tmp_path):
    import fakegpu

    alice = Person(lab, tmp_path, "alice")
    host = lab.hosts[0]
    state = str(lab._fake_gpu_state(host))
    rules = [d / "mnft-lab.yaml" for d in (host.root / "run" / "lock", host.root / "tmp") if d.is_dir()]  # the lease directory
    for path in rules:
        path.write_text("idle_stop: 8s\n")  # the admin's (root's, 0644)
        path.chmod(0o644)
    for index in (0, 1):
        fakegpu.set_utilization(state, index, 0)
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "hold.py").write_text(HOLD)
        done = alice.mnft("train", "--hosts", alice.inventory, "--gpus", "1", "--src", str(src), "--idle-stop", "1h", "--", "hold.py", timeout=180)
        assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
        run = next(p for p in (alice.dir / "runs").iterdir() if (p / "run.json").is_file())
        record = json.loads((run / "run.json").read_text())
        assert record["state"] == "idle-stopped", done.stdout[-3000:]
        assert record["reason"].startswith("h1: its GPUs were idle for ") and "(the lab's idle_stop 8s, " in record["reason"]
        assert "--idle-stop 1h00m is more than this host allows" in done.stdout  # said in the run's output, once
        assert f"run {record['run_id']} idle-stopped: h1: its GPUs were idle" in done.stdout
        assert held_rows(alice.lab()) == [] and tagged(lab, host, record["run_id"]) == []
    finally:
        for path in rules:
            path.unlink()
        for index in (0, 1):
            fakegpu.set_utilization(state, index, None)
