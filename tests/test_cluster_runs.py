"""Issue 35 on a real simulated cluster: many runs from one repository, side by side, each with its own code, and
nothing a run wrote ever deleted by a sync.

Two hosts h1, h2 with 2 stand-in GPUs each (tests/fakegpu.py). A run's code is fixed when `train` is invoked (a
snapshot on the controller), goes into a read-only snapshot on every host and, as hard links, into its job's
working directory `<workdir>/outputs/<job>`, where its ranks start. What is asserted is what the ranks printed,
what is on the hosts' disks, and what the users are told.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from fakegpu import RANK_SNIPPET
from runhelpers import Controller, wait_for_output

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SHARED = "/tmp/lab-home"  # a lab's NFS home for its users: h1 and h2 see one directory there

# every rank: registers on its GPU, prints the code's version it was started with, holds until told to end
HOLD = RANK_SNIPPET + '''
import os, sys, time
from version import V

print("mnft-test: %s runs version %s" % (sys.argv[1], V), flush=True)
end = "/tmp/mnft-test-end-" + sys.argv[1]
deadline = time.time() + 300
while not os.path.exists(end) and time.time() < deadline:
    time.sleep(0.2)
print("done", flush=True)
'''

# a script that keeps its checkpoints relative to its working directory, as people write them on one machine; the
# first attempt dies at step KILL_AT (as a killed rank would); a start finds its own latest checkpoint and goes on from it
CKPT = '''
import os, signal, sys

steps = int(sys.argv[1])
rank = int(os.environ.get("RANK", "0"))
done = sorted(int(d.split("_")[1]) for d in os.listdir("ckpts") if d.startswith("step_")) if os.path.isdir("ckpts") else []
start = done[-1] if done else 0
print("mnft-test: rank %d starts after step %d in %s" % (rank, start, os.getcwd()), flush=True)
for step in range(start + 1, steps + 1):
    os.makedirs("ckpts/step_%d" % step, exist_ok=True)
    with open("ckpts/step_%d/model-r%d.pt" % (step, rank), "w") as f:
        f.write("weights of step %d\\n" % step)
    print('{"step": %d, "loss": %.3f}' % (step, 1.0 / step), flush=True)
    if str(step) == os.environ.get("KILL_AT") and os.environ.get("MNFT_ATTEMPT") == "1" and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.fixture(scope="module")
def lab(testbed, tmp_path_factory):
    """h1, h2 with 2 GPUs each; alice logs in beside root; /tmp/lab-home is one directory on both (an NFS home)."""
    work = tmp_path_factory.mktemp("runs-lab")
    with testbed.Cluster.create(2, work, outsider=False, gpus=2, shared_dirs={SHARED: ("h1", "h2")}) as cluster:
        cluster.add_user("alice", password="not used", torch=True)
        shared = cluster.shared_dir(SHARED)
        shared.chmod(0o1777)  # every user makes their own directory there, as in a lab's /home
        yield cluster


class User(Controller):
    """A lab member at their own controller: an inventory as them, their own runs/, home and snapshot store."""

    def __init__(self, cluster, tmp_path: Path, user: str, workdir: str):
        super().__init__(tmp_path / f"ctl-{user}")
        self.cluster, self.user, self.workdir = cluster, user, workdir
        self.inventory = str(cluster.write_inventory(self.dir / "lab.yaml", hosts=cluster.hosts, user=user, workdir=workdir))

    def detach(self, src: Path, *args: str) -> str:
        started = self.mnft("train", "--hosts", self.inventory, "--src", str(src), "--detach", *args)
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        return started.stdout.strip().splitlines()[-1]

    def record(self, run_id: str) -> dict:
        return json.loads((self.dir / "runs" / run_id / "run.json").read_text())

    def on_host(self, host, path: str) -> Path:
        """A path on a host (under its /root or its /tmp) as this machine sees it."""
        if path.startswith(SHARED + "/"):
            return self.cluster.shared_dir(SHARED) / path[len(SHARED) + 1:]
        return host.home / path[len("/root/"):] if path.startswith("/root/") else host.root / "tmp" / path[len("/tmp/"):]

    def job_dir(self, host, job_id: str) -> Path:
        return self.on_host(host, f"{self.workdir}/outputs/{job_id}")

    def output(self, host, run_id: str) -> str:
        log = self.on_host(host, f"{self.workdir}/runs/{run_id}/{host.name}/output.log")
        return log.read_text() if log.is_file() else ""


def repo(tmp_path: Path, files: dict[str, str]) -> Path:
    """The user's repository: a git work tree with no .gitignore."""
    tree = tmp_path / "repo"
    tree.mkdir(exist_ok=True)
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    return tree


def end(cluster, tag: str) -> None:
    for host in cluster.hosts:
        (host.root / "tmp" / f"mnft-test-end-{tag}").write_text("")


def wait_until(what, timeout: float = 120.0, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def printed(user: User, run_id: str, tag: str) -> set[str]:
    return {v for host in user.cluster.hosts for v in re.findall(rf"mnft-test: {tag} runs version (\d+)", user.output(host, run_id))}


def test_runs_of_one_repository_run_side_by_side_each_with_the_code_it_was_started_with(lab, tmp_path):
    """A run, an edit, a second run on the other GPUs: both run at once, each rank printing its own version; a third
    run queued behind them with --wait runs the edit made before it was queued, not the one made while it waited."""
    root = User(lab, tmp_path, "root", "/root/mnft-runs")
    src = repo(tmp_path, {"hold.py": HOLD, "version.py": "V = 1\n"})
    first = root.detach(src, "--gpus", "1", "--", "hold.py", "first")
    wait_until(lambda: printed(root, first, "first"))
    (src / "version.py").write_text("V = 2\n")
    second = root.detach(src, "--gpus", "1", "--", "hold.py", "second")  # no `workdir busy`: its job has a directory of its own
    wait_until(lambda: printed(root, second, "second"))
    assert printed(root, first, "first") == {"1"} and printed(root, second, "second") == {"2"}
    assert {root.record(first)["code_hash"], root.record(second)["code_hash"]} == {root.record(first)["code"]["hash"], root.record(second)["code"]["hash"]}
    assert root.record(first)["code_hash"] != root.record(second)["code_hash"]

    (src / "version.py").write_text("V = 3\n")  # the code the third run is started with
    third = root.start("train", "--hosts", root.inventory, "--src", str(src), "--gpus", "1", "--wait", "--", "hold.py", "third")
    try:
        wait_for_output(third, r"waiting in line", timeout=120)
        (src / "version.py").write_text("V = 4\n")  # made while it waits: not its code
        (src / "later.py").write_text("print('added while waiting')\n")
        end(lab, "first")
        wait_until(lambda: any(printed(root, r, "third") for r in root_runs(root) if r not in (first, second)), timeout=180)
        (third_id,) = [r for r in root_runs(root) if r not in (first, second)]
        assert printed(root, third_id, "third") == {"3"}
        assert not (root.job_dir(lab.hosts[0], root.record(third_id)["job_id"]) / "later.py").exists()
        end(lab, "second"), end(lab, "third")
        out, _ = third.communicate(timeout=180)
        assert third.returncode == 0, out[-3000:]
    finally:
        if third.poll() is None:
            third.kill()
    status = root.mnft("status", first)
    assert f"code {root.record(first)['code_hash'][:12]}" in status.stdout, status.stdout


def test_the_same_job_twice_at_once_is_refused_naming_the_run_that_holds_its_directory(lab, tmp_path):
    """A --resume of a job that is still running would write its files from two runs: refused before anything
    starts, naming the run; a new run of the same repository beside it is not."""
    root = User(lab, tmp_path, "root", "/root/mnft-twice")
    src = repo(tmp_path, {"hold.py": HOLD, "version.py": "V = 5\n",
                          "job.yaml": "script: hold.py\nargs: [twice]\nresume: {layout: none, args: [--again]}\n"})
    first = root.detach(src, "--gpus", "1", "--job", str(src / "job.yaml"))
    try:
        wait_until(lambda: printed(root, first, "twice"))
        job = root.record(first)["job_id"]
        again = root.mnft("train", "--resume-run", first, "--gpus", "1")
        assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
        line = [ln for ln in again.stderr.splitlines() if "working directory" in ln]
        assert line and f"/root/mnft-twice/outputs/{job} is in use by train run {first}" in line[0], again.stderr
        assert "one job runs once at a time" in line[0] and "Traceback" not in again.stderr
        assert root.record(root_runs(root)[-1])["state"] == "refused"
    finally:
        end(lab, "twice")
        root.mnft("stop", first)


def root_runs(user: User) -> list[str]:
    runs = user.dir / "runs"
    return sorted(p.name for p in runs.glob("[!.]*") if (p / "run.json").is_file()) if runs.is_dir() else []


def test_what_a_script_writes_relative_to_its_directory_survives_syncs_restarts_and_resumes(lab, tmp_path):
    """ckpts/ relative to the working directory, in a repository with no .gitignore: kept through two more syncs and
    trains, found again by the restart after a kill (--max-restarts) and by --resume; a source file in the way of a
    file the job wrote is named and never overwritten."""
    root = User(lab, tmp_path, "root", "/root/mnft-ckpt")
    # the script finds its own checkpoints (layout none); its resume argument is only a word it ignores
    src = repo(tmp_path, {"ckpt.py": CKPT, "job.yaml": "script: ckpt.py\nargs: ['6']\nresume: {layout: none, args: [--continue]}\n"})
    job_file = str(src / "job.yaml")
    done = root.mnft("train", "--hosts", root.inventory, "--src", str(src), "--max-restarts", "1", "--env", "KILL_AT=3", "--job", job_file,
                     timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (run_id,) = root_runs(root)
    job = root.record(run_id)["job_id"]
    record = root.record(run_id)
    assert len(record["attempts"]) == 2, record["attempts"]
    for rank, host in enumerate(lab.hosts):
        out = root.output(host, f"{run_id}.a2") or "".join(p.read_text() for p in root.on_host(host, f"{root.workdir}/runs").glob(f"{run_id}*/{host.name}/output.log"))
        assert f"rank {rank} starts after step " in out
        files = sorted(p.relative_to(root.job_dir(host, job)).as_posix() for p in (root.job_dir(host, job) / "ckpts").rglob("*.pt"))
        assert files == [f"ckpts/step_{s}/model-r{rank}.pt" for s in range(1, 7)]
    # the second attempt found the first one's checkpoints in the same directory
    assert "starts after step 3" in "".join(p.read_text() for host in lab.hosts
                                             for p in root.on_host(host, f"{root.workdir}/runs").glob("*/*/output.log"))
    before = {host.name: sorted(p.as_posix() for p in root.job_dir(host, job).rglob("*")) for host in lab.hosts}
    for _ in range(2):  # two more syncs and trains of the same repository, changed each time
        (src / "note.txt").write_text(str(time.time()))
        synced = root.mnft("sync", "--hosts", root.inventory, "--src", str(src))
        assert synced.returncode == 0, synced.stdout + synced.stderr
        again = root.mnft("train", "--hosts", root.inventory, "--src", str(src), "--job", job_file, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for host in lab.hosts:
        after = sorted(p.as_posix() for p in root.job_dir(host, job).rglob("*"))
        assert set(before[host.name]) <= set(after), set(before[host.name]) - set(after)

    resumed = root.mnft("train", "--resume-run", run_id, "--src", str(src), timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "starts after step 6" in resumed.stdout, resumed.stdout[-3000:]  # its own ckpts/, in its own directory

    # the repository now has a file where the job wrote one: a conflict, named; the job's file is left as it is
    (src / "ckpts" / "step_1").mkdir(parents=True)
    (src / "ckpts" / "step_1" / "model-r0.pt").write_text("a file of the repository\n")
    refused = root.mnft("train", "--resume-run", run_id, "--src", str(src), timeout=300)
    assert refused.returncode == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    line = [ln for ln in refused.stderr.splitlines() if "in the way" in ln]
    assert line and "ckpts/step_1/model-r0.pt" in line[0] and "nothing was written there" in line[0], refused.stderr
    assert (root.job_dir(lab.hosts[0], job) / "ckpts/step_1/model-r0.pt").read_text() == "weights of step 1\n"
    assert "starts after" not in refused.stdout  # nothing started


def test_a_sync_names_a_host_file_in_the_way_and_never_overwrites_it(lab, tmp_path):
    root = User(lab, tmp_path, "root", "/root/mnft-sync")
    src = repo(tmp_path, {"train.py": "print('t')\n"})
    assert root.mnft("sync", "--hosts", root.inventory, "--src", str(src)).returncode == 0
    h2 = lab.hosts[1]
    mine = root.on_host(h2, f"{root.workdir}/results.csv")
    mine.write_text("a person's results\n")
    (src / "results.csv").write_text("the repository's\n")
    dry = root.mnft("sync", "--hosts", root.inventory, "--src", str(src), "--dry-run")
    assert dry.returncode == 1 and "conflict: results.csv" in dry.stdout, dry.stdout + dry.stderr
    refused = root.mnft("sync", "--hosts", root.inventory, "--src", str(src))
    assert refused.returncode == 1 and "h2: 1 file(s)" in refused.stdout and "results.csv" in refused.stdout, refused.stdout + refused.stderr
    assert mine.read_text() == "a person's results\n"
    assert root.on_host(lab.hosts[0], f"{root.workdir}/results.csv").read_text() == "the repository's\n"  # h1 had nothing in the way
    forced = root.mnft("sync", "--hosts", root.inventory, "--src", str(src), "--force")
    assert forced.returncode == 0 and mine.read_text() == "the repository's\n", forced.stdout + forced.stderr


def test_two_users_on_a_shared_home_run_the_same_repository_at_once(lab, tmp_path):
    users = [User(lab, tmp_path, "root", f"{SHARED}/root/mnft"), User(lab, tmp_path, "alice", f"{SHARED}/alice/mnft")]
    for user in users:  # their own directories on the shared home
        subprocess.run(lab.ssh_argv(lab.hosts[0], ["mkdir", "-p", user.workdir], user=user.user), check=True, capture_output=True)
    src = repo(tmp_path, {"hold.py": HOLD, "version.py": "V = 7\n"})
    os.chmod(tmp_path, 0o755)
    started = [u.start("train", "--hosts", u.inventory, "--src", str(src), "--gpus", "1", "--", "hold.py", u.user) for u in users]
    try:
        for user in users:
            wait_until(lambda user=user: any(printed(user, r, user.user) for r in root_runs(user)), timeout=240)
        for user in users:
            end(lab, user.user)
        for user, proc in zip(users, started):
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 0, out[-3000:]
            (run_id,) = root_runs(user)
            assert printed(user, run_id, user.user) == {"7"}
            record = user.record(run_id)
            # one copy on the shared home serves both hosts: one snapshot, one job directory
            assert sorted(record["devices"]) == ["h1", "h2"]
            snapshots = list(user.on_host(lab.hosts[0], f"{user.workdir}/.mnft/code").glob("[0-9a-f]" * 16))
            assert [s.name for s in snapshots] == [record["code_hash"][:16]]
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()


def test_a_second_snapshot_of_a_large_tree_with_one_changed_file_costs_that_file(lab, tmp_path):
    """Library level (what train runs): the second snapshot hard-links every unchanged file from the first, and a
    job's directory is hard links to its snapshot: the disk a new run of a changed repository costs is its changed files."""
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import load
    from mnft.sync import snapshot

    root = User(lab, tmp_path, "root", "/root/mnft-big")
    src = repo(tmp_path, {f"data/part-{i:02d}.bin": os.urandom(256 << 10).hex() for i in range(20)})  # 20 × 512 KiB
    (src / "train.py").write_text("print('v1')\n")
    inventory = load(root.inventory)
    store = tmp_path / "store"
    one = snapshot.fix(src, root=store)
    with Fleet(inventory) as fleet:
        assert snapshot.place(inventory, one.tree, "job-a", fleet=fleet).ok
        (src / "train.py").write_text("print('v2: one changed file')\n")
        two = snapshot.fix(src, root=store)
        assert snapshot.place(inventory, two.tree, "job-b", fleet=fleet).ok
    one.release(), two.release()
    for host in lab.hosts:
        code = root.on_host(host, f"{root.workdir}/.mnft/code")
        first, second = code / one.tree.digest[:16], code / two.tree.digest[:16]
        new = [p for p in second.rglob("*") if p.is_file() and not (first / p.relative_to(second)).exists()
               or p.is_file() and not p.samefile(first / p.relative_to(second))]
        assert [p.relative_to(second).as_posix() for p in new] == ["train.py"]
        job_b = root.job_dir(host, "job-b")
        assert all((job_b / p.relative_to(second)).samefile(p) for p in second.rglob("*") if p.is_file())
