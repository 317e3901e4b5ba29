"""`mnft train --slurm` against a real Slurm (slurmctld, one slurmd per simulated host, munge: tests/slurmbed.py).

mnft runs inside h1 (a login node that shares its home with h2 and h3: the shared filesystem a Slurm run needs),
as a user would: sbatch, squeue, scontrol and scancel are Slurm's own. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MAIN = "import sys; sys.argv[0] = 'mnft'; from mnft.cli.main import main; main()"
SCRIPT = """\
import os, sys, time
rank, node = os.environ["RANK"], os.environ["GROUP_RANK"]
print(f"script rank={rank} node_rank={node} nodeid={os.environ.get('SLURM_NODEID')} host={os.uname()[1]} args={sys.argv[1:]}", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture
def slurm(slurm_bed):
    """The module's Slurm; afterwards every job cancelled and every node idle again (a killed slurmd restarted)."""
    try:
        yield slurm_bed
    finally:
        slurm_bed.reset()


def mnft(slurm, *args: str, timeout: float = 120):
    """`mnft ARGS` inside h1, from ~/ctl (its runs/ is on the shared home)."""
    h1 = slurm.cluster.hosts[0]
    return slurm.cluster.run(h1, ["sh", "-c", 'mkdir -p ctl && cd ctl && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN, *args],
                             env=slurm.env, check=False, timeout=timeout)


def home(slurm) -> Path:
    return slurm.cluster.hosts[0].home


def record(slurm, run_id: str) -> dict:
    return json.loads((home(slurm) / "ctl" / "runs" / run_id / "run.json").read_text())


def submitted(proc) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def wait_for(what, timeout: float, why: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(why)


def steps(slurm, run_id: str) -> list[int]:
    """The steps rank 0 has logged so far (the recipe's metrics.jsonl in the job's output dir)."""
    path = home(slurm) / "mnft" / "outputs" / run_id / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data.get("step"), int) and "loss" in data:
            out.append(data["step"])
    return out


def leftovers(slurm) -> dict[str, list[str]]:
    """Processes on each host other than its slurmd (the test bed's own are excluded by processes())."""
    return {h.name: [cmd for _, cmd in slurm.cluster.processes(h) if "slurmd -D" not in cmd] for h in slurm.cluster.hosts}


def test_a_recipe_runs_on_two_nodes_with_checks_logs_metrics_and_status(slurm):
    run_id = submitted(mnft(slurm, "train", "--slurm", "--detach", "--nodes", "2", "--recipe", "lora", "--set", "max_steps=6", "--set", "save_every=3"))
    follow = mnft(slurm, "logs", "-f", run_id, timeout=240)
    assert follow.returncode == 0, follow.stdout + follow.stderr
    assert "summary: steps 6" in follow.stdout
    data = record(slurm, run_id)
    assert data["state"] == "succeeded", data.get("reason")
    assert [a["hosts"] for a in data["attempts"]] == [["h1", "h2"]]
    assert {n: h["node_rank"] for n, h in data["hosts"].items()} == {"h1": 0, "h2": 1}
    assert data["master_addr"] == slurm.cluster.hosts[0].address  # the first node of the allocation, by its IPv4
    assert "--master-addr " + slurm.cluster.hosts[0].address in data["hosts"]["h2"]["command"]
    check = json.loads((home(slurm) / "ctl" / "runs" / run_id / "check-1.json").read_text())
    assert set(check["hosts"]) == {"h1", "h2"} and check["exit_code"] == 0
    assert check["hosts"]["h2"]["facts"]["modules"]["peft"] is True  # the job preflight: the recipe's imports resolve
    run_dir = home(slurm) / "ctl" / "runs" / run_id
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "loss.png").is_file()
    assert (run_dir / "h1" / "run" / "output.log").is_file() and (run_dir / "h2" / "run" / "output.log").is_file()
    assert list(run_dir.glob("slurm-*.out"))
    status = mnft(slurm, "status", run_id, "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    shown = json.loads(status.stdout)
    assert shown["slurm_state"] == "COMPLETED" and shown["run_state"] == "succeeded" and shown["last_step"] == 6
    assert leftovers(slurm) == {"h1": [], "h2": [], "h3": []}


def test_train_follows_the_job_to_its_end_by_default_and_a_user_script_gets_node_rank_from_slurm_nodeid(slurm):
    (home(slurm) / "proj").mkdir(exist_ok=True)
    (home(slurm) / "proj" / "train.py").write_text(SCRIPT)
    # as over SSH, the person at the terminal sees the job's lines and its end; the exit status is the job's
    followed = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                            "train", "--slurm", "--nodes", "2", "--", "train.py", "0", "a b"],
                                 env=slurm.env, check=False, timeout=240)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    run_id = re.search(r"^run (\S+): Slurm job \d+ submitted", followed.stdout, re.M).group(1)
    assert "following it to its end (Ctrl-C cancels it; --detach returns at once)" in followed.stdout
    assert "script rank=0 node_rank=0 nodeid=0 host=h1 args=['0', 'a b']" in followed.stdout
    assert "script rank=1 node_rank=1 nodeid=1 host=h2 args=['0', 'a b']" in followed.stdout
    assert re.search(rf"^run {run_id}: Slurm job \d+ COMPLETED \(exit 0:0\); run succeeded", followed.stdout, re.M), followed.stdout[-2000:]
    assert "Traceback" not in followed.stdout + followed.stderr


def test_a_workdir_the_nodes_do_not_see_is_found_by_the_check_step_before_anything_starts(slurm):
    (home(slurm) / "proj").mkdir(exist_ok=True)
    (home(slurm) / "proj" / "train.py").write_text(SCRIPT)
    # /tmp is each host's own: the login node (h1) syncs there, h2 never sees it
    (home(slurm) / "proj" / "lab.yaml").write_text(f"hosts:\n  t:\n    address: x\n    python: {slurm.cluster.python}\n    workdir: /tmp/mnft-private\n")
    followed = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                            "train", "--slurm", "--nodes", "2", "--hosts", "lab.yaml", "--", "train.py", "0"],
                                 env=slurm.env, check=False, timeout=240)
    assert followed.returncode == 1, followed.stdout + followed.stderr
    said = followed.stdout + followed.stderr
    assert "h2: workdir: /tmp/mnft-private does not exist on this node: the nodes do not see the login node's workdir" in said, said[-3000:]
    assert "set `workdir:` (in the --hosts inventory) to a directory on the shared filesystem" in said
    assert "does not exist (train places" not in said and "script rank=" not in said  # refused in the check: nothing started


FAILS = """\
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(2)
    sys.exit("rank 1 gives up: a bad batch")
time.sleep(120)
"""


def test_a_failed_slurm_run_shows_the_failing_rank_and_keeps_the_other_nodes_teardown_in_their_logs(slurm):
    (home(slurm) / "proj").mkdir(exist_ok=True)
    (home(slurm) / "proj" / "fails.py").write_text(FAILS)
    followed = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                            "train", "--slurm", "--nodes", "2", "--", "fails.py"],
                                 env=slurm.env, check=False, timeout=240)
    said = followed.stdout + followed.stderr
    assert followed.returncode == 1, said[-3000:]
    assert "rank 1 gives up: a bad batch" in said and re.search(r"run \S+ failed: h2: torchrun exited with code 1", said), said[-3000:]
    assert "SignalException" not in said and said.count("Traceback") <= 1, said[-4000:]  # the failing rank's own, at most
    assert re.search(r"h1: stopped with the gang \(\d+ line\(s\) of its shutdown in \S+/h1/run/output.log\)", said), said[-3000:]
    run_id = re.search(r"^run (\S+): Slurm job \d+ submitted", followed.stdout, re.M).group(1)
    kept = (home(slurm) / "proj" / "runs" / run_id / "h1" / "run" / "output.log").read_text()
    assert "SignalException" in kept or "Signal" in kept or "signal" in kept  # the teardown is in h1's log


def test_inside_an_salloc_allocation_train_slurm_runs_there_without_submitting(slurm):
    (home(slurm) / "proj").mkdir(exist_ok=True)
    (home(slurm) / "proj" / "train.py").write_text(SCRIPT)
    before = slurm.client(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split()
    inside = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", "salloc", "--nodes=2", slurm.cluster.python,
                                                          "-c", MAIN, "train", "--slurm", "--nodes", "2", "--", "train.py", "0", "in salloc"],
                               env=slurm.env, check=False, timeout=240)
    said = inside.stdout + inside.stderr
    assert inside.returncode == 0, said[-3000:]
    assert "script rank=0 node_rank=0 nodeid=0 host=h1 args=['0', 'in salloc']" in said
    assert "script rank=1 node_rank=1 nodeid=1 host=h2 args=['0', 'in salloc']" in said
    run_dir = max((home(slurm) / "proj" / "runs").glob("[!.]*"))
    data = json.loads((run_dir / "run.json").read_text())
    assert data["state"] == "succeeded" and data["slurm"]["inside"] is True
    allocations = slurm.client(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split()
    assert len(set(allocations) - set(before)) <= 1  # salloc's own allocation, and no batch job submitted
    assert not list(run_dir.glob("slurm-*.out"))  # no batch: the steps ran in salloc's allocation


def test_resume_with_slurm_continues_the_recorded_job_from_its_latest_checkpoint(slurm):
    first = mnft(slurm, "train", "--slurm", "--nodes", "2", "--recipe", "lora", "--set", "max_steps=8", "--set", "save_every=4",
                 "--set", "log_every=1", "--set", "debug_crash_after_step=6", timeout=240)
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    run_id = re.search(r"^run (\S+): Slurm job \d+ submitted", first.stdout, re.M).group(1)
    assert record(slurm, run_id)["state"] == "failed"
    again = mnft(slurm, "train", "--slurm", "--resume-run", run_id, "--set", "debug_crash_after_step=0", timeout=240)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = re.search(r"^run (\S+): Slurm job \d+ submitted", again.stdout, re.M).group(1)
    data = record(slurm, resumed)
    assert data["state"] == "succeeded" and data["resumed_from"] == run_id and data["job_id"] == record(slurm, run_id)["job_id"]
    assert "resuming from step-4" in again.stdout or "resuming from" in again.stdout, again.stdout[-3000:]
    assert sorted(set(steps(slurm, run_id))) == list(range(1, 9))  # one job: its metrics across both runs reach step 8


def test_ctrl_c_of_a_followed_slurm_run_cancels_its_job_and_leaves_nothing_on_any_node(slurm):
    (home(slurm) / "proj").mkdir(exist_ok=True)
    (home(slurm) / "proj" / "train.py").write_text(SCRIPT)
    follower = slurm.cluster.popen(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                             "train", "--slurm", "--nodes", "2", "--", "train.py", "300"],
                                   env=slurm.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: any("train.py" in c for c in leftovers(slurm)["h2"]), 90, "the script never ran on h2")
        follower.send_signal(signal.SIGINT)
        out, _ = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 130, out[-3000:]
    run_id = re.search(r"^run (\S+): Slurm job (\d+) submitted", out, re.M).group(1)
    assert "interrupted: cancelling Slurm job" in out and "Traceback" not in out
    data = json.loads((home(slurm) / "proj" / "runs" / run_id / "run.json").read_text())
    assert data["state"] == "interrupted" and slurm.client(["squeue", "-h", "-j", str(data["slurm_job_id"])], check=False).stdout.strip() == ""
    wait_for(lambda: leftovers(slurm) == {"h1": [], "h2": [], "h3": []}, 30, f"processes left after the cancel: {leftovers(slurm)}")


def test_stop_is_scancel_and_leaves_no_process_on_any_node(slurm):
    (home(slurm) / "proj").mkdir(exist_ok=True)
    (home(slurm) / "proj" / "train.py").write_text(SCRIPT)
    proc = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                        "train", "--slurm", "--detach", "--nodes", "2", "--", "train.py", "300"],
                             env=slurm.env, check=False, timeout=120)
    run_id = submitted(proc)
    runs = home(slurm) / "proj" / "runs" / run_id / "run.json"
    wait_for(lambda: json.loads(runs.read_text()).get("state") == "running" and any("train.py" in c for c in leftovers(slurm)["h2"]),
             90, "the script never ran on h2")
    stopped = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                           "stop", run_id], env=slurm.env, check=False, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "ended (CANCELLED)" in stopped.stdout
    wait_for(lambda: leftovers(slurm) == {"h1": [], "h2": [], "h3": []}, 30, f"processes left after scancel: {leftovers(slurm)}")


# the job's steps: the signal lands a few steps after the 5th (the poll, scancel, the batch telling the agents); every
# step past the saved one is trained again after the requeue, so more steps only make the test longer (150: ~25 s more)
WARNED_STEPS = 60


def test_the_warning_signal_saves_and_requeues_and_the_next_attempt_resumes(slurm):
    run_id = submitted(mnft(slurm, "train", "--slurm", "--detach", "--nodes", "2", "--requeue", "--signal", "USR2@60", "--recipe", "lora",
                            "--set", f"max_steps={WARNED_STEPS}", "--set", "save_every=1000", "--set", "log_every=1000"))
    job = record(slurm, run_id)["slurm_job_id"]
    wait_for(lambda: len(steps(slurm, run_id)) >= 5, 120, "the job never trained 5 steps")
    # what Slurm does at the warning time of --signal=B:USR2@60: the signal to the batch
    slurm.client(["scancel", "--batch", "--signal=USR2", job])
    follow = mnft(slurm, "logs", "-f", run_id, timeout=300)
    data = record(slurm, run_id)
    assert data["state"] == "succeeded", (data.get("reason"), follow.stdout[-3000:])
    first, second = data["attempts"]
    assert first["state"] == "saved" and first["decision"].startswith("requeued")
    assert second["resumed"] is True and second["slurm_job"] == job
    out = (home(slurm) / "ctl" / "runs" / run_id / "attempt-1" / "h1" / "run" / "output.log").read_text()
    saved = int(out.split("saved step-")[1].split(" ")[0])
    assert 5 <= saved < WARNED_STEPS
    resumed = (home(slurm) / "ctl" / "runs" / run_id / "h1" / "run" / "output.log").read_text()
    assert f"resuming from step-{saved}" in resumed or f"step-{saved}" in resumed
    assert sorted(set(steps(slurm, run_id))) == list(range(1, WARNED_STEPS + 1))  # every step once across the attempts


STEPS = """\
import os, sys, time
out, resume = sys.argv[1], "--resume" in sys.argv
rank, ckpt = int(os.environ["RANK"]), os.path.join(sys.argv[1], "step.txt")
os.makedirs(out, exist_ok=True)
step = int(open(ckpt).read()) if resume and os.path.exists(ckpt) else 0
print(f"start at step {step} resume={resume} host={os.uname()[1]}", flush=True)
first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
held = time.monotonic() + 300
while step < 40:
    # the first attempt must still run when Slurm notices the dead slurmd (~17 s here, longer on a loaded
    # machine): it stops at step 20 and waits, as a collective with a lost peer would, until the requeue ends it
    # (after 300 s it goes on and ends by itself: the test then fails on its one attempt, not on a timeout)
    if first and step >= 20 and time.monotonic() < held:
        time.sleep(0.5)
        continue
    time.sleep(0.25 if first else 0.1)
    step += 1
    if rank == 0:  # its checkpoint: the step reached, written whole
        open(ckpt + ".tmp", "w").write(str(step))
        os.replace(ckpt + ".tmp", ckpt)
"""
JOB = """\
script: steps.py
args: ["{output_dir}"]
resume: {layout: mnft, args: [--resume]}
metrics: {format: none}
"""


def steps_job_at_step_6(slurm):
    """The job-file script (STEPS, resume rule `layout: mnft`) submitted with --requeue on 2 nodes, once its
    checkpoint says step 6: (its project, the command prefix to run mnft there, the run id, the checkpoint)."""
    proj = home(slurm) / "steps"
    proj.mkdir(exist_ok=True)
    (proj / "steps.py").write_text(STEPS)
    (proj / "job.yaml").write_text(JOB)
    run = ["sh", "-c", 'cd steps && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN]
    run_id = submitted(slurm.cluster.run(slurm.cluster.hosts[0], run + ["train", "--slurm", "--detach", "--nodes", "2", "--requeue", "--job", "job.yaml"],
                                         env=slurm.env, check=False, timeout=120))
    ckpt = home(slurm) / "mnft" / "outputs" / run_id / "step.txt"
    wait_for(lambda: ckpt.is_file() and int(ckpt.read_text() or 0) >= 6, 120, "the job never reached step 6")
    return proj, run, run_id, ckpt


def test_a_node_lost_with_its_slurmd_requeues_the_job_which_resumes_from_its_checkpoint(slurm):
    proj, run, run_id, ckpt = steps_job_at_step_6(slurm)
    slurm.kill_slurmd(slurm.cluster.hosts[1])  # h2's daemon dies: Slurm marks the node down and requeues the job
    follow = slurm.cluster.run(slurm.cluster.hosts[0], run + ["logs", "-f", run_id], env=slurm.env, check=False, timeout=400)
    data = json.loads((proj / "runs" / run_id / "run.json").read_text())
    assert data["state"] == "succeeded", (data.get("reason"), follow.stdout[-3000:])
    first, second = data["attempts"]
    assert first["hosts"] == ["h1", "h2"] and second["hosts"] == ["h1", "h3"]  # h2 is down: the healthy nodes
    assert second["resumed"] is True
    out = (proj / "runs" / run_id / "h1" / "run" / "output.log").read_text()
    resumed_at = int(out.split("start at step ")[1].split(" ")[0])
    assert resumed_at >= 6 and "resume=True" in out
    assert int(ckpt.read_text()) == 40


@pytest.mark.parametrize("dies", ["machine", "ranks"])
def test_a_node_that_dies_with_its_job_processes_is_classified_as_over_ssh_and_the_job_requeued_to_resume(slurm, dies):
    """machine: its slurmd and every process of the job on it killed (the batch may see its task fail before Slurm
    marks the node down); ranks: the job's processes on h2 killed by a signal, the node up. Either way the failure is
    classified with the SSH path's causes and the job requeued (by the batch, within --max-restarts) and resumed."""
    proj, run, run_id, ckpt = steps_job_at_step_6(slurm)
    h2 = slurm.cluster.hosts[1]
    if dies == "machine":
        slurm.kill_slurmd(h2)
    for pid, _ in slurm.cluster.processes(h2):  # machine: slurmstepd, the agent, torchrun, the ranks; ranks: the run's
        try:
            if dies == "machine" or f"MNFT_RUN_ID={run_id}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                os.kill(pid, 9)
        except (ProcessLookupError, OSError):
            pass
    follow = slurm.cluster.run(slurm.cluster.hosts[0], run + ["logs", "-f", run_id], env=slurm.env, check=False, timeout=400)
    data = json.loads((proj / "runs" / run_id / "run.json").read_text())
    assert data["state"] == "succeeded", (data.get("reason"), follow.stdout[-3000:])
    first, second = data["attempts"][0], data["attempts"][-1]
    assert first["hosts"] == ["h1", "h2"] and second["resumed"] is True
    if dies == "ranks":  # the batch saw it: the SSH path's cause and decision, recorded
        assert first["cause"]["kind"] in ("signal", "failed") and first["decision"] == "restart 1 of 3", first
    else:  # either Slurm marked h2 down first and requeued the job itself, or the batch saw the failed task first and
        # requeued it by mnft's rules (the race the SSH path never has): never FAILED without a requeue
        assert "h2" not in second["hosts"]
        if first.get("cause") is not None:
            assert first["cause"]["kind"] in ("host-lost", "signal", "failed") and first["decision"].startswith("restart 1 of"), first
    out = (proj / "runs" / run_id / "h1" / "run" / "output.log").read_text()
    assert int(out.split("start at step ")[1].split(" ")[0]) >= 6 and int(ckpt.read_text()) == 40


@pytest.mark.parametrize("args, message", [
    (["--partition", "nosuch"], "--partition nosuch: no such partition (this Slurm has: debug)"),
    (["--nodes", "9"], "--nodes 9: partition debug has 3 node(s) (h1, h2, h3)"),
    (["--time", "soon"], "--time 'soon': use Slurm's format"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_submitted(slurm, args, message):
    before = slurm.client(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split()
    proc = mnft(slurm, "train", "--slurm", "--recipe", "lora", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert slurm.client(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split() == before  # no job submitted
    assert not (home(slurm) / "ctl" / "runs").is_dir() or not any(
        json.loads((p / "run.json").read_text()).get("slurm_job_id") is None for p in (home(slurm) / "ctl" / "runs").glob("[!.]*"))


def test_without_slurm_installed_train_slurm_is_refused(slurm):
    h1 = slurm.cluster.hosts[0]
    proc = slurm.cluster.run(h1, ["/bin/sh", "-c", '/bin/mkdir -p ctl && cd ctl && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                  "train", "--slurm", "--recipe", "lora"], env={**slurm.env, "PATH": "/nonexistent"}, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Slurm's client commands are not installed here" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
