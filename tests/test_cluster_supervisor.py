"""Issue 41 on the simulated cluster: a detached run's supervisor lives on the lab, as a member who is not root.

Three hosts h1..h3 with 2 stand-in GPUs each; bob and alice log in beside root. bob made his mesh once (`mnft setup
--only mesh` as himself): his supervisor on the master reaches the other hosts with it. Each test kills bob's
controller (every mnft process of his on this machine, kill -9) once the run is handed over: what happens next
happens on the lab alone. What is asserted is what the ranks did (their output), the run's record as bob's
controller brings it back afterwards, and what is left on the hosts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fakegpu import HOLD_UNTIL_TOLD
from runhelpers import Controller

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

FLAKY = '''\
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
attempt, rank = int(os.environ["MNFT_ATTEMPT"]), dist.get_rank()
progress = os.path.join(os.environ["MNFT_OUTPUT_DIR"], f"progress-{rank}")
os.makedirs(os.path.dirname(progress), exist_ok=True)
start = int(open(progress).read()) if os.path.exists(progress) else 0
print(f"attempt {attempt} rank {rank} from step {start + 1}", flush=True)
for step in range(start + 1, int(os.environ.get("STEPS", "8")) + 1):
    if rank == 0:
        print(json.dumps({"step": step, "loss": 1.0 / step}), flush=True)
    dist.all_reduce(torch.ones(1))
    if step % 2 == 0:
        with open(progress, "w") as fh:
            fh.write(str(step))
    time.sleep(float(os.environ.get("STEP_S", "0.1")))
dist.barrier()
sys.stdout.flush()
os._exit(0)
'''

JOB = '''\
name: steps
script: steps.py
resume:
  layout: none
metrics:
  format: jsonl
'''

HOLD = HOLD_UNTIL_TOLD


@pytest.fixture(scope="module")
def lab(testbed, tmp_path_factory):
    work = tmp_path_factory.mktemp("supervised-lab")
    with testbed.Cluster.create(3, work, outsider=False, gpus=2) as cluster:
        for name in ("bob", "alice"):
            cluster.add_user(name, password="not used", torch=True)
        yield cluster


class Member(Controller):
    def __init__(self, cluster, tmp_path: Path, user: str, hosts=None, **inventory) -> None:
        super().__init__(tmp_path / f"ctl-{user}")
        self.cluster, self.user = cluster, user
        self.hosts = list(hosts or cluster.hosts)
        self.workdir = f"/tmp/home-{user}/mnft"
        self.inventory = str(cluster.write_inventory(self.dir / "lab.yaml", hosts=self.hosts, user=user, workdir=self.workdir, **inventory))
        self.src = self.dir / "src"
        self.src.mkdir(exist_ok=True)
        (self.src / "steps.py").write_text(FLAKY)
        (self.src / "job.yaml").write_text(JOB)
        (self.src / "hold.py").write_text(HOLD)

    def ok(self, *args: str, timeout: float = 240) -> str:
        done = self.mnft(*args, timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    def mesh(self) -> None:
        """`mnft setup` of the mesh alone, as this member, over every host of the lab (the login node h3 too)."""
        book = self.dir / "mesh.yaml"
        book.write_text("- name: mesh\n  mesh: {}\n")
        every = self.cluster.write_inventory(self.dir / "all.yaml", user=self.user, workdir=self.workdir)
        self.ok("setup", "--hosts", str(every), "--playbook", str(book))

    def detach(self, *args: str) -> str:
        """`mnft train --detach …`, then every mnft process of this controller killed (-9): the run id."""
        out = self.ok("train", "--hosts", self.inventory, "--src", str(self.src), "--detach", *args)
        [run_id] = re.findall(r"^run (\S+) handed to its supervisor", out, re.M)
        self.kill_controller()
        return run_id

    def kill_controller(self) -> None:
        for pid in self.my_pids():
            os.kill(pid, signal.SIGKILL)
        assert not self.my_pids()

    def my_pids(self) -> list[int]:
        """This controller's mnft processes on this machine (its MNFT_HOME in their environment)."""
        mine = []
        marker = f"MNFT_HOME={self.dir / 'home' / '.mnft'}".encode()
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                        mine.append(int(entry))
                except OSError:
                    pass
        return mine

    def record(self, run_id: str) -> dict:
        self.mnft("status", run_id, "--json")  # brings the supervisor's record here
        return json.loads((self.dir / "runs" / run_id / "run.json").read_text())

    def wait(self, run_id: str, timeout: float = 300) -> dict:
        try:
            done = self.mnft("wait", run_id, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"run {run_id} did not end; its supervisor said:\n{self.console(run_id)[-6000:]}") from None
        record = json.loads((self.dir / "runs" / run_id / "run.json").read_text())
        assert record["state"] in ("succeeded", "failed", "stopped", "resumable", "supervisor-lost", "dependency-failed"), (done.stdout, done.stderr)
        return record

    def console(self, run_id: str) -> str:
        """The supervisor's console, on whichever host it ran."""
        for host in self.cluster.hosts:
            path = host.root / "tmp" / f"home-{self.user}" / ".mnft" / "supervised" / run_id / "console.log"
            if path.is_file():
                return path.read_text()
        return ""

    def uid(self) -> int:
        return int(self.cluster.run(self.hosts[0], ["id", "-u", self.user]).stdout)


def mnft_processes(cluster, hosts, uid: int) -> dict[str, list[str]]:
    """The processes of that user on each host that are mnft's (its supervisor, agents, keepers, holds)."""
    out = {}
    for host in hosts:
        found = []
        for pid, cmd in cluster.processes(host):
            try:
                owner = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            if owner == uid and ("mnft" in cmd or "torch.distributed.run" in cmd):
                found.append(cmd[:160])
        if found:
            out[host.name] = found
    return out


def wait_gone(cluster, hosts, uid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (left := mnft_processes(cluster, hosts, uid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left


def reached(cluster, host, run_id: str, step: int, user: str = "bob", timeout: float = 180) -> None:
    """Until rank 0's output on the host shows that step (its jsonl record)."""
    deadline = time.monotonic() + timeout
    while f'{{"step": {step}' not in host_log(cluster, host, user, run_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert f'{{"step": {step}' in host_log(cluster, host, user, run_id), host_log(cluster, host, user, run_id)[-2000:]


def host_log(cluster, host, user: str, run_id: str) -> str:
    path = host.root / "tmp" / f"home-{user}" / "mnft" / "runs" / run_id / host.name / "output.log"
    return path.read_text() if path.is_file() else ""


@pytest.fixture(scope="module")
def bob(lab, tmp_path_factory) -> Member:
    member = Member(lab, tmp_path_factory.mktemp("bob"), "bob", hosts=lab.hosts[:2])
    member.mesh()
    return member


def test_a_detached_run_whose_ranks_are_killed_restarts_from_its_checkpoint_with_its_controller_gone(lab, bob):
    run_id = bob.detach("--job", str(bob.src / "job.yaml"), "--max-restarts", "1", "--backoff", "0.5", "--wait-for-lost", "1",
                        "--env", "STEPS=30", "--env", "STEP_S=0.3")
    h1, h2 = lab.hosts[:2]
    reached(lab, h1, run_id, 6)
    lab.run(h2, ["pkill", "-KILL", "-u", "bob", "-f", "steps.py"], check=False)  # the fault: h2's ranks killed
    record = bob.wait(run_id)
    assert record["state"] == "succeeded", record.get("reason")
    assert [a["number"] for a in record["attempts"]] == [1, 2]
    assert record["attempts"][1]["resumed"] is True
    second = lab.hosts[0].root / "tmp" / "home-bob" / "mnft" / "runs" / f"{run_id}-a2" / "h1" / "output.log"
    resumed_from = int(re.search(r"attempt 2 rank 0 from step (\d+)", second.read_text()).group(1))
    assert resumed_from >= 5  # from its last saved step, not from 1
    assert record["supervisor"]["host"] == "h1" and record["supervisor"]["alive"] is False
    wait_gone(lab, lab.hosts[:2], bob.uid())  # nothing of mnft runs on any host once the run has ended
    assert "restart" in (lab.hosts[0].root / "tmp" / "home-bob" / ".mnft" / "supervised" / run_id / "console.log").read_text()


def end(cluster, tag: str, hosts) -> None:
    for host in hosts:
        (host.root / "tmp" / f"mnft-test-end-{tag}").write_text("")


def test_a_run_waiting_in_line_behind_another_users_keeps_its_place_with_its_controller_gone_and_starts_when_the_gpus_free(lab, bob, tmp_path):
    alice = Member(lab, tmp_path, "alice", hosts=lab.hosts[:2])
    hers = alice.start("train", "--hosts", alice.inventory, "--src", str(alice.src), "--gpus", "2", "--", "hold.py", "alice-w")
    deadline = time.monotonic() + 120
    while "alice" not in json.dumps(json.loads(bob.ok("lab", "--hosts", bob.inventory, "--json"))["devices"]) and time.monotonic() < deadline:
        time.sleep(1)
    run_id = bob.detach("--gpus", "2", "--wait", "--notify", 'echo "$MNFT_NOTIFY_EVENT $MNFT_NOTIFY_OUTCOME" >> /tmp/notified-bob-w',
                        "--", "hold.py", "bob-w")
    time.sleep(3)
    record = bob.record(run_id)
    assert record["state"] == "waiting" and record["supervisor"]["alive"] is True, record
    status = bob.mnft("status", run_id)
    assert status.returncode == 0 and "waiting" in status.stdout and "supervisor: h1 pid" in status.stdout and ": alive" in status.stdout
    end(lab, "alice-w", lab.hosts[:2])
    assert hers.wait(timeout=120) == 0
    deadline = time.monotonic() + 120
    while "mnft-test: rank 0" not in host_log(lab, lab.hosts[0], "bob", run_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "mnft-test: rank 0" in host_log(lab, lab.hosts[0], "bob", run_id)
    end(lab, "bob-w", lab.hosts[:2])
    record = bob.wait(run_id)
    assert record["state"] == "succeeded" and record.get("waited_s", 0) > 0, record.get("reason")
    told = (lab.hosts[0].root / "tmp" / "notified-bob-w").read_text().splitlines()  # on the supervisor's host
    assert [line.split()[0] for line in told] == ["started", "ended"] and told[1].split()[1] == "succeeded"
    wait_gone(lab, lab.hosts[:2], bob.uid())


def test_stop_of_a_run_waiting_in_line_ends_its_supervisor_and_gives_up_its_place(lab, bob, tmp_path):
    alice = Member(lab, tmp_path, "alice", hosts=lab.hosts[:2])
    hers = alice.start("train", "--hosts", alice.inventory, "--src", str(alice.src), "--gpus", "2", "--", "hold.py", "alice-s")
    try:
        deadline = time.monotonic() + 120
        while "alice" not in json.dumps(json.loads(bob.ok("lab", "--hosts", bob.inventory, "--json"))["devices"]) and time.monotonic() < deadline:
            time.sleep(1)
        run_id = bob.detach("--gpus", "2", "--wait", "--", "hold.py", "bob-s")
        assert bob.record(run_id)["state"] == "waiting"
        stopped = bob.mnft("stop", run_id)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert f"run {run_id}: stopped" in stopped.stdout
        record = json.loads((bob.dir / "runs" / run_id / "run.json").read_text())
        assert record["state"] == "stopped" and record["supervisor"]["alive"] is False
        assert not [r for r in json.loads(bob.ok("lab", "--hosts", bob.inventory, "--json"))["devices"] if r["run"] == run_id]  # out of line
    finally:
        end(lab, "alice-s", lab.hosts[:2])
    assert hers.wait(timeout=120) == 0
    wait_gone(lab, lab.hosts[:2], bob.uid())


def test_a_detached_run_whose_hosts_link_is_cut_is_torn_down_within_the_attached_bound(lab, bob):
    run_id = bob.detach("--job", str(bob.src / "job.yaml"), "--env", "STEPS=2000", "--env", "STEP_S=0.2")
    h1, h2 = lab.hosts[:2]
    reached(lab, h1, run_id, 4)
    lab.link_down(h2)
    cut_at = time.monotonic()
    try:
        uid = bob.uid()
        while time.monotonic() < cut_at + 30 and any("steps.py" in c for cmds in mnft_processes(lab, [h1, h2], uid).values() for c in cmds):
            time.sleep(0.5)
        left = {name: [c for c in cmds if "steps.py" in c] for name, cmds in mnft_processes(lab, [h1, h2], uid).items()}
        assert not any(left.values()), left  # both hosts' ranks gone within 30 s of the cut, as for an attached run
    finally:
        lab.link_up(h2)
    record = bob.wait(run_id)
    assert record["state"] == "failed" and record["failed_host"] == "h2", record.get("reason")
    wait_gone(lab, lab.hosts[:2], bob.uid())


def test_attach_follows_live_its_ctrl_c_leaves_the_run_and_no_other_user_can_signal_the_supervisor(lab, bob):
    run_id = bob.detach("--", "hold.py", "bob-a")
    follower = bob.start("attach", run_id)
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = follower.stdout.readline()
        seen.append(line)
        if "mnft-test: rank 0" in line:
            break
    assert any("mnft-test: rank 0" in line for line in seen), "".join(seen[-30:])
    follower.send_signal(signal.SIGINT)
    out, _ = follower.communicate(timeout=30)
    assert follower.returncode == 0 and "stopped following" in out and "goes on" in out
    record = bob.record(run_id)
    assert record["state"] == "running" and record["supervisor"]["alive"] is True
    pid = record["supervisor"]["pid"]
    h1 = lab.hosts[0]
    rows = [r for r in json.loads(bob.ok("lab", "--hosts", bob.inventory, "--json"))["devices"] if r["run"] == run_id]
    assert rows and all(r["supervisor"] and r["supervisor"].endswith(f" pid {pid}") for r in rows)  # lab names its supervisor
    refused = lab.run(h1, ["runuser", "-u", "alice", "--", "kill", "-TERM", str(pid)], check=False)
    assert refused.returncode != 0 and "not permitted" in refused.stderr
    assert bob.record(run_id)["supervisor"]["alive"] is True
    stopped = bob.mnft("stop", run_id)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    record = bob.wait(run_id)
    assert record["state"] == "stopped" and "mnft stop" in record["reason"]
    wait_gone(lab, lab.hosts[:2], bob.uid())


def test_check_says_where_detached_runs_are_supervised_and_the_fix_for_a_member_without_a_mesh(lab, bob, tmp_path):
    checked = json.loads(bob.mnft("check", "--hosts", bob.inventory, "--json").stdout)
    assert checked["supervision"]["ok"] is True and checked["supervision"]["host"] == "h1"
    assert checked["supervision"]["reaches"] == ["h1", "h2"]
    alice = Member(lab, tmp_path, "alice", hosts=lab.hosts[:2])
    hers = alice.mnft("check", "--hosts", alice.inventory)
    assert "detached runs: no supervisor can run on this lab: h1 has no mesh key" in hers.stdout
    assert "mnft setup --only mesh" in hers.stdout
    detached = alice.mnft("train", "--hosts", alice.inventory, "--src", str(alice.src), "--detach", "--wait", "--", "hold.py", "x")
    assert detached.returncode == 1 and "--detach with --wait needs a supervisor on the lab" in detached.stderr


def test_a_supervisor_on_a_login_node_that_does_not_train_restarts_the_run_when_the_masters_ranks_die(lab, bob, tmp_path):
    h1, h2, h3 = lab.hosts
    login = Member(lab, tmp_path, "bob", hosts=[h1, h2], supervisor={"name": "login", "address": h3.address, "user": "bob"})
    run_id = login.detach("--job", str(login.src / "job.yaml"), "--max-restarts", "1", "--backoff", "0.5", "--wait-for-lost", "1",
                          "--env", "STEPS=24", "--env", "STEP_S=0.3")
    reached(lab, h1, run_id, 4)
    assert mnft_processes(lab, [h3], bob.uid())  # the supervisor, on the login node
    lab.run(h1, ["pkill", "-KILL", "-u", "bob", "-f", "steps.py"], check=False)  # the master's ranks
    record = login.wait(run_id)
    assert record["state"] == "succeeded" and len(record["attempts"]) == 2, record.get("reason")
    assert record["supervisor"]["host"] == "login" and record["hosts"].keys() == {"h1", "h2"}
    wait_gone(lab, lab.hosts, bob.uid())


def test_a_supervisor_killed_leaves_no_rank_behind_and_its_run_is_supervisor_lost_with_the_command_that_resumes_it(lab, bob):
    run_id = bob.detach("--job", str(bob.src / "job.yaml"), "--env", "STEPS=2000", "--env", "STEP_S=0.2")
    h1, h2 = lab.hosts[:2]
    reached(lab, h1, run_id, 4)
    pid = bob.record(run_id)["supervisor"]["pid"]
    os.kill(pid, signal.SIGKILL)  # as its host's OOM killer, or the host itself gone
    killed_at = time.monotonic()
    uid = bob.uid()
    while time.monotonic() < killed_at + 60 and any("steps.py" in c for cmds in mnft_processes(lab, [h1, h2], uid).values() for c in cmds):
        time.sleep(0.5)
    left = {name: [c for c in cmds if "steps.py" in c] for name, cmds in mnft_processes(lab, [h1, h2], uid).items()}
    assert not any(left.values()), left  # the hosts' dead-man: no supervisor heard, the ranks ended
    status = bob.mnft("status", run_id)
    assert status.returncode != 0
    assert f"run {run_id}: supervisor-lost" in status.stdout and f"--resume-run {run_id}" in status.stdout, status.stdout
    assert ": gone" in status.stdout
    wait_gone(lab, lab.hosts[:2], uid)
    # the command it names continues the run from its last saved step, supervised again, as bob gave it (its code, env)
    resumed = bob.ok("train", "--resume-run", run_id, "--detach", "--env", "STEPS=12")
    [again] = re.findall(r"^run (\S+) handed to its supervisor", resumed, re.M)
    assert f"resuming run {run_id}" in resumed and f"--src {bob.src}" in resumed
    record = bob.wait(again)
    assert record["state"] == "succeeded" and record["resumed_from"] == run_id, record.get("reason")
    assert int(re.search(r"attempt 1 rank 0 from step (\d+)", host_log(lab, h1, "bob", again)).group(1)) >= 5  # not from 1
    wait_gone(lab, lab.hosts[:2], uid)


def test_uninstall_removes_the_supervisors_bundle_and_keeps_the_detached_runs_records(lab, bob):
    h1 = lab.hosts[0]
    mnft_dir = h1.root / "tmp" / "home-bob" / ".mnft"
    assert (mnft_dir / "supervisor").is_dir() and any((mnft_dir / "supervised").iterdir())
    done = bob.mnft("uninstall", "--hosts", bob.inventory)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (mnft_dir / "supervisor").exists()
    assert any((mnft_dir / "supervised").iterdir())  # what runs wrote: kept without --include-outputs
