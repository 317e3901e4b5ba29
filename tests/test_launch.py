"""Launch planning is pure (inventory in, torchrun commands out); the host agent kills by process group and tag."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mnft.core.errors import InputError
from mnft.hosts import inventory, pyrun
from mnft.run import launch
from mnft.onhost import queries, runprocs
from mnft.run.job import recipe_job
from mnft.run.launch import LaunchOptions

INV = inventory.parse("vars: {slots: 2, python: /opt/py/bin/python, workdir: /srv/mnft}\nhosts:\n  a: {address: 10.0.0.1}\n  b: {address: 10.0.0.2, iface: ib0}\n")


def plan(inv=INV, recipe="lora", overrides=(), job=None, latest_checkpoint=None, **options):
    return launch.plan(
        inv, master_addr="10.0.0.1", port=29501, run_id="R1", job_id="J1", options=LaunchOptions(job=job or recipe_job(recipe, overrides), **options),
        ifaces={"a": "eth0", "b": "eth9"}, env={"MY": "x"}, secret_names=("HF_TOKEN",), latest_checkpoint=latest_checkpoint,
    )


def test_every_host_gets_its_node_rank_the_master_address_and_its_interface():
    a, b = plan(overrides=("lr=1e-4",))
    assert a.argv == (
        "/opt/py/bin/python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29501", "--rdzv-conf", "timeout=300", "--max-restarts", "0",
        "--tee", "3", "--log-dir", "/srv/mnft/runs/R1/a/torchrun", "/srv/mnft/runs/R1/a/entry.py", "-m", "mnft.recipes.lora",
        "output_dir=/srv/mnft/outputs/J1", "lr=1e-4",
    )
    assert b.argv[b.argv.index("--node-rank") + 1] == "1" and b.rank_offset == 2
    # each host's run files under its own name: hosts that share a home (NFS) never share a spec, pgid or log
    assert (a.run_dir, b.run_dir) == ("/srv/mnft/runs/R1/a", "/srv/mnft/runs/R1/b")
    assert a.env["GLOO_SOCKET_IFNAME"] == "eth0" and a.env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert b.env["GLOO_SOCKET_IFNAME"] == "ib0"  # the inventory's iface wins over the detected one
    assert a.metrics == "/srv/mnft/outputs/J1/metrics.jsonl" and b.metrics is None
    # the ranks start in the job's working directory: its code (hard links to its snapshot) and what it writes
    assert a.cwd == "/srv/mnft/outputs/J1" and a.env["PYTHONPATH"] == "/srv/mnft/outputs/J1"


def test_resume_continues_the_jobs_output_dir():
    (a, _) = plan(resume=True)
    assert "output_dir=/srv/mnft/outputs/J1" in a.argv and a.argv[-1] == "resume=latest"


def test_c10d_rendezvous_allows_different_slots_and_static_refuses_them():
    mixed = inventory.parse("hosts:\n  a: {address: 10.0.0.1, slots: 8}\n  b: {address: 10.0.0.2, slots: 4}\n")
    with pytest.raises(InputError, match="static rendezvous needs the same slots everywhere; use --rdzv c10d"):
        plan(mixed)
    a, b = plan(mixed, rdzv="c10d")
    assert "--rdzv-endpoint" in a.argv and "10.0.0.1:29501" in a.argv and "--node-rank" not in a.argv
    assert b.rank_offset == 8


def test_loopback_master_for_several_hosts_is_refused():
    with pytest.raises(InputError, match="loopback"):
        launch.plan(INV, master_addr="127.0.0.1", port=1, run_id="R", job_id="J", options=LaunchOptions(), ifaces={}, env={}, secret_names=())


@pytest.mark.parametrize("bad, message", [("lr", "expected key=value"), ("output_dir=/x", "set by mnft"), ("resume=latest", "set by mnft"), ("1x=2", "expected key=value")])
def test_bad_overrides_are_refused(bad, message):
    with pytest.raises(InputError, match=message):
        plan(overrides=(bad,))


def test_unknown_recipe_is_refused():
    with pytest.raises(InputError, match="unknown recipe"):
        plan(recipe="qlora")


def test_secrets_travel_only_in_the_spec_and_are_redacted_for_display():
    plain, secret = launch.split_env(("WANDB_API_KEY", "MODE=fast"), {"WANDB_API_KEY": "k-9f8e", "HF_TOKEN": "hf-7c6d", "PATH": "/bin"})
    assert plain == {"MODE": "fast"} and secret == {"HF_TOKEN": "hf-7c6d", "WANDB_API_KEY": "k-9f8e"}
    (a, _) = plan()
    assert a.display()["env"]["HF_TOKEN"] == "***"
    spec = a.spec("R1", {"HF_TOKEN": "hf-7c6d"}, LaunchOptions())
    assert spec["secrets"] == {"HF_TOKEN": "hf-7c6d"} and spec["tag"] == "R1@a"
    assert "hf-7c6d" not in json.dumps(a.display()) and "hf-7c6d" not in " ".join(a.argv)
    with pytest.raises(InputError, match="not set in this environment"):
        launch.split_env(("MISSING",), {})


# ------------------------------------------------------------------------------------------- the host agent


def start_agent(tmp_path, argv, run_id="R9", detach=False, deadman=30.0):
    spec = {"run_id": run_id, "tag": f"{run_id}@local", "run_dir": str(tmp_path / "run"), "argv": argv, "cwd": str(tmp_path),
            "env": {"PLAIN": "1"}, "secrets": {"API_TOKEN": "hush"}, "metrics": None, "detach": detach, "deadman": deadman, "grace": 2}
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "launch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
    proc.stdin.write(pyrun.payload("agent") + json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    started = json.loads(proc.stdout.readline())
    assert started["event"] == "started"
    return proc, started["pgid"]


def settled_pids(tag: str, count: int, timeout: float = 20.0) -> list[int]:
    """The run's processes once at least `count` of them are up (a detached run's command starts after its agent
    returned)."""
    deadline = time.monotonic() + timeout
    while len(pids := runprocs.run_pids(tag)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_agent_reports_the_exit_code_and_hands_secrets_over_in_a_deleted_0600_file(tmp_path):
    script = "import os,sys; print('token', os.environ['API_TOKEN'][::-1] == 'hsuh', os.environ['PLAIN']); sys.exit(3)"
    proc, _ = start_agent(tmp_path, [sys.executable, "-c", script])
    events = []
    while not events or events[-1]["event"] != "exit":  # stdin stays open: the controller is still there
        events.append(json.loads(proc.stdout.readline()))
    proc.stdin.close()
    proc.wait(timeout=10)
    assert {"event": "line", "text": "token True 1"} in events
    assert events[-1] == {"event": "exit", "code": 3, "done": []}  # no rank returned from an entry point
    assert not (tmp_path / "run" / "secrets.json").exists()
    assert "hush" not in (tmp_path / "run" / "spec.json").read_text()
    assert oct((tmp_path / "run").stat().st_mode & 0o777) == "0o700"


def test_closing_the_agents_stdin_kills_the_whole_process_group(tmp_path):
    child = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(300)']); print('up', flush=True); time.sleep(300)"
    proc, pgid = start_agent(tmp_path, [sys.executable, "-c", child])
    while json.loads(proc.stdout.readline()) != {"event": "line", "text": "up"}:  # the command and its child are up
        pass
    pids = runprocs.run_pids("R9@local")
    assert len(pids) >= 3  # keeper, the command, its child
    proc.stdin.close()  # the controller (or the link to it) is gone
    out = proc.stdout.read().decode()
    assert '"event": "stopped"' in out and "controller closed the connection" in out
    assert not any(alive(p) for p in pids)


def test_stop_kills_only_its_own_run(tmp_path):
    sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, _ = start_agent(tmp_path / "one", sleep, run_id="ONE", detach=True)
    two, _ = start_agent(tmp_path / "two", sleep, run_id="TWO", detach=True)
    one.wait(timeout=10), two.wait(timeout=10)  # detached: the agents return at once, the runs go on
    two_pids = settled_pids("TWO@local", 2)  # its keeper and its command
    assert runprocs.run_pids("ONE@local") and two_pids
    result = runprocs.terminate(str(tmp_path / "one" / "run"), grace=2)
    assert result["remaining"] == [] and runprocs.run_pids("ONE@local") == []
    assert runprocs.run_pids("TWO@local") == two_pids
    assert queries.status(str(tmp_path / "two" / "run"))["state"] == "running"
    runprocs.terminate(str(tmp_path / "two" / "run"), grace=2)
    assert runprocs.run_pids("TWO@local") == []
