"""invoke train across a real simulated cluster: ranks, logs, gang teardown, Ctrl-C, detach/stop, secrets.

Each test runs the real CLI as a subprocess against hosts in network namespaces, with the CPU lora recipe and a
few steps. "No orphan" is checked inside every host's namespace: no process of the run is left.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runhelpers import (
    latest_record,
    run_processes,
    wait_for_output,
    wait_listening,
    wait_no_orphans,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def cli_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")


def invoke(tmp_path: Path, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(REPO), *args],
        cwd=REPO, env=env or cli_env(tmp_path), capture_output=True, text=True, timeout=timeout,
    )


def start_invoke(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "invoke", "-r", str(REPO), *args],
        cwd=REPO, env=env or cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def latest_complete_checkpoint(cluster, hosts, job_id: str) -> int | None:
    """The newest step every rank saved completely (its rank-R/meta.json), read on the hosts' disks: what a resume
    on the same hosts continues from (a step whose save a kill cut short on one host is passed over, so that
    every rank goes on with its own state and RNG stream)."""
    steps = None
    for rank, host in enumerate(hosts):  # one process per host: host i holds rank i
        root = host.home / "mnft" / "outputs" / job_id / "checkpoints"
        mine = {int(p.parent.parent.name.split("-")[1]) for p in root.glob(f"step-*/rank-{rank}/meta.json")}
        steps = mine if steps is None else steps & mine
    return max(steps) if steps else None


@pytest.fixture
def trained_cluster(healthy_cluster, tmp_path):
    """The session cluster (train syncs mnft's code to every host's workdir itself)."""
    yield healthy_cluster  # healthy_cluster kills whatever a failed test left behind


def inventory(cluster, tmp_path, n, slots=1, **overrides) -> str:
    return str(cluster.write_inventory(tmp_path / "inv.yaml", hosts=cluster.hosts[:n], slots=slots, **overrides))


def train_args(inv: str, *extra: str, steps: int = 12) -> list[str]:
    return ["train", "--hosts", inv, "--src", str(REPO), "--set", f"max_steps={steps}", "--set", "log_every=2", *extra]


def test_two_hosts_one_process_each_complete_with_logs_from_every_host(trained_cluster, tmp_path):
    inv = inventory(trained_cluster, tmp_path, 2)
    done = invoke(tmp_path, *train_args(inv))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    run_dir = tmp_path / "runs" / record["run_id"]
    assert record["state"] == "succeeded"
    assert {h: v["node_rank"] for h, v in record["hosts"].items()} == {"h1": 0, "h2": 1}
    assert all(v["exit_code"] == 0 for v in record["hosts"].values())
    for name in ("h1", "h2"):
        assert (run_dir / name / "run" / "output.log").is_file()
    assert "node_rank=0" in (run_dir / "h1" / "run" / "output.log").read_text()
    assert "node_rank=1" in (run_dir / "h2" / "run" / "output.log").read_text()
    assert (run_dir / "loss.png").stat().st_size > 0
    assert "--master-addr " + trained_cluster.hosts[0].address in record["hosts"]["h2"]["command"]
    assert record["hosts"]["h2"]["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert re.search(r"h2 r1 *\| rank=1/2 node_rank=1", done.stdout)


def test_three_hosts_two_processes_each_get_distinct_ranks(trained_cluster, tmp_path):
    inv = inventory(trained_cluster, tmp_path, 3, slots=2)
    done = invoke(tmp_path, *train_args(inv, steps=6))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = sorted(int(r) for r in re.findall(r"\| rank=(\d)/6 ", done.stdout))  # the ranks' own lines, not a progress line quoting one
    assert ranks == [0, 1, 2, 3, 4, 5]
    assert re.search(r"h3 r5 *\| rank=5/6 node_rank=2 local_rank=1", done.stdout)
    record = latest_record(tmp_path)
    run_dir = tmp_path / "runs" / record["run_id"]
    assert record["state"] == "succeeded"
    assert {h: (v["node_rank"], v["state"], v["exit_code"]) for h, v in record["hosts"].items()} == {
        "h1": (0, "exited", 0), "h2": (1, "exited", 0), "h3": (2, "exited", 0)}
    for node, name in enumerate(("h1", "h2", "h3")):
        output = (run_dir / name / "run" / "output.log").read_text()
        for local in (0, 1):
            assert f"rank={2 * node + local}/6 node_rank={node} local_rank={local}" in output
        assert (run_dir / name / "run" / "exit_code").read_text().strip() == "0"
        assert len(list((run_dir / name / "run" / "torchrun").rglob("stdout.log"))) == 2  # per-rank logs
    assert (run_dir / "loss.png").stat().st_size > 0


def test_c10d_labels_each_line_with_the_rank_torch_chose_and_follows_rank_0_wherever_it_runs(trained_cluster, tmp_path):
    # different slots and the master last in the inventory: with c10d torch, not the inventory, orders the ranks
    inv = inventory(trained_cluster, tmp_path, 2, slots={"h1": 1, "h2": 2}, master="h2")
    done = invoke(tmp_path, *train_args(inv, "--rdzv", "c10d", steps=6))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    labelled = re.findall(r"^(h\d) r(\d) *\| rank=(\d)/3 node_rank=(\d) local_rank=(\d)", done.stdout, re.M)
    assert sorted(int(rank) for _, _, rank, _, _ in labelled) == [0, 1, 2], done.stdout[-3000:]
    assert all(label == rank for _, label, rank, _, _ in labelled)  # the label is the worker's own RANK
    assert sorted(host for host, *_ in labelled) == ["h1", "h2", "h2"]
    record = latest_record(tmp_path)
    run_dir = tmp_path / "runs" / record["run_id"]
    rank0_host = next(host for host, _, rank, _, _ in labelled if rank == "0")
    assert (run_dir / rank0_host / "extra" / "0" / "metrics.jsonl").is_file() and (run_dir / "loss.png").stat().st_size > 0
    assert "first_step_s" in record["timings"]  # rank 0's metrics were followed on its host
    assert "summary: loss" in done.stdout


def test_train_refuses_a_check_mismatch_naming_host_and_field_and_force_overrides(trained_cluster, tmp_path):
    drifted = trained_cluster.hosts[1]
    # h2's interpreter reports torch 9.9.9 to the check (as in test_cluster_check: a fake torch package first on
    # PYTHONPATH) but runs `python -m torch.distributed.run` with the real one, so a forced launch can train
    fake = drifted.home / "mnft-test-train-fake-torch"
    package = fake / "site" / "torch"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "version.py").write_text("__version__ = '9.9.9'\ncuda = None\ngit_version = 'fake'\n")
    dist = fake / "site" / "torch-9.9.9.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    wrapper = fake / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"if [ \"$1\" = -m ]; then exec {shlex.quote(trained_cluster.python)} \"$@\"; fi\n"
        f"PYTHONPATH=/root/mnft-test-train-fake-torch/site exec {shlex.quote(trained_cluster.python)} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    try:
        inv = inventory(trained_cluster, tmp_path, 2, python={drifted.name: "/root/mnft-test-train-fake-torch/python"})
        refused = invoke(tmp_path, *train_args(inv, steps=2))
        assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert re.search(r"check failed on h2 \(h2: torch: .*9\.9\.9.*\); fix it or pass --force", refused.stderr), refused.stderr
        record = latest_record(tmp_path)
        assert record["state"] == "refused" and record["launched"] is False and record["hosts"] == {}
        assert {(p["host"], p["field"]) for p in record["check"]["problems"] if p["severity"] == "error"} == {("h2", "torch")}
        for host in trained_cluster.hosts[:2]:
            assert not (host.home / "mnft" / "runs" / record["run_id"]).exists()  # nothing was started

        forced = invoke(tmp_path, *train_args(inv, "--force", steps=2))
        assert forced.returncode == 0, forced.stdout[-3000:] + forced.stderr[-3000:]
        record = latest_record(tmp_path)
        assert record["state"] == "succeeded" and record["check"]["forced"] is True
    finally:
        subprocess.run(["rm", "-rf", str(fake)], check=True)


def test_killed_torchrun_tears_down_every_host_and_resume_finishes(trained_cluster, tmp_path):
    inv = inventory(trained_cluster, tmp_path, 3)
    steps = ["--set", "save_every=4"]
    proc = start_invoke(tmp_path, *train_args(inv, *steps, steps=400))
    wait_for_output(proc, r"step +6/")
    victim = trained_cluster.hosts[1]
    torchrun = [pid for pid, cmd in trained_cluster.processes(victim) if "torch.distributed.run" in cmd]
    assert torchrun
    os.kill(torchrun[0], signal.SIGKILL)
    wait_no_orphans(trained_cluster, trained_cluster.hosts[:3], timeout=30)  # every host clean within 30 s
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1
    assert "h2: torchrun exited with code 137" in out
    first = latest_record(tmp_path)
    assert first["failed_host"] == "h2" and first["state"] == "failed"
    assert first["hosts"]["h2"]["exit_code"] == 137
    latest = latest_complete_checkpoint(trained_cluster, trained_cluster.hosts[:3], first["job_id"])
    assert latest is not None and latest >= 4

    # --resume alone: the hosts file, the overrides and the env names come from the failed run's record
    done = invoke(tmp_path, "train", "--src", str(REPO), "--resume", "--set", "max_steps=" + str(latest + 4))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resuming run {first['run_id']}: reusing --hosts {inv} --set log_every=2 --set save_every=4" in done.stdout
    resumed = latest_record(tmp_path)
    assert resumed["job_id"] == first["job_id"] and resumed["resume"] is True and resumed["resumed_from"] == first["run_id"]
    assert resumed["inventory"]["path"] == inv
    assert re.search(rf"resuming from \S+/checkpoints/step-{latest}\b", done.stdout), done.stdout[-3000:]
    assert f"step {latest + 2:>5}/{latest + 4}" in done.stdout and f"step {latest:>5}/{latest + 4}" not in done.stdout
    assert resumed["timings"]["first_step_s"] > 0


def test_cut_link_tears_down_the_gang_and_leaves_no_orphan(trained_cluster, tmp_path):
    inv = inventory(trained_cluster, tmp_path, 2)
    proc = start_invoke(tmp_path, *train_args(inv, steps=400))
    wait_for_output(proc, r"step +4/")
    cut = trained_cluster.hosts[1]
    assert run_processes(trained_cluster, [cut])
    trained_cluster.link_down(cut)
    cut_at = time.monotonic()
    wait_no_orphans(trained_cluster, trained_cluster.hosts[:1], timeout=30)  # the master's run is gone within 30 s
    # the cut host's own agent stops hearing the controller and tears its run down by itself, within 30 s of
    # the cut (measured on the host: its link is still down, nothing can reach it)
    wait_no_orphans(trained_cluster, [cut], timeout=max(0.0, cut_at + 30 - time.monotonic()))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "h2" in out and ("no heartbeat" in out or "connection lost" in out)
    record = latest_record(tmp_path)
    assert record["state"] == "failed" and record["failed_host"] == "h2" and record["hosts"]["h2"]["state"] == "lost"


def test_ctrl_c_stops_every_host(trained_cluster, tmp_path):
    inv = inventory(trained_cluster, tmp_path, 2)
    proc = start_invoke(tmp_path, *train_args(inv, steps=400))
    wait_for_output(proc, r"step +4/")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, out[-2000:]
    wait_no_orphans(trained_cluster, trained_cluster.hosts[:2], timeout=5)
    record = latest_record(tmp_path)
    assert record["state"] == "interrupted" and record["reason"].startswith("interrupted (Ctrl-C)") and record["attempts"][-1]["state"] == "interrupted"


def test_a_stale_process_on_the_rendezvous_port_makes_train_take_the_next_free_port(trained_cluster, tmp_path):
    master = trained_cluster.hosts[0]
    holder = trained_cluster.popen(master, [sys.executable, "-c", "import socket,time; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 29500)); s.listen(); time.sleep(300)"])
    try:
        wait_listening(trained_cluster, master, 29500)
        inv = inventory(trained_cluster, tmp_path, 2)
        done = invoke(tmp_path, *train_args(inv, steps=4))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert latest_record(tmp_path)["rendezvous_port"] == 29501
    finally:
        holder.kill()
        holder.wait()


def controller_cmdlines_with(text: str) -> list[str]:
    """Command lines of this machine's processes (the controller and everything it started) holding `text`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmd:
                found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_secrets_never_reach_a_command_line_a_log_or_the_run_record(trained_cluster, tmp_path):
    secret = "s3cr3t-value-for-mnft"
    env = cli_env(tmp_path)
    env["HF_TOKEN"] = secret  # passed through when set
    env["WANDB_API_KEY"] = secret + "-wandb"  # --env NAME: the value from the controller's environment
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"DB_PASSWORD={secret}-db\n")
    env_file.chmod(0o600)
    inv = inventory(trained_cluster, tmp_path, 2)
    refused = invoke(tmp_path, *train_args(inv, "--env", "WANDB_API_KEY=" + secret, steps=4), env=env)
    assert refused.returncode == 2 and "use --env WANDB_API_KEY" in refused.stderr and secret not in refused.stderr
    proc = start_invoke(tmp_path, *train_args(inv, "--env", "WANDB_API_KEY", "--env-file", str(env_file), "--env", "MY_SETTING=visible", steps=400), env=env)
    wait_for_output(proc, r"step +4/")
    assert controller_cmdlines_with(secret) == []
    delivered = False
    for host in trained_cluster.hosts[:2]:
        for pid, cmd in trained_cluster.processes(host):
            assert secret not in cmd
            if "mnft.recipes" in cmd and "torch.distributed.run" not in cmd:
                environ = trained_cluster.run(host, ["cat", f"/proc/{pid}/environ"], check=False).stdout
                delivered = delivered or all(f"{k}={v}" in environ for k, v in (
                    ("HF_TOKEN", secret), ("WANDB_API_KEY", secret + "-wandb"), ("DB_PASSWORD", secret + "-db")))
    assert delivered, "the secrets did not reach the training processes"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert secret not in out
    record_dir = sorted((tmp_path / "runs").glob("[!.]*"))[-1]
    record = json.loads((record_dir / "run.json").read_text())
    collected = invoke(tmp_path, "logs", record["run_id"], env=env)  # the collected logs too
    assert collected.returncode == 0 and secret not in collected.stdout + collected.stderr
    assert (record_dir / "h2" / "run" / "output.log").is_file()
    for path in record_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    for host in trained_cluster.hosts[:2]:  # the hosts' run and output directories of this job
        job = host.home / "mnft" / "outputs" / record["job_id"]
        code = set(json.loads((job / ".mnft-checkout.json").read_text())["files"])  # the job's code (this test's own source among it)
        for top in (host.home / "mnft" / "runs" / record["run_id"], job):
            for path in top.rglob("*"):
                if path.is_file() and path.relative_to(top).as_posix() not in code:
                    assert secret.encode() not in path.read_bytes(), path
    env_shown = record["hosts"]["h1"]["env"]
    assert env_shown["HF_TOKEN"] == env_shown["WANDB_API_KEY"] == env_shown["DB_PASSWORD"] == "***"
    assert env_shown["MY_SETTING"] == "visible" and record["env_specs"] == ["WANDB_API_KEY", "MY_SETTING=visible"]
    wait_no_orphans(trained_cluster, trained_cluster.hosts[:2])


def test_logs_follow_a_detached_run_to_its_end_then_collect_everything(trained_cluster, tmp_path):
    inv = inventory(trained_cluster, tmp_path, 2)
    started = invoke(tmp_path, *train_args(inv, "--detach", steps=8))
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    run_id = started.stdout.strip().splitlines()[-1]
    followed = invoke(tmp_path, "logs", run_id, "--follow", timeout=300)
    assert followed.returncode == 0, followed.stdout[-2000:] + followed.stderr[-2000:]
    assert re.search(r"h1 r0\| step +8/8", followed.stdout) and re.search(r"h2 r1\| rank=1/2", followed.stdout)
    collected = invoke(tmp_path, "logs", run_id)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    run_dir = tmp_path / "runs" / run_id
    assert (run_dir / "h1" / "extra" / "0" / "metrics.jsonl").is_file() and (run_dir / "loss.png").is_file()
    assert (run_dir / "h2" / "run" / "torchrun").is_dir()  # per-rank logs
    assert "summary: loss" in collected.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "succeeded" and summary["last_step"] == 8 and summary["metrics_host"] == "h1"
    assert {h: (v["state"], v["exit_code"]) for h, v in summary["hosts"].items()} == {"h1": ("exited", 0), "h2": ("exited", 0)}
    status = json.loads(invoke(tmp_path, "status", run_id, "--json").stdout)
    assert {h["state"] for h in status["hosts"].values()} == {"exited"} and {h["exit_code"] for h in status["hosts"].values()} == {0}
    record = json.loads((run_dir / "run.json").read_text())  # the detached run's end, written back
    assert record["state"] == "succeeded" and {h["exit_code"] for h in record["hosts"].values()} == {0}
