"""Issue 27 on a real simulated cluster: the lab's container image as the run's environment, with a real podman.

Two hosts, each with its own podman storage (tests/testbed.py `containers=True`), the test bed's CPU-torch image
(tests/images.py) loaded into both. The hosts' own Python is the one the test bed gives them, but what trains is
the image's (/usr/local/bin/python3 in it): the check records it, and the ranks print whether they run in a
container (/run/.containerenv, which podman writes into every container). What is asserted: the job runs and ends
as on the host, a secret is nowhere a person or another user could read it (the container's argv, `podman
inspect`, the host's process list, the logs), and nothing is left after any ending: no container, no process of
the run."""

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
from runhelpers import latest_record, wait_for_output

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SECRET = "hf_Zq8cotainerSecret7731"
PROBE = '''
import hashlib, os, sys, time
rank = os.environ.get("RANK")
inside = os.path.exists("/run/.containerenv")
token = os.environ.get("HF_TOKEN") or ""
print("rank=%s inside=%s python=%s token-sha=%s" % (rank, inside, sys.executable, hashlib.sha256(token.encode()).hexdigest()[:12]), flush=True)
end = os.path.join(os.environ["MNFT_OUTPUT_DIR"], "..", "..", "end-" + (sys.argv[1] if len(sys.argv) > 1 else "x"))
deadline = time.time() + float(sys.argv[2] if len(sys.argv) > 2 else 0)
while time.time() < deadline and not os.path.exists(end):
    time.sleep(0.2)
'''


@pytest.fixture(scope="module")
def boxes(container_cluster, torch_image):
    """h1, h2 with their own podman storage, the torch image in both."""
    container_cluster.share_image(container_cluster.hosts, torch_image)  # a read-only store: instant
    return container_cluster


@pytest.fixture
def controller(tmp_path):
    home = tmp_path / "controller-home"
    home.mkdir()
    return dict(os.environ, HOME=str(home), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")


@pytest.fixture
def src(tmp_path):
    tree = tmp_path / "lab-src"
    tree.mkdir()
    (tree / "probe.py").write_text(PROBE)
    return tree


def mnft(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from mnft.cli.main import main; main()", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def start(env, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from mnft.cli.main import main; main()", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)


def containers(cluster, host) -> list[str]:
    """Every container the host's podman has (running or not), by name."""
    done = cluster.podman(host, "ps", "-a", "--format", "{{.Names}}")
    return [line for line in done.stdout.split() if line]


def tagged(cluster, host, run_id: str) -> list[str]:
    """The host's processes carrying the run's tag in their environment (inside its container too: one PID space)."""
    out = []
    for pid, cmd in cluster.processes(host):
        try:
            if f"MNFT_RUN_ID={run_id}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                out.append(cmd)
        except OSError:
            pass
    return out


def nothing_left(cluster, run_id: str, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = {h.name: (containers(cluster, h), tagged(cluster, h, run_id)) for h in cluster.hosts}
        if not any(boxes or procs for boxes, procs in left.values()):
            return
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.5)


def test_the_lora_recipe_trains_in_the_image_on_two_hosts_and_leaves_no_container(boxes, torch_image, controller, tmp_path):
    inv = str(boxes.write_inventory(tmp_path / "inv.yaml"))
    done = mnft(controller, "train", "--hosts", inv, "--src", str(REPO), "--image", torch_image.ref,
                "--set", "max_steps=2", "--set", "log_every=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = latest_record(tmp_path)
    assert record["state"] == "succeeded"
    for name in ("h1", "h2"):
        assert record["facts"][name]["python"]["executable"].startswith("/usr/local/bin/python")  # the image's Python trained
        assert record["hosts"][name]["command"].startswith(("/usr/bin/podman run --rm --name mnft-", "podman run"))
        assert " --network host --ipc host " in record["hosts"][name]["command"]
    assert re.search(r"node_rank=1", done.stdout)
    nothing_left(boxes, record["run_id"], timeout=15)


def test_a_secret_is_in_no_argv_inspect_or_log_and_stop_leaves_nothing(boxes, torch_image, controller, src, tmp_path):
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"HF_TOKEN={SECRET}\n")
    env_file.chmod(0o600)
    inv = str(boxes.write_inventory(tmp_path / "inv.yaml"))
    started = mnft(controller, "train", "--hosts", inv, "--src", str(src), "--image", torch_image.ref, "--env-file", str(env_file),
                   "--detach", "--", "probe.py", "never", "300")
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    record = latest_record(tmp_path)
    run_id = record["run_id"]
    name = f"mnft-{run_id}-h1"
    deadline = time.monotonic() + 120
    log = boxes.hosts[0].home / "mnft" / "runs" / run_id / "h1" / "output.log"
    while "token-sha=" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.5)
    output = log.read_text()
    import hashlib
    assert f"token-sha={hashlib.sha256(SECRET.encode()).hexdigest()[:12]}" in output  # the job has it ...
    assert "inside=True python=/usr/local/bin/python" in output  # ... in the image's container
    inspect = boxes.podman(boxes.hosts[0], "inspect", name)
    assert inspect.returncode == 0 and name in inspect.stdout
    assert SECRET not in inspect.stdout  # not in Config.Env, Args, Cmd ...
    for host in boxes.hosts:
        for pid, cmd in boxes.processes(host):
            assert SECRET not in cmd
    status = mnft(controller, "status", run_id)
    assert f"(podman container {name}: present)" in status.stdout, status.stdout
    stopped = mnft(controller, "stop", run_id)
    assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    nothing_left(boxes, run_id, timeout=5)  # stop returns once everything is gone
    for host in boxes.hosts:
        run_dir = host.home / "mnft" / "runs" / run_id / host.name
        assert not (run_dir / "secrets.json").exists()
        assert SECRET not in (run_dir / "output.log").read_text() and SECRET not in (run_dir / "spec.json").read_text()
    after = mnft(controller, "status", run_id)
    assert f"(podman container {name}: gone)" in after.stdout, after.stdout


def test_a_rank_killed_on_one_host_takes_every_container_down(boxes, torch_image, controller, src, tmp_path):
    inv = str(boxes.write_inventory(tmp_path / "inv.yaml"))
    run = start(controller, "train", "--hosts", inv, "--src", str(src), "--image", torch_image.ref, "--", "probe.py", "never", "300")
    try:
        wait_for_output(run, r"rank=1 inside=True", timeout=120)
        record = latest_record(tmp_path)
        victim = [pid for pid, cmd in boxes.processes(boxes.hosts[1]) if "probe.py" in cmd and "torch.distributed.run" not in cmd
                  and "podman" not in cmd and "entry.py" in cmd]
        assert victim, boxes.processes(boxes.hosts[1])
        os.kill(victim[0], signal.SIGKILL)  # the rank inside h2's container (one PID space with the host)
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    assert json.loads((tmp_path / "runs" / record["run_id"] / "run.json").read_text())["state"] == "failed"
    nothing_left(boxes, record["run_id"], timeout=5)


def test_sigterm_to_the_controller_ends_every_container(boxes, torch_image, controller, src, tmp_path):
    inv = str(boxes.write_inventory(tmp_path / "inv.yaml"))
    run = start(controller, "train", "--hosts", inv, "--src", str(src), "--image", torch_image.ref, "--", "probe.py", "never", "300")
    try:
        wait_for_output(run, r"rank=0 inside=True", timeout=120)
        record = latest_record(tmp_path)
        assert all(containers(boxes, h) == [f"mnft-{record['run_id']}-{h.name}"] for h in boxes.hosts)
        run.send_signal(signal.SIGTERM)  # as a session's end or a scheduler's kill of the controller
        run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    nothing_left(boxes, record["run_id"], timeout=5)


RESTARTED = '''
import os, sys, time
print("rank=%s attempt=%s python=%s" % (os.environ.get("RANK"), os.environ.get("MNFT_ATTEMPT"), sys.executable), flush=True)
if os.environ.get("MNFT_ATTEMPT") == "1":
    time.sleep(300)
'''


def test_a_restart_in_the_image_on_hosts_without_torch_is_rechecked_in_the_image(boxes, torch_image, controller, src, tmp_path):
    """Issue 36: the lab trains in an image and its hosts' own Python has no torch (Debian's /usr/bin/python3). A
    container killed from outside (`podman kill`) fails attempt 1; the re-check before attempt 2 judges the image,
    by the id the first check verified (not the hosts' Python), and attempt 2 runs; the kill is said as a kill."""
    (src / "restarted.py").write_text(RESTARTED)
    inv = str(boxes.write_inventory(tmp_path / "inv.yaml", python="/usr/bin/python3"))
    run = start(controller, "train", "--hosts", inv, "--src", str(src), "--image", torch_image.ref, "--max-restarts", "1",
                "--backoff", "0", "--", "restarted.py")
    try:
        wait_for_output(run, r"rank=1 attempt=1", timeout=120)
        record = latest_record(tmp_path)
        boxes.podman(boxes.hosts[1], "kill", f"mnft-{record['run_id']}-h2")
        out, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-4000:]
    assert "the re-check before attempt 2 failed" not in out
    assert "killed" in out and "exited with code 137" not in out.split("attempt 1 failed:")[1].split("\n")[0], out[-3000:]
    record = json.loads((tmp_path / "runs" / record["run_id"] / "run.json").read_text())
    assert [a["state"] for a in record["attempts"]] == ["failed", "succeeded"]
    assert record["attempts"][0]["recheck_s"] is not None
    assert record["image"] == {"ref": torch_image.ref, "id": record["facts"]["h1"]["container"]["image"]["id"]}
    nothing_left(boxes, record["run_id"], timeout=15)


INSIDE = ("read tag < /etc/mnft-tiny; echo inside tag=$tag cwd=$(pwd) cvd=${CUDA_VISIBLE_DEVICES-unset} session=$MNFT_SESSION; "
          "test -e /run/.containerenv && echo in-a-container; exit 5")


def test_a_shell_session_in_an_image_runs_inside_it_in_the_workdir_and_its_exit_a_stop_or_its_time_leaves_no_container(
        container_cluster, tiny_images, controller, tmp_path):
    """Issue 38: `mnft shell --image` through a real terminal: the command runs in the image's container (its own
    file, podman's /run/.containerenv), in the mounted workdir, with the session's variables; its exit status is the
    session's; the container is gone after it, after a `mnft stop` of a second session and after a third's --time."""
    pexpect = pytest.importorskip("pexpect")
    boxes, tiny = container_cluster, tiny_images[0]
    h1 = boxes.hosts[0]
    boxes.load_image([h1], tiny)
    inv = str(boxes.write_inventory(tmp_path / "inv.yaml", hosts=[h1]))
    argv = [sys.executable, "-c", "from mnft.cli.main import main; main()", "shell", "--hosts", inv, "--gpus", "0", "--image", tiny.ref,
            "--", "sh", "-c", INSIDE]
    child = pexpect.spawn(argv[0], argv[1:], env=dict(controller, TERM="xterm"), cwd=str(REPO), timeout=120, encoding="utf-8")
    try:
        child.expect(r"session (\S+) on h1: GPU none \(CUDA_VISIBLE_DEVICES=\) in localhost/mnft-tiny:a \(podman\)")
        session = child.match.group(1)
        child.expect(r"inside tag=(\S*) cwd=(\S+) cvd=(\S+) session=(\S*)\r\n")
        assert child.match.groups() == ("a", f"{boxes.home_mountpoint.rstrip('/')}/mnft/outputs/{session}", "unset", session)  # the code, placed
        child.expect("in-a-container")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 5
    record = json.loads((tmp_path / "runs" / session / "run.json").read_text())
    assert (record["kind"], record["state"], record["exit_code"]) == ("session", "ended", 5)
    assert record["hosts"]["h1"]["container"]["name"] == f"mnft-{session}-h1"
    nothing_left(boxes, session, timeout=5)

    held = start(controller, "shell", "--hosts", inv, "--gpus", "0", "--image", tiny.ref, "--", "sleep", "300")
    try:
        line = wait_for_output(held, r"session (\S+) on h1", timeout=120)[-1]
        second = re.search(r"session (\S+) on h1", line).group(1)
        deadline = time.monotonic() + 60
        while containers(boxes, h1) != [f"mnft-{second}-h1"]:
            assert time.monotonic() < deadline, containers(boxes, h1)
            time.sleep(0.5)
        stopped = mnft(controller, "stop", second)
        assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
        held.communicate(timeout=60)
    finally:
        if held.poll() is None:
            held.kill()
    assert json.loads((tmp_path / "runs" / second / "run.json").read_text())["state"] == "stopped"
    nothing_left(boxes, second, timeout=5)

    timed = mnft(controller, "shell", "--hosts", inv, "--gpus", "0", "--image", tiny.ref, "--time", "2s", "--", "sleep", "300", timeout=120)
    third = re.search(r"session (\S+) on h1", timed.stdout).group(1)
    assert json.loads((tmp_path / "runs" / third / "run.json").read_text())["state"] == "timed-out", timed.stdout[-2000:]
    nothing_left(boxes, third, timeout=5)
