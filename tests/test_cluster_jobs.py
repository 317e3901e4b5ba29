"""A lab's own training code through mnft, on a real simulated cluster: the `mnft` command run from the user's
repository (a temporary git repo, not mnft's checkout), plain DDP, a module entry point with hostile arguments,
a rank that fails, a script with children, and an HF Trainer script resumed without a shared filesystem."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import runhelpers
from runhelpers import add_hf_trainer_example, latest_record, wait_for_output

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]  # the console command's entry point
MARKERS = ("torch.distributed.run", "agent.payload", "mnft_boot", "mnft-grandchild", "ddp.py", "spawner.py", "train_tiny.py", "userpkg")

DDP = '''\
import json, os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print("ARGV " + json.dumps(sys.argv[1:]), flush=True)
if os.environ.get("FAIL_RANK") == str(rank):
    raise ValueError(f"boom on rank {rank}")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
for step in range(1, int(os.environ.get("STEPS", "8")) + 1):
    x = torch.randn(32, 8, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if rank == 0:
        print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
dist.barrier()
dist.destroy_process_group()
'''

SPAWNER = '''\
import os, subprocess, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
child = [sys.executable, "-c", "import time; time.sleep(600)", "mnft-grandchild"]
subprocess.Popen(child)                                  # a plain child
subprocess.Popen(child, start_new_session=True)          # one that left the process group
if os.fork() == 0:                                       # a double-forked daemon
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, child)
    os._exit(0)
print(f"spawned rank {dist.get_rank()}", flush=True)
time.sleep(600)
'''


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def user_repo(tmp_path):
    """The lab's own project: a git repository with its training scripts, nothing of mnft's."""
    repo = tmp_path / "lab-project"
    (repo / "userpkg").mkdir(parents=True)
    (repo / "ddp.py").write_text(DDP)
    (repo / "spawner.py").write_text(SPAWNER)
    (repo / "userpkg" / "__init__.py").write_text("")
    # what matters here is how the arguments arrive, not a process group (gloo's teardown can abort a rank at
    # exit under load, torch's race, not ours): print them on every rank and exit
    (repo / "userpkg" / "train.py").write_text('import json, sys\nprint("ARGV " + json.dumps(sys.argv[1:]), flush=True)\n')
    return add_hf_trainer_example(repo)


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1", **extra)


def mnft(repo: Path, tmp_path: Path, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MNFT, *args], cwd=repo, env=cli_env(tmp_path, **env), capture_output=True, text=True, timeout=timeout)


def start_mnft(repo: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([*MNFT, *args], cwd=repo, env=cli_env(tmp_path, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_no_orphans(cluster, hosts, timeout: float = 40) -> None:
    runhelpers.wait_no_orphans(cluster, hosts, timeout, MARKERS)


def inventory(cluster, tmp_path, n, **overrides) -> str:
    return str(cluster.write_inventory(tmp_path / "inv.yaml", hosts=cluster.hosts[:n], slots=overrides.pop("slots", 1), **overrides))


# ------------------------------------------------------------------------------------------ tests


def test_a_plain_ddp_script_from_the_users_repo_trains_with_logs_and_metrics(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, 2)
    done = mnft(user_repo, tmp_path, "train", "--hosts", inv, "--env", "STEPS=8", "--", "ddp.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    run_dir = tmp_path / "runs" / record["run_id"]
    assert record["state"] == "succeeded" and record["job"]["kind"] == "script" and record["job"]["entry"] == ["ddp.py"]
    for name, rank in (("h1", 0), ("h2", 1)):
        assert "ARGV []" in (run_dir / name / "run" / "output.log").read_text()
        assert re.search(rf"^{name} r{rank} *\| ARGV \[\]", done.stdout, re.M)
    # the lab's tree was placed in the job's directory, not mnft's
    job = healthy_cluster.hosts[1].home / "mnft" / "outputs" / record["job_id"]
    assert (job / "ddp.py").is_file() and not (job / "mnft" / "recipes").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == 8 and summary["metrics_host"] == "h1" and isinstance(summary["final_loss"], float)
    assert (run_dir / "loss.png").stat().st_size > 0 and len((run_dir / "metrics.jsonl").read_text().splitlines()) == 8
    wait_no_orphans(healthy_cluster, healthy_cluster.hosts[:2])


ENDS_AT_ONCE = """\
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
print(f"rank {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
"""
# on h2 only (PYTHONPATH is the synced tree, this file is in it): its torchrun reaches the exit barrier last and then
# waits on it late, as a loaded host did; by then the master's torchrun has passed the barrier and closed its store
LINGERS = """\
import os, sys, time
if os.uname()[1] == "h2" and "torch.distributed.run" in sys.orig_argv:
    from torch.distributed.elastic.utils import store

    arrive = store._barrier_nonblocking

    def late(store, world_size, key_prefix):
        if "terminal_state" not in key_prefix:
            return arrive(store=store, world_size=world_size, key_prefix=key_prefix)
        time.sleep(1)
        key = arrive(store=store, world_size=world_size, key_prefix=key_prefix)
        time.sleep(2)
        return key

    store._barrier_nonblocking = late
"""


def test_two_hosts_ending_at_once_show_no_teardown_traceback_when_the_masters_store_closed_first(healthy_cluster, tmp_path, user_repo):
    (user_repo / "ends.py").write_text(ENDS_AT_ONCE)
    (user_repo / "sitecustomize.py").write_text(LINGERS)
    subprocess.run(["git", "-C", str(user_repo), "add", "-A"], check=True)
    inv = inventory(healthy_cluster, tmp_path, 2)
    done = mnft(user_repo, tmp_path, "train", "--hosts", inv, "--", "ends.py")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "Traceback" not in said and "DistNetworkError" not in said and "Error waiting" not in said, said[-3000:]
    assert re.search(r"^h2 +\| torchrun's teardown after every rank here finished met the master's closed store: not a failure "
                     r"\(\d+ line\(s\) kept in \S+/output.log on h2\)$", done.stdout, re.M), said[-3000:]
    record = latest_record(tmp_path)
    kept = (tmp_path / "runs" / record["run_id"] / "h2" / "run" / "output.log").read_text()
    assert "Error waiting on exit barrier" in kept and "Traceback" in kept  # the host's log keeps it whole
    assert record["state"] == "succeeded"


NASTY = ["two words", "it's \"quoted\"", "$(touch PWNED-sub)", "`touch PWNED-tick`", "a; touch PWNED-semi", "new\nline", "{output_dir}", "*"]


def test_a_module_entry_point_gets_hostile_arguments_verbatim_on_every_rank_and_runs_nothing(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, 2, slots=2)
    done = mnft(user_repo, tmp_path, "train", "--hosts", inv, "--env", "STEPS=2", "--", "-m", "userpkg.train", *NASTY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / latest_record(tmp_path)["run_id"]
    seen = {}
    for name in ("h1", "h2"):
        for line in (run_dir / name / "run" / "output.log").read_text().splitlines():
            match = re.match(r"^\[rank(\d)\]:ARGV (.*)$", line)
            if match:
                seen[int(match.group(1))] = json.loads(match.group(2))
    assert seen == {rank: NASTY for rank in range(4)}  # byte for byte, on every rank of every host
    places = [tmp_path, user_repo, Path("/tmp")] + [p for h in healthy_cluster.hosts[:2] for p in (h.home, h.home / "mnft", h.home / "mnft" / "outputs", h.root / "tmp")]
    assert not [p for place in places for p in place.glob("PWNED*")]


def test_a_rank_that_fails_tears_the_gang_down_naming_its_host_and_traceback(healthy_cluster, tmp_path, user_repo):
    inv = inventory(healthy_cluster, tmp_path, 3)
    done = mnft(user_repo, tmp_path, "train", "--hosts", inv, "--env", "FAIL_RANK=1", "--env", "STEPS=400", "--", "ddp.py")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"run \S+ failed: h2: torchrun exited with code 1 \(rank 1: ValueError: boom on rank 1\)", done.stdout + done.stderr), done.stdout[-3000:]
    assert re.search(r"h2 r1\| +raise ValueError", done.stdout)  # the traceback, labelled with host and rank
    record = latest_record(tmp_path)
    assert record["failed_host"] == "h2" and record["failed_rank"] == 1 and record["traceback"][-1] == "ValueError: boom on rank 1"
    wait_no_orphans(healthy_cluster, healthy_cluster.hosts[:3], timeout=30)


def test_a_script_with_children_leaves_none_after_stop_and_after_ctrl_c(healthy_cluster, tmp_path, user_repo):
    hosts = healthy_cluster.hosts[:2]
    inv = inventory(healthy_cluster, tmp_path, 2)
    started = mnft(user_repo, tmp_path, "train", "--hosts", inv, "--detach", "--", "spawner.py")
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    run_id = started.stdout.strip().splitlines()[-1]
    deadline = time.monotonic() + 120
    while sum("mnft-grandchild" in cmd for h in hosts for _, cmd in healthy_cluster.processes(h)) < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sum("mnft-grandchild" in cmd for h in hosts for _, cmd in healthy_cluster.processes(h)) == 6  # 3 per host
    stopped = mnft(user_repo, tmp_path, "stop", run_id, "--grace", "3")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    wait_no_orphans(healthy_cluster, hosts, timeout=5)

    proc = start_mnft(user_repo, tmp_path, "train", "--hosts", inv, "--", "spawner.py")  # its code already on the hosts: nothing sent
    wait_for_output(proc, r"spawned rank")
    deadline = time.monotonic() + 60
    while sum("mnft-grandchild" in cmd for h in hosts for _, cmd in healthy_cluster.processes(h)) < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=90)
    assert proc.returncode == 130
    wait_no_orphans(healthy_cluster, hosts, timeout=30)


def test_hf_trainer_metrics_and_resume_from_a_checkpoint_only_one_host_had(healthy_cluster, tmp_path, user_repo):
    hosts = healthy_cluster.hosts[:2]
    inv = inventory(healthy_cluster, tmp_path, 2)
    job = ["--job", "jobs/hf_trainer.yaml"]
    started = mnft(user_repo, tmp_path, "train", "--hosts", inv, *job, "--detach", "--", "--step_sleep", "0.3")
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    run_id = started.stdout.strip().splitlines()[-1]
    job_id = latest_record(tmp_path)["job_id"]
    outputs = [h.home / "mnft" / "outputs" / job_id for h in hosts]
    deadline = time.monotonic() + 240
    while not (outputs[0] / "checkpoint-20" / "trainer_state.json").is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (outputs[0] / "checkpoint-20" / "trainer_state.json").is_file(), "no checkpoint-20 within 240 s"
    stopped = mnft(user_repo, tmp_path, "stop", run_id)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    wait_no_orphans(healthy_cluster, hosts, timeout=10)
    latest = max(int(p.parent.name.split("-")[1]) for p in outputs[0].glob("checkpoint-*/trainer_state.json"))
    # no shared filesystem: the second host holds only its own RNG state of that checkpoint
    assert sorted(p.name for p in (outputs[1] / f"checkpoint-{latest}").iterdir()) == ["rng_state_1.pth"]

    done = mnft(user_repo, tmp_path, "train", "--resume", timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"resuming from checkpoint-{latest}: " in done.stdout and "file(s) to h2" in done.stdout
    resumed = latest_record(tmp_path)
    assert resumed["job_id"] == job_id and resumed["checkpoint"]["name"] == f"checkpoint-{latest}"
    for name in ("h1", "h2"):
        command = resumed["hosts"][name]["command"]
        assert command.endswith(f"--step_sleep 0.3 --resume_from_checkpoint /root/mnft/outputs/{job_id}/checkpoint-{latest}"), command
    # made whole before the launch: h2 got the model, optimizer, trainer state…; h1 got h2's RNG state
    assert resumed["checkpoint"]["copied"] == {"h1": 1, "h2": 8}
    assert re.search(rf"rank 0: resume_from_checkpoint=/root/mnft/outputs/{job_id}/checkpoint-{latest}", done.stdout)
    state = json.loads((outputs[0] / "trainer_state.json").read_text())
    assert state["global_step"] == 60
    run_dir = tmp_path / "runs" / resumed["run_id"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == 60 and isinstance(summary["final_loss"], float) and summary["final_loss"] < summary["initial_loss"]
    assert summary["metrics_source"].startswith("h1: ") and "trainer_state.json" in summary["metrics_source"]
    assert (run_dir / "loss.png").stat().st_size > 0
    assert re.search(r"progress: step ~\d+/60  loss", done.stdout)  # the dict lines became the progress line, the step from the bar


def test_hf_trainer_recovered_after_a_kill_tells_its_steps_and_time_truthfully(healthy_cluster, tmp_path, user_repo):
    """A rank of an HF Trainer script killed after a checkpoint; mnft restarts it from that checkpoint. The steps
    come from the epoch of its step-less lines, each attempt's own; the summary ends at the true last step."""
    hosts = healthy_cluster.hosts[:2]
    inv = inventory(healthy_cluster, tmp_path, 2)
    proc = subprocess.Popen([*MNFT, "train", "--hosts", inv, "--job", "jobs/hf_trainer.yaml", "--max-restarts", "1", "--backoff", "0.5",
                             "--", "--step_sleep", "0.2"],
                            cwd=user_repo, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list((hosts[0].home / "mnft" / "outputs").glob("*/checkpoint-20/trainer_state.json")):
        time.sleep(0.3)
    time.sleep(1.0)  # a few steps past the checkpoint: steps the restart trains again
    workers = [pid for pid, cmd in healthy_cluster.processes(hosts[1]) if "train_tiny.py" in cmd and "torch.distributed.run" not in cmd]
    assert workers, healthy_cluster.processes(hosts[1])
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    record = latest_record(tmp_path)
    one, two = record["attempts"]
    resumed = two["resumed_step"]
    assert resumed and resumed % 10 == 0 and two["steps"][0] == resumed + 5 and two["steps"][1] == 60
    assert one["steps_from"] == "metrics" and one["steps"][0] == 5 and one["steps"][1] >= resumed
    assert one["steps_lost"] == one["steps"][1] - resumed
    summary = json.loads((tmp_path / "runs" / record["run_id"] / "summary.json").read_text())
    assert summary["last_step"] == 60 and summary["first_step"] == 5
    metrics = [json.loads(line) for line in (tmp_path / "runs" / record["run_id"] / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if "loss" in m]
    assert steps == list(range(5, 61, 5))  # one kept timeline: attempt 1 up to the checkpoint, then attempt 2
    assert {m["attempt"] for m in metrics if "loss" in m and m["step"] > resumed} == {2}
    spent = record["time"]
    assert 0 < spent["goodput"] < 1 and spent["steps_lost"] == one["steps_lost"] and spent["restart_s"] > 0
    assert spent["attempts"][0]["detection_s"] is not None and spent["attempts"][1]["finish_s"] is not None
    assert "where the time went" in out and "goodput" in out
    # issue 36: the checkpoints each attempt saved, counted by the job's layout from its checkpoints directories (h1
    # keeps the newest 3, save_total_limit; h2's rank writes its RNG state into every one and never rotates them)
    saved = {p.name for h in hosts for p in (h.home / "mnft" / "outputs" / record["job_id"]).glob("checkpoint-*")}
    assert saved == {f"checkpoint-{n}" for n in range(10, 61, 10)}
    assert spent["checkpoints"] == len(saved) and [a["checkpoints"] for a in spent["attempts"]][0] >= 2, (saved, spent)
    assert sum(a["checkpoints"] for a in spent["attempts"]) == len(saved) and f"({len(saved)})" in out
    # the ending names the failure; the host mnft stopped is said to be stopped, its SIGTERM traceback kept out of sight
    assert re.search(r"attempt 1 failed: h2 rank 1 was killed by SIGKILL; h1 stopped by mnft", out), out[-3000:]
    assert "SignalException" not in out
