"""Automatic recovery (`train --max-restarts N`) on the simulated cluster: a failed attempt is classified, the gang
restarted from the latest checkpoint (on the same hosts, with a spare in a lost host's place, or on fewer hosts),
and what cannot succeed by retrying is not retried.

The user-script tests use a tiny job whose failures are planned per attempt (MNFT_ATTEMPT) and whose "checkpoint"
is a progress file saved every other step; the recipe tests kill real lora workers and cut a real link.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runhelpers import latest_record, wait_for_output, wait_no_orphans

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]
MARKERS = ("torch.distributed.run", "agent.payload", "mnft_boot", "flaky.py", "broken.py", "mnft.recipes")
# the waits before a restart, short: these tests are about what is restarted where and from which step, not about
# waiting (a lost host is still probed once, and answers no sooner for a longer wait)
QUICK = ("--backoff", "0.5", "--wait-for-lost", "1")

FLAKY = '''\
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # every step is a collective: the ranks keep in step, as in real training
attempt, rank = int(os.environ["MNFT_ATTEMPT"]), dist.get_rank()
plan = json.loads(os.environ.get("PLAN", "{}")).get(str(attempt))  # [how, at step, on rank]
progress = os.path.join(os.environ["MNFT_OUTPUT_DIR"], f"progress-{rank}")
os.makedirs(os.path.dirname(progress), exist_ok=True)
start = int(open(progress).read()) if os.path.exists(progress) else 0
print(f"attempt {attempt} rank {rank} from step {start + 1}", flush=True)
for step in range(start + 1, int(os.environ.get("STEPS", "8")) + 1):
    if rank == 0:
        print(json.dumps({"step": step, "loss": 1.0 / step}), flush=True)
    if plan and step == plan[1] and rank == plan[2]:
        if plan[0] == "raise":
            raise RuntimeError(f"planned failure at step {step}")
        sys.exit(int(plan[0]))
    dist.all_reduce(torch.ones(1))
    if step % 2 == 0:
        with open(progress, "w") as fh:
            fh.write(str(step))
    time.sleep(0.1)
dist.barrier()
sys.stdout.flush()
os._exit(0)  # not gloo's teardown: under load it can abort a rank whose peers already left (torch's race)
'''

JOB = '''\
name: flaky
script: flaky.py
env:
  STEPS: "8"
resume:
  layout: none
  exit_codes: [124]
metrics:
  format: jsonl
'''


@pytest.fixture
def user_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "lab"
    repo.mkdir()
    (repo / "flaky.py").write_text(FLAKY)
    # imported by name at run time, as a plugin loader does: the preflight cannot see it, the run fails at startup
    (repo / "broken.py").write_text("import importlib\nimportlib.import_module('a_module_that_is_not_installed')\n")
    (repo / "job.yaml").write_text(JOB)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    return repo


def cli_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")


def mnft(cwd: Path, tmp_path: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([*MNFT, *args], cwd=cwd, env=cli_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def inventory(cluster, tmp_path, names, **overrides) -> str:
    hosts = [h for h in cluster.hosts if h.name in names]
    return str(cluster.write_inventory(tmp_path / "inv.yaml", hosts=hosts, slots=1, **overrides))


def flaky(repo: Path, tmp_path: Path, inv: str, plan: dict, *flags: str) -> subprocess.CompletedProcess:
    return mnft(repo, tmp_path, "train", "--hosts", inv, "--job", "job.yaml", "--env", "PLAN=" + json.dumps(plan), *QUICK, *flags)


def causes(record: dict) -> list[str | None]:
    return [(a.get("cause") or {}).get("kind") for a in record["attempts"]]


# ------------------------------------------------------------------------------------------------ user scripts


def test_a_script_that_fails_at_import_is_not_retried(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    done = mnft(user_repo, tmp_path, "train", "--hosts", inv, "--max-restarts", "3", "--", "broken.py")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    assert causes(record) == ["startup"] and len(record["attempts"]) == 1
    assert "a failure before the first step would fail again: not retried" in done.stdout + done.stderr
    assert "ModuleNotFoundError" in record["attempts"][0]["cause"]["detail"]


def test_the_same_failure_at_the_same_step_twice_stops_after_attempt_two(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    plan = {"1": ["raise", 3, 1], "2": ["raise", 3, 1], "3": ["raise", 3, 1]}  # progress is saved at even steps: 3 again
    done = flaky(user_repo, tmp_path, inv, plan, "--max-restarts", "3")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    assert causes(record) == ["failed", "failed"]
    assert record["attempts"][1]["decision"] == "the same failure at the same step as attempt 1: deterministic, not retried"
    assert all(a["cause"]["step"] == 3 and a["cause"]["host"] == "h2" for a in record["attempts"])
    run_dir = tmp_path / "runs" / record["run_id"]
    assert "attempt 1 rank 1 from step 1" in (run_dir / "attempt-1" / "h2" / "run" / "output.log").read_text()
    assert "attempt 2 rank 1 from step 3" in (run_dir / "h2" / "run" / "output.log").read_text()  # each attempt's own logs


def test_a_run_stopped_with_mnft_stop_says_stopped_and_is_never_restarted(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    proc = subprocess.Popen([*MNFT, "train", "--hosts", inv, "--job", "job.yaml", "--env", "STEPS=400", "--max-restarts", "2"],
                            cwd=user_repo, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_output(proc, r"progress: .*step 1\b|\{\"step\": 3")
    stopped = mnft(user_repo, tmp_path, "stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    record = latest_record(tmp_path)
    assert record["state"] == "stopped" and record["reason"].startswith("stopped by `mnft stop`")
    assert len(record["attempts"]) == 1 and record["attempts"][0]["state"] == "stopped"  # not restarted
    assert "stopped by `mnft stop`" in out and "failed" not in out.split("stopped by")[-1]
    wait_no_orphans(healthy_cluster, healthy_cluster.hosts[:2], markers=MARKERS)


def test_a_declared_resume_exit_code_restarts_without_using_up_max_restarts(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    plan = {"1": [124, 3, 1], "2": ["raise", 5, 0]}  # 124: the job asks to be resumed; then one real failure
    done = flaky(user_repo, tmp_path, inv, plan, "--max-restarts", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    assert causes(record) == ["resume-exit", "failed", None] and record["state"] == "succeeded"
    assert [a.get("counted") for a in record["attempts"][:2]] == [False, True]
    assert "(not counted against --max-restarts)" in done.stdout
    run_dir = tmp_path / "runs" / record["run_id"]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # the attempts' steps, each once (a step done again: the later attempt's)
    assert (run_dir / "loss.png").stat().st_size > 0


def test_used_up_restarts_exit_1_naming_each_attempts_cause(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    plan = {"1": ["raise", 3, 1], "2": ["raise", 6, 1]}
    done = flaky(user_repo, tmp_path, inv, plan, "--max-restarts", "1")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert re.search(r"attempt 1: h2 rank 1 exited with code 1: RuntimeError: planned failure at step 3; "
                     r"attempt 2: h2 rank 1 exited with code 1: RuntimeError: planned failure at step 6; "
                     r"--max-restarts 1 used up", out), out[-3000:]
    record = latest_record(tmp_path)
    assert record["state"] == "failed" and len(record["attempts"]) == 2
    assert record["attempts"][1]["resumed_step"] is None  # layout none: the script resumes itself
    wait_no_orphans(healthy_cluster, healthy_cluster.hosts[:2], 30, MARKERS)


def test_detach_with_max_restarts_on_a_lab_without_a_mesh_is_refused_with_the_fix_and_nothing_changes(healthy_cluster, tmp_path, user_repo):
    """Restarts of a detached run are its supervisor's on the lab, which reaches the hosts with the user's mesh key:
    with none, the run is refused, naming the fix; nothing was written on any host (tests/test_cluster_supervisor.py:
    with a mesh)."""
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    before = {h.name: sorted(p.name for p in h.home.iterdir()) for h in healthy_cluster.hosts[:2]}
    done = flaky(user_repo, tmp_path, inv, {}, "--max-restarts", "2", "--detach")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == ("mnft: --detach with --max-restarts needs a supervisor on the lab, and none can run: h1 has no mesh key "
                                   "(~/.ssh/mnft_mesh_ed25519) to reach the run's hosts as you: run `mnft setup --only mesh` once (as yourself) "
                                   "with an inventory of this lab")
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("[!.]*"))
    assert {h.name: sorted(p.name for p in h.home.iterdir()) for h in healthy_cluster.hosts[:2]} == before


@pytest.mark.parametrize("option, value", [("--backoff", "soon"), ("--backoff", "inf"), ("--wait-for-lost", "nan"), ("--wait-for-lost", "1e9")])
def test_a_bad_backoff_or_wait_for_a_lost_host_is_one_line_exit_2_before_any_host_is_touched(healthy_cluster, tmp_path, user_repo, option, value):
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    done = mnft(user_repo, tmp_path, "train", "--hosts", inv, "--job", "job.yaml", "--max-restarts", "2", option, value)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip() == f"mnft: {option} {value!r}: give seconds from 0 to 3600"
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("[!.]*"))


# ------------------------------------------------------------------------------------------------ the lora recipe


def recipe_args(inv: str, *extra: str, steps: int = 16) -> list[str]:
    return ["train", "--hosts", inv, "--src", str(REPO), "--set", f"max_steps={steps}", "--set", "log_every=2",
            "--set", "save_every=4", *QUICK, *extra]


def start_mnft(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*MNFT, *args], cwd=REPO, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def summary(tmp_path: Path, record: dict) -> dict:
    return json.loads((tmp_path / "runs" / record["run_id"] / "summary.json").read_text())


def workers(cluster, host) -> list[int]:
    return [pid for pid, cmd in cluster.processes(host) if "mnft.recipes.lora" in cmd and "torch.distributed.run" not in cmd]


def adapter_digest(host, record: dict) -> str:
    """sha256 of a finished run's adapters on a host (a byte diff of two safetensors files would take pytest minutes)."""
    return hashlib.sha256((host.home / "mnft" / "outputs" / record["job_id"] / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> dict:
    """The lora recipe's 16 steps on h1 and h2 (recipe_args) with no failure, run once for the module: the sha256
    of its adapters and its final loss, which a recovered run on the same two hosts must equal exactly."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    inv = inventory(cluster, tmp_path, ["h1", "h2"])
    done = mnft(REPO, tmp_path, *recipe_args(inv))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    return {"adapters": adapter_digest(cluster.hosts[0], record), "final_loss": summary(tmp_path, record)["final_loss"]}


def test_killed_workers_restart_on_the_same_hosts_from_the_checkpoint_with_the_uninterrupted_loss(healthy_cluster, tmp_path, uninterrupted):
    # two training hosts + a spare: the recovered run equals the uninterrupted one bit for bit (with three ranks
    # it agrees to ~1e-7 relative: see docs/recovery.md, "Exactness")
    h = {x.name: x for x in healthy_cluster.hosts}
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2", "h4"], spare={"h4": True})

    proc = start_mnft(tmp_path, *recipe_args(inv, "--max-restarts", "2"))
    wait_for_output(proc, r"step +6/16")
    for pid in workers(healthy_cluster, h["h2"]):
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    record = latest_record(tmp_path)
    first, second = record["attempts"]
    assert first["cause"]["kind"] == "signal" and first["cause"]["host"] == "h2" and "SIGKILL" in first["cause"]["detail"]
    assert second["hosts"] == ["h1", "h2"] and second["resumed_step"] >= 4 and second["checkpoint"] == f"step-{second['resumed_step']}"
    assert first["steps_lost"] == first["steps"][1] - second["resumed_step"] and second["steps"][0] == second["resumed_step"] + 1
    assert re.search(r"attempt 2/3: the same hosts", out), out[-3000:]
    # same world size, CPU: exactly the uninterrupted run's adapters, byte for byte, and its loss
    assert adapter_digest(h["h1"], record) == uninterrupted["adapters"]
    assert summary(tmp_path, record)["final_loss"] == uninterrupted["final_loss"]
    run_dir = tmp_path / "runs" / record["run_id"]
    assert (run_dir / "attempt-1" / "h2" / "run" / "output.log").is_file() and (run_dir / "loss.png").stat().st_size > 0
    assert not list(h["h4"].home.glob(f"mnft/outputs/{record['job_id']}/checkpoints/step-*"))  # the spare was not used


def newest_part(host, job_id: str, rank: int) -> int:
    parts = (host.home / "mnft" / "outputs" / job_id / "checkpoints").glob(f"step-*/rank-{rank}/meta.json")
    return max(int(p.parent.parent.name.split("-")[1]) for p in parts)


def test_a_save_cut_short_on_a_host_still_there_resumes_the_step_both_ranks_saved_and_equals_the_uninterrupted_run(healthy_cluster, tmp_path, uninterrupted):
    """A kill that lands while h2 writes step N leaves a temp dir where h2's part of N would be. The window is
    milliseconds wide, so the test makes that state by hand when the kill missed it. Resuming N would give h2's rank
    h1's replica and a new RNG stream for its dropout. The resume takes the step before, which both ranks saved,
    and finishes with the uninterrupted run's adapters, byte for byte."""
    h = {x.name: x for x in healthy_cluster.hosts}
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2"])
    proc = start_mnft(tmp_path, *recipe_args(inv))
    wait_for_output(proc, r"step +10/16")
    for pid in workers(healthy_cluster, h["h2"]):
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    job = latest_record(tmp_path)["job_id"]
    on_h1, on_h2 = newest_part(h["h1"], job, 0), newest_part(h["h2"], job, 1)
    if on_h1 == on_h2:  # the kill came between saves: cut h2's part of the newest step short
        step = h["h2"].home / "mnft" / "outputs" / job / "checkpoints" / f"step-{on_h2}"
        (step / "rank-1").rename(step / "rank-1.tmp-cut")
        expected = on_h2 - 4
    else:  # the kill came during h2's save
        assert on_h1 == on_h2 + 4
        expected = on_h2

    done = mnft(REPO, tmp_path, "train", "--src", str(REPO), "--resume")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resuming from step-{expected}" in done.stdout, done.stdout[-3000:]
    resumed = latest_record(tmp_path)
    assert adapter_digest(h["h1"], resumed) == uninterrupted["adapters"]
    assert summary(tmp_path, resumed)["final_loss"] == uninterrupted["final_loss"]


def test_a_host_cut_off_is_replaced_by_the_spare_and_left_with_nothing_running(healthy_cluster, tmp_path):
    h = {x.name: x for x in healthy_cluster.hosts}
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2", "h3", "h4"], spare={"h4": True})
    proc = start_mnft(tmp_path, *recipe_args(inv, "--max-restarts", "1", steps=12))
    wait_for_output(proc, r"step +6/12")
    healthy_cluster.link_down(h["h2"])
    try:
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out[-4000:]
        record = latest_record(tmp_path)
        first, second = record["attempts"]
        assert first["cause"]["kind"] == "host-lost" and first["cause"]["host"] == "h2"
        assert second["hosts"] == ["h1", "h4", "h3"] and second["resumed_step"] >= 4
        assert "h2 replaced by the spare h4" in out
        assert second["steps"][0] == second["resumed_step"] + 1  # continued from the checkpoint, not restarted
        assert summary(tmp_path, record)["last_step"] == 12
    finally:
        healthy_cluster.link_up(h["h2"])
    wait_no_orphans(healthy_cluster, [h["h2"]], 40, MARKERS)  # its own agent tore its part down (dead-man switch)


def test_a_lost_host_without_a_spare_shrinks_an_elastic_gang_down_to_min_nodes(healthy_cluster, tmp_path):
    # the lora recipe is elastic: attempt 2 runs on the 2 hosts left, its adapters resharded from 3 ranks' checkpoint
    h = {x.name: x for x in healthy_cluster.hosts}
    inv = inventory(healthy_cluster, tmp_path, ["h1", "h2", "h3"])
    proc = start_mnft(tmp_path, *recipe_args(inv, "--max-restarts", "1", "--min-nodes", "2", steps=12))
    wait_for_output(proc, r"step +6/12")
    healthy_cluster.link_down(h["h3"])
    try:
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out[-4000:]
        record = latest_record(tmp_path)
        first, second = record["attempts"]
        assert first["cause"]["kind"] == "host-lost" and first["cause"]["host"] == "h3"
        assert "h3 dropped: continuing on 2 hosts" in out
        assert second["hosts"] == ["h1", "h2"] and second["resumed_step"] >= 4
        assert second["steps"][0] == second["resumed_step"] + 1 and summary(tmp_path, record)["last_step"] == 12
        assert "world size 2" in out.split("attempt 2/2", 1)[1]
    finally:
        healthy_cluster.link_up(h["h3"])
    wait_no_orphans(healthy_cluster, [h["h3"]], 40, MARKERS)
