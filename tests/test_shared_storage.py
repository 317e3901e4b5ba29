"""Shared storage is detected, never assumed: each host leaves a mark for its target beside it, then says whose
marks it sees for the same path; hosts that see one directory get one copy (issue 20)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mnft.sync import mirror


from mnft.onhost import sharemarks, treehash
REPO = Path(__file__).resolve().parent.parent


def test_groups_are_the_hosts_that_see_each_others_marks_taken_both_ways():
    order = ["h1", "h2", "h3", "h4"]
    sees = {"h1": {"h1", "h2"}, "h2": {"h2"}, "h3": {"h3", "h4"}, "h4": {"h3", "h4"}}
    assert mirror.groups_of(order, sees) == {"h1": ("h1", "h2"), "h2": ("h1", "h2"), "h3": ("h3", "h4"), "h4": ("h3", "h4")}
    assert mirror.groups_of(order, {n: {n} for n in order}) == {}  # private homes: nobody shares


def test_a_mark_is_seen_for_the_same_path_only_and_never_creates_the_target(tmp_path):
    shared, other = tmp_path / "home" / "mnft", tmp_path / "home" / "elsewhere"
    (tmp_path / "home").mkdir()
    assert sharemarks._mark(str(shared), "n1.h1") is None and sharemarks._mark(str(other), "n1.h2") is None
    assert not shared.exists()  # marked beside it: a missing mount never becomes a local directory
    assert sharemarks.seen(str(shared), "n1", ["h1", "h2", "h3"]) == ["h1"]  # h2 marked another path
    assert sharemarks._mark(str(shared), "n1.h3") is None
    assert sharemarks.seen(str(shared), "n1", ["h1", "h2", "h3"]) == ["h1", "h3"]
    assert sharemarks.seen(str(shared), "n2", ["h1"]) == []  # another sync's nonce
    assert sharemarks._mark(str(tmp_path / "home" / "x"), "../../etc.h1") == "invalid mark"


def run_treehash(*argv: str) -> dict:
    """The host script as a host runs it (its own process: marks and looks from the command line)."""
    from mnft.hosts import pyrun

    done = subprocess.run([sys.executable, "-S", "-c", pyrun.BOOTSTRAP, *argv], input=pyrun.payload("treehash"), capture_output=True,
                          timeout=60, check=True)
    return json.loads(done.stdout.decode().splitlines()[-1])


def test_one_round_trip_finds_who_shares_because_the_later_of_two_hosts_to_mark_sees_the_earlier(tmp_path):
    """Each host marks, then looks for every host's mark, in one run of the script. Hosts run in any order: of two
    that share, whichever marks later sees the other's mark, and seeing is taken both ways."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "own").mkdir()
    names = "h1,h2,h3"
    first = run_treehash(str(tmp_path / "shared" / "mnft"), "--mark", "n1.h1", "--only", "--names", names)
    third = run_treehash(str(tmp_path / "own" / "mnft"), "--mark", "n1.h3", "--only", "--names", names)
    second = run_treehash(str(tmp_path / "shared" / "mnft"), "--mark", "n1.h2", "--only", "--names", names)
    assert (first, second, third) == ({"marked": None, "seen": ["h1"]}, {"marked": None, "seen": ["h1", "h2"]}, {"marked": None, "seen": ["h3"]})
    sightings = {name: mirror.Sighting.from_json(answer) for name, answer in (("h1", first), ("h2", second), ("h3", third))}
    hosts = [type("H", (), {"name": n})() for n in ("h1", "h2", "h3")]
    assert mirror.sharing_of(None, hosts, {}, "n1", sightings) == ({"h1": ("h1", "h2"), "h2": ("h1", "h2")}, {})


def test_a_host_whose_mark_could_not_be_left_looks_again_once_every_mark_is_in(monkeypatch):
    """Nobody sees an unmarked host's mark: it shares only by the marks it sees, and it may have looked before the
    others marked. It (only it) looks again in a round-trip of its own."""
    hosts = [type("H", (), {"name": n})() for n in ("h1", "h2", "h3")]
    sightings = {"h1": mirror.Sighting("Read-only file system", ()), "h2": mirror.Sighting(None, ("h2",)), "h3": mirror.Sighting(None, ("h3",))}
    asked = []

    def look(fleet, again, targets, nonce, names):
        asked.append(([h.name for h in again], nonce, list(names)))
        return {"h1": {"h2"}}

    monkeypatch.setattr(mirror, "look", look)
    groups, unmarked = mirror.sharing_of(None, hosts, {}, "n1", sightings)
    assert asked == [(["h1"], "n1", ["h1", "h2", "h3"])]
    assert groups == {"h1": ("h1", "h2"), "h2": ("h1", "h2")} and unmarked == {"h1": "Read-only file system"}


def test_a_mark_appears_whole_and_a_link_planted_at_its_name_is_replaced_never_followed(tmp_path):
    (tmp_path / "home").mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("not mnft's\n")
    share = tmp_path / "home" / ".mnft-share"
    share.mkdir(mode=0o700)
    (share / "n1.h1").symlink_to(victim)
    assert sharemarks._mark(str(tmp_path / "home" / "mnft"), "n1.h1") is None
    assert victim.read_text() == "not mnft's\n" and not (share / "n1.h1").is_symlink()
    assert sorted(os.listdir(share)) == ["n1.h1"]  # written under another name, renamed into place: nothing else left
    assert sharemarks.seen(str(tmp_path / "home" / "mnft"), "n1", ["h1"]) == ["h1"]


def test_a_target_that_is_a_mount_of_its_own_is_marked_inside_and_its_marks_are_never_synced(tmp_path, monkeypatch):
    """A lab's data mount (NFS on ~/mnft-data, the home private): marks beside it would land in each private home
    and nobody would see anybody's, so three rsyncs would race in the one directory. They go inside it instead."""
    from mnft.sync import source

    data = tmp_path / "home" / "mnft-data"
    data.mkdir(parents=True)
    assert sharemarks._anchor(str(data)) == (str(tmp_path / "home"), "mnft-data")  # a plain directory: beside it
    monkeypatch.setattr(sharemarks, "_mount_points", lambda: {str(data)})
    assert sharemarks._anchor(str(data)) == (str(data), ".")
    assert sharemarks._mark(str(data), "n1.h1") is None and (data / ".mnft-share" / "n1.h1").is_file()
    assert sharemarks.seen(str(data), "n1", ["h1", "h2"]) == ["h1"]
    assert sharemarks._anchor(str(data / "missing")) == (str(data), "missing")  # below the mount: beside, as before
    (data / "x.txt").write_text("x")
    for fixed in (source.ALWAYS_EXCLUDES, source.DATA_EXCLUDES):  # the same rules go to rsync: not sent, not deleted
        assert sorted(source.tree_hash(data, fixed)[1]) == ["x.txt"]


def test_mount_points_are_read_with_their_escapes_undone():
    info = ("22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
            "95 22 0:50 /export/data /srv/lab\\040data rw,relatime - nfs4 fs:/export rw,vers=4.2\n"
            "96 22 0:51 / /srv/a\\011b\\134c rw - tmpfs tmpfs rw\n")
    assert sharemarks._mount_points(info) == {"/", "/srv/lab data", "/srv/a\tb\\c"}


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a bind mount in a mount namespace of its own needs root")
def test_a_bind_mount_whose_name_needs_escapes_is_found_in_this_machines_mountinfo(tmp_path):
    """A bind mount within one filesystem (os.path.ismount misses it) named with a space and a tab, made in a
    mount namespace of its own (nothing of it outlives the test): the real /proc/self/mountinfo, read back."""
    source, target = tmp_path / "export", tmp_path / "lab data\tset"
    source.mkdir()
    target.mkdir()
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from mnft.onhost import sharemarks; "
             "print(sys.argv[2] in sharemarks._mount_points(), sys.argv[3] in sharemarks._mount_points())")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$2" && exec "$3" -c "$4" "$5" "$2" "$1"',
                           "sh", str(source), str(target), sys.executable, probe, str(REPO)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]  # the mount point, not the directory it shows
    assert str(target) not in sharemarks._mount_points()  # this namespace never saw it


@pytest.mark.parametrize("target", ["/etc/mnft", "/mnft"])
def test_nothing_is_marked_in_a_system_directory_or_at_the_root(target):
    assert sharemarks._mark(target, "n1.h1") == "no directory above the target to mark"


# ------------------------------------------------------------------------------------------------ on the test bed

SCRIPT = '''\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print(f"rank {dist.get_rank()} on {os.uname().nodename} done", flush=True)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.cluster
@pytest.mark.slow
def test_hosts_sharing_a_home_get_one_copy_and_train_with_their_own_run_files(fresh_cluster_factory, tmp_path):
    """Three hosts with one home (an NFS home in a lab), no shared_fs in the inventory: sync writes the tree once
    and the others verify it (it used to fail: three rsyncs renaming files in one directory); train runs with
    each host's spec, pgid and log under its own name (it used to hang: one pgid, node2 ran as node_rank 0)."""
    cluster = fresh_cluster_factory(3, shared_home=("h1", "h2", "h3"))
    assert len({h.home for h in cluster.hosts}) == 1
    inv = cluster.write_inventory(tmp_path / "inv.yaml")
    repo = tmp_path / "lab"
    repo.mkdir()
    (repo / "job.py").write_text(SCRIPT)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    env = dict(os.environ, HOME=str(tmp_path / "ctl"), MNFT_RUNS_DIR=str(tmp_path / "runs"))
    (tmp_path / "ctl").mkdir()
    mnft = [sys.executable, "-c", "from mnft.cli.main import main; main()"]

    checked = subprocess.run([*mnft, "check", "--hosts", str(inv)], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and "h1, h2, h3 see one workdir (a shared filesystem) without shared_fs" in " ".join(checked.stdout.split())
    declared = cluster.write_inventory(tmp_path / "declared.yaml", shared_fs=True)
    checked = subprocess.run([*mnft, "check", "--hosts", str(declared)], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and "shared_fs" not in checked.stdout  # declared and true: nothing to say

    synced = subprocess.run([*mnft, "sync", "--hosts", str(inv), "--json"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert synced.returncode == 0, synced.stdout[-3000:] + synced.stderr[-3000:]
    hosts = json.loads(synced.stdout)["hosts"]
    changed = [n for n, h in hosts.items() if h["status"] == "changed"]
    assert len(changed) == 1 and all(h["status"] in ("changed", "ok") for h in hosts.values()), hosts

    done = subprocess.run([*mnft, "train", "--hosts", str(inv), "--", "job.py"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(f"rank {r} on" in done.stdout for r in range(3))
    record = json.loads(next((tmp_path / "runs").glob("[!.]*")).joinpath("run.json").read_text())
    runs = cluster.hosts[0].home / "mnft" / "runs" / record["run_id"]
    assert sorted(p.name for p in runs.glob("[!.]*")) == ["h1", "h2", "h3"]
    assert all((runs / name / "spec.json").is_file() and (runs / name / "exit_code").read_text().strip() == "0" for name in ("h1", "h2", "h3"))


@pytest.mark.cluster
def test_a_declared_shared_fs_that_is_not_shared_fails_the_check(healthy_cluster, tmp_path):
    inv = healthy_cluster.write_inventory(tmp_path / "inv.yaml", hosts=healthy_cluster.hosts[:2], shared_fs=True)
    env = dict(os.environ, HOME=str(tmp_path), MNFT_RUNS_DIR=str(tmp_path / "runs"))
    done = subprocess.run([sys.executable, "-c", "from mnft.cli.main import main; main()", "check", "--hosts", str(inv)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "h2: shared_fs: declared shared_fs, but its workdir is not the one h1 sees" in " ".join(done.stdout.split())


def test_shared_fs_declared_and_found_are_compared():
    from mnft.check.rules import shared_fs_problems
    from mnft.hosts.settings import Host

    hosts = [Host(name=n, rank=i, address=f"10.0.0.{i}", shared_fs=n != "h3") for i, n in enumerate(["h1", "h2", "h3"])]
    found = {"h1": ("h1", "h3"), "h3": ("h1", "h3")}
    problems = shared_fs_problems(hosts, found)
    assert [(p.host, p.severity) for p in problems] == [("h2", "error"), ("h1", "note")]
    assert problems[1].fix == ""  # found, and nothing to do: no fix line (issue 36)


def test_a_note_that_needs_nothing_done_prints_no_fix_line(capsys):
    from mnft.check.findings import CheckReport
    from mnft.check.report import print_check
    from mnft.check.rules import shared_fs_problems
    from mnft.hosts.fleet import HostResult, Status
    from mnft.hosts.settings import Host, Inventory

    hosts = tuple(Host(name=n, rank=i, address=f"10.0.0.{i}") for i, n in enumerate(["h1", "h2"]))
    report = CheckReport(Inventory(None, "mnft", hosts, "h1"), {h.name: HostResult(h.name, Status.OK) for h in hosts}, {},
                         problems=shared_fs_problems(list(hosts), {"h1": ("h1", "h2"), "h2": ("h1", "h2")}))
    print_check(report, as_json=False)
    out = " ".join(capsys.readouterr().out.split())
    assert "h1: shared_fs: h1, h2 see one workdir (a shared filesystem) without shared_fs in the inventory: mnft found it" in out
    assert "fix:" not in out and "nothing to do" not in out


def test_check_holds_declared_hosts_to_the_workdir_most_of_them_see_and_says_when_a_mark_could_not_be_left():
    from mnft.check.rules import shared_fs_problems
    from mnft.hosts.settings import Host

    hosts = [Host(name=n, rank=i, address=f"10.0.0.{i}", shared_fs=True) for i, n in enumerate(["h1", "h2", "h3"])]
    found = {"h2": ("h2", "h3"), "h3": ("h2", "h3")}
    assert [(p.host, p.message, p.severity) for p in shared_fs_problems(hosts, found)] == \
        [("h1", "declared shared_fs, but its workdir is not the one h2 sees", "error")]  # the odd one, not the two that agree
    # h1's mark failed: h1 sees nobody's, and nobody sees its own; that is said, and nobody is blamed
    assert [(p.host, p.message, p.severity) for p in shared_fs_problems(hosts, found, {"h1": "Read-only file system"})] == \
        [("h1", "declared shared_fs, not verified: no mark could be left beside its workdir (Read-only file system)", "warning")]


def data_tree(name: str) -> tuple:
    from mnft.hosts.fleet import HostResult, Status

    return HostResult(name, Status.OK), mirror.RemoteTree("/lab/data", "/root", False, None, {}, rsync="3.2.7")


def test_sync_data_holds_the_declared_hosts_and_those_found_sharing_with_them_to_one_copy():
    """shared_fs asserts that the declared hosts' data_dir is one directory: h3's mount is missing (the marks found
    only h1 and h2 together), so h3 verifies the one copy and fails, instead of a private copy on the disk under
    its mount point. h4 is not declared: detection alone decides for it, and for the code."""
    from mnft.hosts.inventory import parse
    from mnft.sync import rsync, source

    order = ["h1", "h2", "h3", "h4", "h5"]
    found = {"h1": ("h1", "h2"), "h2": ("h1", "h2"), "h4": ("h4", "h5"), "h5": ("h4", "h5")}
    joined = mirror.declared_group(order, found, ["h1", "h3"])
    assert joined == {**{n: ("h1", "h2", "h3") for n in ("h1", "h2", "h3")}, "h4": ("h4", "h5"), "h5": ("h4", "h5")}
    assert mirror.declared_group(order, {}, ["h2", "h3"]) == {"h2": ("h2", "h3"), "h3": ("h2", "h3")}  # nothing found
    assert mirror.declared_group(order, found, ["h3"]) == found  # one declared host asserts nothing

    inv = parse("hosts:\n" + "".join(f"  {n}: {{address: 10.0.0.{i}, data_dir: /lab/data, shared_fs: {str(n != 'h4').lower()}}}\n"
                                     for i, n in enumerate(["h1", "h2", "h3", "h4"], 1)))
    files = {"d.bin": (5, "e" * 64)}
    local = source.LocalTree(Path("/data"), (), treehash.digest_of(files), files, None)
    remote = {n: data_tree(n) for n in ("h1", "h2", "h3", "h4")}
    ssh = rsync.SshSettings(("/nonexistent/known_hosts",))
    shared = {"h1": ("h1", "h2"), "h2": ("h1", "h2")}

    def actions(kind: str) -> list[str]:
        return [p.action for p in mirror.plan(inv, local, remote, kind=kind, rules_file="/tmp/x", ssh=ssh, shared=shared)]

    assert actions("data") == ["rsync", "verify", "verify", "rsync"]
    assert actions("code") == ["rsync", "verify", "rsync", "rsync"]  # the code: what was found, declared or not


# ------------------------------------------------------------------------------------------------ train and data on shared storage


def mnft_cli(tmp_path, *args: str, cwd=None, timeout: float = 240):
    (tmp_path / "ctl").mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(tmp_path / "ctl"), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-c", "from mnft.cli.main import main; main()", *args], cwd=cwd or tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def records(tmp_path) -> list[dict]:
    return [json.loads((run / "run.json").read_text()) for run in sorted((tmp_path / "runs").glob("[!.]*"))]


@pytest.mark.cluster
@pytest.mark.slow
def test_a_recipe_on_a_shared_home_resumes_from_its_one_copy_of_the_checkpoint(fresh_cluster_factory, tmp_path):
    """lora on three hosts with one home: every rank saves its part into the one checkpoints directory; the resume
    finds that the hosts see one directory, reads it once and copies nothing (before: three listings and three
    hashes of the one directory, and with shared_fs declared nothing checked that it was one)."""
    cluster = fresh_cluster_factory(3, shared_home=("h1", "h2", "h3"))
    inv = str(cluster.write_inventory(tmp_path / "inv.yaml", shared_fs=True))
    first = mnft_cli(tmp_path, "train", "--recipe", "lora", "--hosts", inv, "--src", str(REPO),
                     "--set", "max_steps=4", "--set", "save_every=2", "--set", "log_every=1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    job_id = records(tmp_path)[-1]["job_id"]
    saved = cluster.hosts[0].home / "mnft" / "outputs" / job_id / "checkpoints" / "step-4"
    assert sorted(p.name for p in saved.iterdir()) == ["rank-0", "rank-1", "rank-2"]  # one directory, every rank's part

    resumed = mnft_cli(tmp_path, "train", "--resume", "--no-sync", "--src", str(REPO), "--set", "max_steps=6")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from step-4 (one directory for h1, h2, h3: read once, nothing copied)" in " ".join(resumed.stdout.split())
    record = records(tmp_path)[-1]
    assert record["checkpoint"]["shared"] == [["h1", "h2", "h3"]] and record["checkpoint"]["copied"] == {}
    assert record["attempts"][-1]["resumed_step"] == 4 and record["state"] == "succeeded"
    assert "step     5/6" in resumed.stdout and "step     4/6" not in resumed.stdout


@pytest.mark.cluster
@pytest.mark.slow
def test_hosts_that_share_only_the_data_directory_get_one_copy_of_the_data_and_train_on_it(fresh_cluster_factory, tmp_path):
    """A lab's NFS data mount on ~/mnft-data, the homes private: the marks beside it were in each private home, so
    nobody saw anybody's and three rsyncs wrote into the one directory (rsync exit 23 on the test bed). Now the
    data is written once, every host verifies it, a second sync sends nothing, and the recipe reads it on all."""
    cluster = fresh_cluster_factory(3, shared_dirs={"~/mnft-data": ("h1", "h2", "h3")})
    inv = str(cluster.write_inventory(tmp_path / "inv.yaml"))
    data = tmp_path / "data"
    data.mkdir()
    rows = (REPO / "mnft" / "recipes" / "assets" / "instruct.jsonl").read_text().splitlines()[:300]
    (data / "instruct.jsonl").write_text("\n".join(rows) + "\n")

    synced = mnft_cli(tmp_path, "sync", "--hosts", inv, "--data", str(data), "--json")
    assert synced.returncode == 0, synced.stdout[-3000:] + synced.stderr[-3000:]
    assert sorted(h["status"] for h in json.loads(synced.stdout)["hosts"].values()) == ["changed", "ok", "ok"]
    assert (cluster.shared_dir("~/mnft-data") / "instruct.jsonl").read_bytes() == (data / "instruct.jsonl").read_bytes()
    again = mnft_cli(tmp_path, "sync", "--hosts", inv, "--data", str(data), "--json")
    assert [h["status"] for h in json.loads(again.stdout)["hosts"].values()] == ["ok", "ok", "ok"]  # the marks are not data

    done = mnft_cli(tmp_path, "train", "--recipe", "lora", "--hosts", inv, "--src", str(REPO), "--set", "max_steps=2",
                    "--set", f"data_path={cluster.home_mountpoint}/mnft-data/instruct.jsonl")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "300 rows, world 3" in done.stdout


@pytest.mark.cluster
@pytest.mark.slow
def test_a_user_script_on_a_shared_home_recovers_from_its_one_copy_of_the_checkpoint(fresh_cluster_factory, tmp_path):
    """The HF Trainer example (a user's own script, not a recipe) on three hosts with one home, `--max-restarts 1`:
    its checkpoints are one directory every rank writes into; h3's rank is killed after a checkpoint, and attempt 2
    resumes from that one copy (read once, nothing copied), the steps after it trained once, on every host under
    its own run directory (spec, pgid, log: none shared between the three agents), and nothing is left running."""
    from runhelpers import add_hf_trainer_example, latest_record, wait_no_orphans

    cluster = fresh_cluster_factory(3, shared_home=("h1", "h2", "h3"))
    names = ["h1", "h2", "h3"]
    inv = str(cluster.write_inventory(tmp_path / "inv.yaml", slots=1))
    repo = tmp_path / "lab"  # the lab's project: the HF Trainer example and its job file, nothing of mnft's
    add_hf_trainer_example(repo)
    (tmp_path / "ctl").mkdir()
    env = dict(os.environ, HOME=str(tmp_path / "ctl"), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    # the job's 60 steps cut to 30 (the last --max_steps wins): checkpoints every 10, a loss line every 5
    proc = subprocess.Popen([sys.executable, "-c", "from mnft.cli.main import main; main()", "train", "--hosts", inv,
                             "--job", "jobs/hf_trainer.yaml", "--max-restarts", "1", "--backoff", "0.5", "--wait-for-lost", "1",
                             "--", "--max_steps", "30", "--step_sleep", "0.2"],
                            cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        outputs = cluster.hosts[0].home / "mnft" / "outputs"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not list(outputs.glob("*/checkpoint-10/trainer_state.json")):
            time.sleep(0.3)
        assert list(outputs.glob("*/checkpoint-10/trainer_state.json")), "no checkpoint-10 within 240 s"
        time.sleep(1.0)  # a few steps past the checkpoint: steps the restart trains again
        workers = [pid for pid, cmd in cluster.processes(cluster.hosts[2]) if "train_tiny.py" in cmd and "torch.distributed.run" not in cmd]
        assert workers, cluster.processes(cluster.hosts[2])
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    record = latest_record(tmp_path)
    run_id, job_id = record["run_id"], record["job_id"]
    assert record["state"] == "succeeded" and [a["state"] for a in record["attempts"]] == ["failed", "succeeded"]
    assert record["attempts"][0]["cause"]["host"] == "h3"

    # resumed from the one copy: found once for the three hosts, nothing copied, every rank pointed at it
    one, two = record["attempts"]
    resumed = two["resumed_step"]
    assert resumed and resumed % 10 == 0 and two["checkpoint"] == f"checkpoint-{resumed}", two
    flat = " ".join(out.split())
    assert f"resuming from checkpoint-{resumed} (one directory for h1, h2, h3: read once, nothing copied)" in flat, out[-4000:]
    assert record["checkpoint"]["shared"] == [names] and record["checkpoint"]["copied"] == {} and not record["checkpoint"]["warnings"]
    ckpt = f"{cluster.home_mountpoint}/mnft/outputs/{job_id}/checkpoint-{resumed}"
    for name in names:
        assert record["hosts"][name]["command"].endswith(f"--step_sleep 0.2 --resume_from_checkpoint {ckpt}"), record["hosts"][name]["command"]
    final = outputs / job_id / "checkpoint-30"  # one directory holding every rank's part: the model once, each rank's RNG state
    assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "rng_state_2.pth"} <= {p.name for p in final.iterdir()}
    assert json.loads((outputs / job_id / "trainer_state.json").read_text())["global_step"] == 30

    # the steps after the checkpoint trained once: one timeline, attempt 1 up to the checkpoint, then attempt 2
    assert two["steps"] == [resumed + 5, 30] and one["steps_lost"] == one["steps"][1] - resumed
    run_dir = tmp_path / "runs" / run_id
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(5, 31, 5))
    assert {m["attempt"] for m in metrics if "loss" in m and m["step"] > resumed} == {2}
    assert json.loads((run_dir / "summary.json").read_text())["last_step"] == 30

    # each host's run files are its own, in both attempts: spec, pgid, exit code and log under its own name
    remote = cluster.hosts[0].home / "mnft" / "runs"
    for number, aid, logs in ((1, run_id, run_dir / "attempt-1"), (2, f"{run_id}-a2", run_dir)):
        assert sorted(p.name for p in (remote / aid).iterdir()) == names
        specs = [json.loads((remote / aid / name / "spec.json").read_text()) for name in names]
        assert [s["tag"] for s in specs] == [f"{aid}@{name}" for name in names]
        assert [s["argv"][s["argv"].index("--node-rank") + 1] for s in specs] == ["0", "1", "2"]
        assert len({(remote / aid / name / "pgid").read_text() for name in names}) == 3
        codes = [(remote / aid / name / "exit_code").read_text().strip() for name in names]
        if number == 1:
            assert codes[2] != "0", codes  # the killed rank's host; the others were stopped by mnft
        else:
            assert codes == ["0", "0", "0"], codes
        for rank, name in enumerate(names):
            said = re.findall(r"rank (\d): resume_from_checkpoint=(\S+)", (logs / name / "run" / "output.log").read_text())
            assert said == [(str(rank), "None" if number == 1 else ckpt)], (number, name, said)

    wait_no_orphans(cluster, cluster.hosts, timeout=30, markers=("torch.distributed.run", "agent.payload", "mnft_boot", "train_tiny.py"))
