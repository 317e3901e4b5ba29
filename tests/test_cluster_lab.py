"""Issue 29 on a real simulated cluster: a lab shared by many people, where GPUs, not hosts, are what a run takes.

Four hosts h1..h4, each with 4 stand-in GPUs (tests/fakegpu.py answers as nvidia-smi: GPUs 0-1 and 2-3 are
NVLink pairs, the rest SYS; a process "uses" a GPU while it is registered on it), and the login users alice, bob
and carol beside root, each with a controller of their own (their own runs/ and home) and a workdir in their own
home. The lab's script (hold.py) is every rank: it registers on the GPU torchrun gave it, prints the
CUDA_VISIBLE_DEVICES it sees, and ends when the test says so (a file on the host), so the tests decide when each
run ends. What is asserted is what the ranks saw, what the users are told, and what `mnft lab` shows."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from fakegpu import HOLD_UNTIL_TOLD, RANK_SNIPPET
from runhelpers import Controller, wait_for_output
from wheelmaker import make_wheel, write_lock

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
USERS = ("alice", "bob", "carol")
HOLD = HOLD_UNTIL_TOLD


@pytest.fixture(scope="module")
def lab(testbed, tmp_path_factory):
    """h1..h4 with 4 GPUs each; alice, bob and carol log in beside root and can run the Python with torch."""
    work = tmp_path_factory.mktemp("shared-lab")
    with testbed.Cluster.create(4, work, outsider=False, gpus=4) as cluster:
        for name in USERS:
            cluster.add_user(name, password="not used", torch=True)
        yield cluster


@pytest.fixture
def src(tmp_path: Path) -> Path:
    tree = tmp_path / "lab-src"
    tree.mkdir()
    (tree / "hold.py").write_text(HOLD)
    return tree


class Person(Controller):
    """One user of the lab at their own controller: an inventory as them, their own runs/ and home."""

    def __init__(self, cluster, tmp_path: Path, user: str, hosts):
        super().__init__(tmp_path / f"ctl-{user}")
        self.cluster, self.user = cluster, user
        self.workdir = "/root/mnft-lab" if user == "root" else f"/tmp/home-{user}/mnft"
        self.inventory = str(cluster.write_inventory(self.dir / "lab.yaml", hosts=list(hosts), user=user, workdir=self.workdir))

    def train(self, src: Path, tag: str, *options: str) -> subprocess.Popen:
        return self.start("train", "--hosts", self.inventory, "--src", str(src), *options, "--", "hold.py", tag)

    def detach(self, src: Path, tag: str, *options: str) -> str:
        """A detached run (its keepers hold its GPUs; no controller does): its run id."""
        started = self.mnft("train", "--hosts", self.inventory, "--src", str(src), *options, "--detach", "--", "hold.py", tag)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        return started.stdout.strip().splitlines()[-1]

    def lab(self) -> list[dict]:
        done = self.mnft("lab", "--hosts", self.inventory, "--json")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(done.stdout)["devices"]

    def run_ids(self) -> list[str]:
        runs = self.dir / "runs"
        return sorted(p.name for p in runs.glob("[!.]*")) if runs.is_dir() else []

    def seen(self, run_id: str, host) -> set[str]:
        """The CUDA_VISIBLE_DEVICES each rank of the run printed on a host (its output log, every rank)."""
        home = host.home if self.user == "root" else host.root / "tmp" / f"home-{self.user}"
        log = home / os.path.relpath(self.workdir, "/root" if self.user == "root" else f"/tmp/home-{self.user}") / "runs" / run_id / host.name / "output.log"
        return set(re.findall(r"mnft-test: rank \d+ local \d+ sees CUDA_VISIBLE_DEVICES=([\d,]+)", log.read_text()))


def end(cluster, tag: str, hosts) -> None:
    """Tell the ranks of the run tagged so on these hosts to finish."""
    for host in hosts:
        (host.root / "tmp" / f"mnft-test-end-{tag}").write_text("")


def held(rows: list[dict], host: str) -> dict[str, tuple]:
    return {r["device"]: (r["state"], r["user"], r["run"]) for r in rows if r["host"] == host}


def wait_held(person: Person, host: str, count: int, timeout: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = person.lab()
        if sum(1 for state, _, _ in held(rows, host).values() if state == "held") >= count or time.monotonic() > deadline:
            return rows
        time.sleep(1)


def finished(proc: subprocess.Popen, timeout: float = 180) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def test_two_users_share_two_hosts_a_third_is_refused_then_waits_in_line_and_the_waiters_start_in_order(lab, tmp_path, src):
    h1, h2 = lab.hosts[:2]
    alice, bob, carol, root = (Person(lab, tmp_path, u, (h1, h2)) for u in (*USERS, "root"))
    first = alice.train(src, "a", "--gpus", "2")
    second = bob.train(src, "b", "--gpus", "2")
    procs = [first, second]
    try:
        rows = wait_held(carol, "h2", 4)
        for host in ("h1", "h2"):
            owners = held(rows, host)
            assert sorted(owners) == ["0", "1", "2", "3"] and {s for s, _, _ in owners.values()} == {"held"}, rows
            pairs = {frozenset(d for d, (_, user, _) in owners.items() if user == u) for u in ("alice", "bob")}
            assert pairs == {frozenset({"0", "1"}), frozenset({"2", "3"})}  # each an NVLink pair, told by the kernel's lock holder
        a_run, b_run = alice.run_ids()[-1], bob.run_ids()[-1]

        refused = carol.mnft("train", "--hosts", carol.inventory, "--src", str(src), "--gpus", "2", "--", "hold.py", "c")
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stdout[-2000:] + refused.stderr[-2000:]
        line = next(ln for ln in refused.stderr.splitlines() if "asked" in ln)
        assert line.startswith("mnft: h1: 2 GPU(s) asked, 0 of 4 free: GPU ") and f"train run {a_run} by alice (" in line and f"train run {b_run} by bob (" in line
        assert line.endswith("nothing was changed on any host")
        assert not (h1.root / "tmp" / "home-carol" / "mnft").exists()  # nothing synced

        not_yours = carol.mnft("stop", a_run, "--hosts", carol.inventory)
        assert not_yours.returncode == 1 and f"run {a_run} is not yours (" in not_yours.stderr and "only alice or root may stop it" in not_yours.stderr
        status = carol.mnft("status", a_run, "--hosts", carol.inventory)
        assert status.returncode == 0 and "alice" in status.stdout and "GPU" in status.stdout, status.stdout + status.stderr

        third = carol.train(src, "c", "--gpus", "2", "--wait")
        procs.append(third)
        wait_for_output(third, r"h1: waiting in line, position 1", timeout=120)
        fourth = root.train(src, "d", "--gpus", "2", "--wait")  # came later: behind carol
        procs.append(fourth)
        wait_for_output(fourth, r"h1: waiting in line, position 2 — ahead: train run \S+ by carol", timeout=120)
        fifth = bob.train(src, "e", "--gpus", "2", "--wait")  # joins the line, then Ctrl-C: it leaves it, nothing else moves
        wait_for_output(fifth, r"h\d: waiting in line", timeout=120)  # behind its own workdir (bob's run) and the line
        fifth.send_signal(signal.SIGINT)
        assert fifth.wait(timeout=60) == 130
        line = [(r["device"], r["user"]) for r in carol.lab() if r["host"] == "h1" and r["state"] == "waiting"]
        assert line == [("#1", "carol"), ("#2", "root")], line

        end(lab, "a", (h1, h2))  # alice's run ends: carol's starts on its GPUs, root's still waits
        assert "finished on every host" in finished(first)
        wait_for_output(third, r"rank 0 local 0 sees CUDA_VISIBLE_DEVICES=", timeout=180)
        c_run = carol.run_ids()[-1]
        assert fourth.poll() is None and root_waits(root)
        end(lab, "b", (h1, h2))  # bob's ends: root's starts
        finished(second)
        wait_for_output(fourth, r"rank 0 local 0 sees CUDA_VISIBLE_DEVICES=", timeout=180)
        end(lab, "c", (h1, h2))
        end(lab, "d", (h1, h2))
        finished(third)
        finished(fourth)
        d_run = root.run_ids()[-1]
        for host in (h1, h2):
            saw = {who: p.seen(run, host) for who, p, run in (("a", alice, a_run), ("b", bob, b_run), ("c", carol, c_run), ("d", root, d_run))}
            assert all(len(s) == 1 for s in saw.values()), saw  # every rank of a run saw the same two GPUs
            assert saw["a"] != saw["b"] and saw["c"] == saw["a"] and saw["d"] == saw["b"], saw  # the freed ones, in order
        assert {r["state"] for r in root.lab()} == {"free"}
    finally:
        for tag in "abcd":
            end(lab, tag, (h1, h2))
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


def root_waits(root: Person) -> bool:
    """root's run is the one waiting in h1's line."""
    return [(r["user"], r["state"]) for r in root.lab() if r["host"] == "h1" and r["device"].startswith("#")] == [("root", "waiting")]


def test_nodes_picks_the_hosts_with_free_gpus_a_gpu_used_by_hand_is_never_picked_and_provision_waits_for_no_run(lab, tmp_path, src):
    h1, h2, h3, h4 = lab.hosts
    alice, bob = Person(lab, tmp_path, "alice", (h2, h3)), Person(lab, tmp_path, "bob", lab.hosts)
    root = Person(lab, tmp_path, "root", (h2,))
    by_hand = lab.popen(h1, ["nvidia-smi", "--fake-use", "0", "--", "sleep", "300"], start_new_session=True)
    full = alice.train(src, "full", "--gpus", "4")  # every GPU of h2 and h3
    try:
        rows = wait_held(bob, "h3", 4)
        assert held(rows, "h1")["0"][0] == "outside" and held(rows, "h1")["1"][0] == "free"
        outside = next(r for r in rows if r["host"] == "h1" and r["device"] == "0")
        assert outside["user"] == "root" and outside["detail"] == f"in use outside mnft: pid {by_hand.pid}"

        dry = bob.mnft("train", "--hosts", bob.inventory, "--src", str(src), "--nodes", "2", "--gpus", "2", "--dry-run", "--", "hold.py", "n")
        assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
        assert "h1: picked: 3 of 4 device(s) free" in dry.stdout and "h2: 0 of 4 device(s) free, 2 needed" in dry.stdout
        assert "h4: picked: 4 of 4 device(s) free" in dry.stdout and "--nodes 2: h1, h4 (node_rank in this order)" in dry.stdout

        wheels = tmp_path / "wheels"
        wheels.mkdir()
        lock = write_lock(tmp_path / "requirements.lock", [make_wheel(wheels, "alpha", "1.0")], {"alpha": "1.0"}, find_links=wheels)
        # alice's run holds h2's GPUs: an environment the lab shares (outside root's home) changes the whole host: refused
        shared = lab.write_inventory(root.dir / "shared-env.yaml", hosts=[h2], user="root", workdir=root.workdir, venv="/tmp/lab-env")
        provision = root.mnft("provision", "--hosts", str(shared), "--lock", str(lock))
        assert provision.returncode == 1 and "Traceback" not in provision.stderr, provision.stdout[-2000:] + provision.stderr[-2000:]
        assert re.search(r"h2 is busy: GPU 0, 1, 2, 3, job directory /tmp/home-alice/mnft/outputs/\S+: train run \S+ by alice \(.*the whole host is not changed under a run", provision.stderr)
        # root's own ~/mnft-env is root's alone: it is built while alice trains (issue 45: a new member's environment in a busy lab)
        provision = root.mnft("provision", "--hosts", root.inventory, "--lock", str(lock))
        assert provision.returncode == 0, provision.stdout[-2000:] + provision.stderr[-2000:]
        assert held(wait_held(bob, "h3", 4), "h2")["0"][0] == "held"  # alice's run went on

        picked = bob.train(src, "n", "--nodes", "2", "--gpus", "2")
        wait_for_output(picked, r"rank 0 local 0 sees CUDA_VISIBLE_DEVICES=", timeout=180)
        end(lab, "n", (h1, h4))
        finished(picked)
        run = bob.run_ids()[-1]
        assert bob.seen(run, h1) == {"2,3"} and bob.seen(run, h4) == {"0,1"}  # GPU 0 of h1 is someone's: the other NVLink pair
        record = json.loads((bob.dir / "runs" / run / "run.json").read_text())
        assert record["devices"] == {"h1": [2, 3], "h4": [0, 1]}

        # 4 GPUs free on the last host only: the pick leaves out the first host, the inventory's master, and every
        # host but the last, and the run lands there as its own master (was: KeyError: 'h1', a traceback)
        last = bob.train(src, "last", "--nodes", "1", "--gpus", "4")
        wait_for_output(last, r"rank 0 local 0 sees CUDA_VISIBLE_DEVICES=0,1,2,3", timeout=180)
        end(lab, "last", (h4,))
        finished(last)
        record = json.loads((bob.dir / "runs" / bob.run_ids()[-1] / "run.json").read_text())
        assert list(record["hosts"]) == ["h4"] and record["devices"] == {"h4": [0, 1, 2, 3]}
    finally:
        by_hand.kill()
        by_hand.wait()
        end(lab, "full", (h2, h3))
        finished(full)


def test_a_detached_runs_keeper_killed_with_its_process_group_leaves_its_gpus_to_be_taken_over(lab, tmp_path, src):
    h3 = lab.hosts[2]
    alice, bob = Person(lab, tmp_path, "alice", (h3,)), Person(lab, tmp_path, "bob", (h3,))
    run_id = alice.detach(src, "k", "--gpus", "4")
    wait_held(bob, "h3", 4)
    for pid, _ in lab.processes(h3):  # the run dies, keeper and ranks (torchrun starts each rank in a session of its own)
        try:
            if f"MNFT_RUN_ID={run_id}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    try:
        taken = bob.train(src, "k2", "--gpus", "4")
        out = wait_for_output(taken, r"rank 0 local 0 sees CUDA_VISIBLE_DEVICES=0,1,2,3", timeout=180)
        assert any(f"took over the lease of train run {run_id} by alice" in line for line in out), "".join(out)
    finally:
        end(lab, "k2", (h3,))
        end(lab, "k", (h3,))
    finished(taken)


def test_root_stops_another_users_run_through_the_keeper_that_holds_its_gpus_and_nothing_of_it_is_left(lab, tmp_path, src):
    h4 = lab.hosts[3]
    alice, root = Person(lab, tmp_path, "alice", (h4,)), Person(lab, tmp_path, "root", (h4,))
    run_id = alice.detach(src, "s", "--gpus", "2")
    try:
        wait_held(root, "h4", 2)
        deadline = time.monotonic() + 60
        while sum(1 for pids in lab.gpu_users(h4).values() if pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # both ranks on their GPUs
        stopped = root.mnft("stop", run_id, "--hosts", root.inventory, "--json")
        assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
        assert json.loads(stopped.stdout)["stopped"] is True
        assert all(not pids for pids in lab.gpu_users(h4).values())  # no rank of it is left on any GPU
        assert {r["state"] for r in root.lab()} == {"free"}
    finally:
        end(lab, "s", (h4,))


STEPS = RANK_SNIPPET + '''
import os, sys, time

end = "/tmp/mnft-test-end-" + sys.argv[1]
step = 0
while not os.path.exists(end) and step < 600:
    step += 1
    print(f"step {step} loss {2.0 / step:.4f}", flush=True)
    time.sleep(0.5)
print("done", flush=True)
'''


def test_another_members_look_shows_how_far_a_run_is_from_its_lease_and_nothing_else_of_it(lab, tmp_path, src):
    """Issue 45: the board showed no step or loss for other users' runs (their records are theirs, 0700). An attached
    run's controller tells its hosts' leases its last step and loss with its heartbeat; carol's `mnft lab --json` and
    her board's row of alice's run read them there, and no other word of alice's output."""
    from mnft.board import runs as runs_of

    h3 = lab.hosts[2]
    (src / "steps.py").write_text(STEPS)
    alice, carol = Person(lab, tmp_path, "alice", (h3,)), Person(lab, tmp_path, "carol", (h3,))
    run = alice.start("train", "--hosts", alice.inventory, "--src", str(src), "--gpus", "1", "--", "steps.py", "p")
    try:
        deadline, seen = time.monotonic() + 90, None
        while time.monotonic() < deadline and not seen and run.poll() is None:
            time.sleep(1)
            seen = next((r.get("progress") for r in carol.lab() if r["host"] == h3.name and r["state"] == "held" and r.get("progress")), None)
        assert seen and seen["step"] >= 1 and seen["loss"] == pytest.approx(2.0 / seen["step"], abs=1e-4), seen
        assert set(seen) == {"step", "loss", "at"}
        rows = json.loads(carol.mnft("lab", "--hosts", carol.inventory, "--json").stdout)["devices"]
        (theirs,) = runs_of.others(rows, set())
        assert theirs["user"] == "alice" and isinstance(theirs["step"], int) and theirs["step"] >= seen["step"] and theirs["loss"] is not None
    finally:
        end(lab, "p", (h3,))
        finished(run)
