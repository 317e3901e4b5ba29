"""Issue 43 on the simulated cluster: sweeps and dependencies through a line that stays fair, as members who are not
root.

Two hosts h1, h2 with 4 stand-in GPUs each; bob (with his mesh: his sweeps' supervisor runs on h1) and alice. Each
sweep is handed over and bob's controller is killed (kill -9): the sweep goes on on the lab alone. Every point's
script prints its own values, rank 0 a jsonl step record per step, then holds its GPU until the test says so (a
file /tmp/mnft-test-end-<tag> on its host), and exits with the code its --exit says."""

from __future__ import annotations

import json
import re
import time

import pytest
from fakegpu import HOLD_UNTIL_TOLD, RANK_SNIPPET
from test_cluster_supervisor import Member, end, host_log, wait_gone

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

POINT = RANK_SNIPPET + '''
import json, os, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
print("values " + " ".join(f"{k}={v}" for k, v in sorted(args.items()) if k in ("--lr", "--seed")), flush=True)
lr = float(args.get("--lr", "1"))
for step in range(1, 4):
    print(json.dumps({"step": step, "loss": lr / step}), flush=True)
if args.get("--tag"):
    end = "/tmp/mnft-test-end-" + args["--tag"]
    deadline = time.time() + 300
    while not os.path.exists(end) and time.time() < deadline:
        time.sleep(0.2)
sys.exit(3 if os.path.exists("/tmp/mnft-test-fail-" + args.get("--seed", "none")) else int(args.get("--exit", "0")))
'''


@pytest.fixture(scope="module")
def lab(testbed, tmp_path_factory):
    work = tmp_path_factory.mktemp("sweep-lab")
    with testbed.Cluster.create(2, work, outsider=False, gpus=4) as cluster:
        for name in ("bob", "alice"):
            cluster.add_user(name, password="not used", torch=True)
        yield cluster


class Sweeper(Member):
    def __init__(self, cluster, tmp_path, user):
        super().__init__(cluster, tmp_path, user)
        (self.src / "point.py").write_text(POINT)
        (self.src / "hold.py").write_text(HOLD_UNTIL_TOLD)

    def sweep(self, *args: str) -> str:
        """`mnft train --sweep …`, then every mnft process of this controller killed: the sweep's id."""
        out = self.ok("train", "--hosts", self.inventory, "--src", str(self.src), *args)
        [sweep_id] = re.findall(r"^sweep (\S+) \(\d+ point\(s\)", out, re.M)
        self.kill_controller()
        return sweep_id

    def status(self, sweep_id: str) -> dict:
        done = self.mnft("status", sweep_id, "--json")
        return json.loads(done.stdout)

    def until(self, sweep_id: str, what, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            data = self.status(sweep_id)
            if what(data) or time.monotonic() > deadline:
                assert what(data), json.dumps(data, indent=1)[-4000:] + self.console(sweep_id)[-3000:]
                return data
            time.sleep(1)


def states(data: dict) -> list[str]:
    return [p["state"] for p in data["points"]]


def point_output(cluster, user: str, point: dict) -> str:
    host = next(h for h in cluster.hosts if point["where"].startswith(h.name))
    return host_log(cluster, host, user, point["run_id"])


@pytest.fixture(scope="module")
def bob(lab, tmp_path_factory) -> Sweeper:
    member = Sweeper(lab, tmp_path_factory.mktemp("bob"), "bob")
    member.mesh()
    return member


def test_a_six_point_one_gpu_sweep_runs_four_at_once_then_the_other_two_each_point_with_its_own_values(lab, bob):
    sweep_id = bob.sweep("--sweep", "lr=1,2,3", "--sweep", "seed=1,2", "--gpus", "1", "--max-parallel", "4",
                         "--", "point.py", "--lr", "{lr}", "--seed", "{seed}", "--tag", "six")
    data = bob.until(sweep_id, lambda d: states(d).count("running") == 4)
    assert states(data).count("pending") == 2  # in the sweep's own queue: no place in any host's line
    held = [r for r in json.loads(bob.ok("lab", "--hosts", bob.inventory, "--json"))["devices"] if (r.get("run") or "").startswith(sweep_id)]
    assert len(held) == 4 and not [r for r in held if r.get("state") == "waiting"]
    end(lab, "six", lab.hosts)
    record = bob.wait(sweep_id)
    assert record["state"] == "succeeded", record.get("reason")
    data = bob.status(sweep_id)
    assert states(data) == ["succeeded"] * 6
    assert [p["values"] for p in data["points"]] == [{"lr": lr, "seed": seed} for lr in "123" for seed in "12"]
    for point in data["points"]:  # each point's script got its own values, and its curve is its own
        assert f"values --lr={point['values']['lr']} --seed={point['values']['seed']}" in point_output(lab, "bob", point)
        assert point["step"] == 3 and point["last"] == pytest.approx(float(point["values"]["lr"]) / 3)
    assert data["best"] == data["points"][0]["run_id"]  # the lowest loss: lr=1
    table = bob.ok("status", sweep_id)
    assert "★ 1" in table and "6 point(s): 6 succeeded" in table
    wait_gone(lab, lab.hosts, bob.uid())


def test_stop_of_a_sweep_stops_its_running_points_and_starts_none_of_the_others(lab, bob):
    sweep_id = bob.sweep("--sweep", "seed=1,2,3,4", "--gpus", "1", "--max-parallel", "2", "--", "point.py", "--seed", "{seed}", "--tag", "never")
    data = bob.until(sweep_id, lambda d: states(d).count("running") == 2)
    first = data["points"][0]["run_id"]
    one = bob.mnft("stop", first)  # one point alone: the sweep starts the next in its place
    assert one.returncode == 0, one.stdout + one.stderr
    data = bob.until(sweep_id, lambda d: states(d) == ["stopped", "running", "running", "pending"])
    assert "mnft stop" in json.loads((bob.dir / "runs" / first / "run.json").read_text())["reason"]
    stopped = bob.mnft("stop", sweep_id)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    data = bob.status(sweep_id)
    assert data["state"] == "stopped" and states(data) == ["stopped"] * 4
    assert "before this point started" in data["points"][3]["reason"]
    wait_gone(lab, lab.hosts, bob.uid())


def test_a_sweep_whose_one_point_fails_runs_the_others_and_resume_run_reruns_only_that_point(lab, bob):
    for host in lab.hosts:
        (host.root / "tmp" / "mnft-test-fail-2").write_text("")
    sweep_id = bob.sweep("--sweep", "seed=1,2,3", "--gpus", "1", "--", "point.py", "--seed", "{seed}")
    record = bob.wait(sweep_id)
    data = bob.status(sweep_id)
    assert record["state"] == "failed" and states(data) == ["succeeded", "failed", "succeeded"]
    assert "3 point(s): 2 succeeded, 1 failed" in record["reason"]
    for host in lab.hosts:
        (host.root / "tmp" / "mnft-test-fail-2").unlink()
    again = bob.ok("train", "--resume-run", sweep_id)
    assert "running again 1 of 3 point(s)" in again
    [rerun] = re.findall(r"^sweep (\S+) \(1 point\(s\)", again, re.M)
    record = bob.wait(rerun)
    data = bob.status(rerun)
    assert record["state"] == "succeeded" and [p["values"] for p in data["points"]] == [{"seed": "2"}]
    assert data["points"][0]["run_id"].endswith("-2") or data["points"][0]["run_id"].endswith("-02")
    wait_gone(lab, lab.hosts, bob.uid())


def test_after_starts_a_run_once_the_first_succeeded_and_ends_one_whose_first_failed_with_the_reason(lab, bob):
    first = bob.detach("--gpus", "1", "--", "point.py", "--lr", "1", "--tag", "first")
    second = bob.detach("--gpus", "1", "--after", first, "--", "point.py", "--lr", "2")
    record = bob.record(second)
    assert record["state"] == "waiting" and record["reason"] == f"after run {first}"
    lab_rows = json.loads(bob.ok("lab", "--hosts", bob.inventory, "--json"))["devices"]
    assert not [r for r in lab_rows if r.get("run") == second]  # no place in any host's line meanwhile
    end(lab, "first", lab.hosts)
    assert bob.wait(first)["state"] == "succeeded"
    record = bob.wait(second)
    assert record["state"] == "succeeded", record.get("reason")

    failing = bob.detach("--gpus", "1", "--", "point.py", "--exit", "3", "--tag", "failing")
    dependent = bob.detach("--gpus", "1", "--after", failing, "--", "point.py", "--lr", "2")
    anyway = bob.detach("--gpus", "1", "--after", f"{failing}:any", "--", "point.py", "--lr", "3")
    end(lab, "failing", lab.hosts)
    assert bob.wait(failing)["state"] == "failed"
    record = bob.wait(dependent)
    assert record["state"] == "dependency-failed" and f"run {failing} ended failed, not succeeded" in record["reason"]
    assert not record.get("hosts")  # it never ran
    assert bob.wait(anyway)["state"] == "succeeded"
    late = bob.mnft("train", "--hosts", bob.inventory, "--src", str(bob.src), "--detach", "--after", failing, "--", "point.py")
    assert late.returncode == 1 and f"run {failing} ended failed, not succeeded" in late.stderr and "nothing was started" in late.stderr
    wait_gone(lab, lab.hosts, bob.uid())


def test_a_second_users_run_submitted_after_the_sweep_started_goes_before_its_remaining_points_under_a_limit_of_2(lab, bob, tmp_path):
    rules = [d / "mnft-lab.yaml" for h in lab.hosts for d in (h.root / "run" / "lock", h.root / "tmp") if d.is_dir()]  # the admin's
    for path in rules:
        path.write_text("max_gpus_while_others_wait: 2\n")
        path.chmod(0o644)
    alice = Sweeper(lab, tmp_path, "alice")
    try:
        seeds = ",".join(str(n) for n in range(1, 11))
        sweep_id = bob.sweep("--sweep", f"seed={seeds}", "--gpus", "1", "--", "point.py", "--seed", "{seed}", "--tag", "fair{seed}")
        data = bob.until(sweep_id, lambda d: states(d).count("running") == 8)
        hers = alice.start("train", "--hosts", alice.inventory, "--src", str(alice.src), "--gpus", "1", "--nodes", "1", "--wait", "--", "hold.py", "alice-f")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = json.loads(alice.ok("lab", "--hosts", alice.inventory, "--json"))
            if [r for r in rows["devices"] if r.get("user") == "alice" or "alice" in json.dumps(r)]:
                break
            time.sleep(1)
        users = {u["user"]: u for u in rows.get("users") or []}
        assert users["bob"]["gpus_held"] == 8 and users["alice"]["waiting"] == 1, rows.get("users")
        h1_points = [p for p in data["points"] if p["state"] == "running" and p["where"].startswith("h1")]
        end(lab, f"fair{h1_points[0]['values']['seed']}", [lab.hosts[0]])  # one GPU of h1 frees up
        deadline = time.monotonic() + 60
        while "mnft-test: rank 0" not in "".join(host_log(lab, h, "alice", r) for h in lab.hosts[:1] for r in _runs(alice)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "mnft-test: rank 0" in "".join(host_log(lab, lab.hosts[0], "alice", r) for r in _runs(alice))  # hers started on h1
        data = bob.status(sweep_id)
        assert states(data).count("running") == 7 and states(data).count("succeeded") == 1  # his next point did not take it
    finally:
        for path in rules:
            path.unlink(missing_ok=True)
        end(lab, "alice-f", lab.hosts)
        for n in range(1, 11):
            end(lab, f"fair{n}", lab.hosts)
    assert hers.wait(timeout=120) == 0
    assert bob.wait(sweep_id)["state"] == "succeeded"
    wait_gone(lab, lab.hosts, bob.uid())


def _runs(member) -> list[str]:
    runs = member.dir / "runs"
    return [p.name for p in runs.iterdir() if (p / "run.json").is_file()] if runs.is_dir() else []
