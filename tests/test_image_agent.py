"""The host agent with a run in a container: secrets reach the job through the run directory's file (never the
runtime's command line or environment), the container is removed by its name when the run ends and when it is
stopped, and `status` says whether it is still there.

The runtime is a stand-in (a Python script named podman) that does what matters here as podman does: `run` takes
`-e NAME` values from its own environment, runs the command after the image, forwards SIGTERM; `rm`, `container
exists` answer from a state file. The real podman is in tests/test_cluster_containers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mnft.hosts import pyrun
from mnft.hosts import payload
from mnft.onhost import queries, runprocs

FAKE_RUNTIME = r'''#!PYTHON
import json, os, signal, subprocess, sys
state = os.environ["FAKE_RUNTIME_STATE"]
args = sys.argv[1:]
with open(state + "/calls.jsonl", "a") as fh:
    fh.write(json.dumps({"argv": args, "secret_in_env": "API_TOKEN" in os.environ}) + "\n")
if args[0] == "run":
    i, names, name = 1, [], None
    while args[i].startswith("-"):
        flag = args[i]
        if flag in ("--rm",):
            i += 1
            continue
        value = args[i + 1]
        if flag == "-e":
            names.append(value)
        if flag == "--name":
            name = value
        i += 2
    command = args[i + 1:]  # args[i] is the image
    env = {"PATH": os.environ["PATH"]}
    env.update({n: os.environ[n] for n in names if n in os.environ})
    open(state + "/container-" + name, "w").close()
    child = subprocess.Popen(command, env=env)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    code = child.wait()
    os.unlink(state + "/container-" + name)
    sys.exit(code if code >= 0 else 128 - code)
if args[0] == "rm":
    path = state + "/container-" + args[-1]
    if os.path.exists(path):
        os.unlink(path)
        sys.exit(0)
    sys.stderr.write("Error: no container with name or ID \"%s\" found: no such container\n" % args[-1])
    sys.exit(1)
if args[:2] == ["container", "exists"]:
    sys.exit(0 if os.path.exists(state + "/container-" + args[2]) else 1)
sys.exit(125)
'''


def fake_runtime(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "podman"
    path.parent.mkdir()
    path.write_text(FAKE_RUNTIME.replace("PYTHON", sys.executable))
    path.chmod(0o755)
    return path


def calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def start(tmp_path: Path, command: list[str], *, detach=False):
    runtime = fake_runtime(tmp_path)
    run_dir = tmp_path / "run"
    name = "mnft-R7-local"
    inside = [sys.executable, str(run_dir / "entry.py"), "--secrets", str(run_dir / "secrets.json"), *command]
    spec = {"run_id": "R7", "tag": "R7@local", "run_dir": str(run_dir), "cwd": str(tmp_path),
            "argv": [str(runtime), "run", "--rm", "--name", name, "-e", "PLAIN", "-e", "MNFT_RUN_TAG", "localhost/lab:1", *inside],
            "env": {"PLAIN": "1"}, "secrets": {"API_TOKEN": "hush"}, "metrics": None, "detach": detach, "deadman": 30, "grace": 2,
            "entry": payload.standalone("entry"),
            "container": {"runtime": "podman", "path": str(runtime), "name": name, "image": "localhost/lab:1",
                          "mounts": [str(tmp_path / "data")], "secrets_file": True,
                          "teardown": [str(runtime), "rm", "--force", "--time", "5", name]}}
    env = dict(os.environ, FAKE_RUNTIME_STATE=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "launch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    proc.stdin.write(pyrun.payload("agent") + json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["event"] == "started"
    return proc, run_dir


def events_until(proc, kind: str) -> list[dict]:
    events = []
    while not events or events[-1]["event"] != kind:
        events.append(json.loads(proc.stdout.readline()))
    return events


def test_secrets_reach_the_job_in_the_container_by_file_only_and_the_file_is_gone(tmp_path):
    script = "import os; print('token', (os.environ.get('API_TOKEN') or '')[::-1] == 'hsuh', os.environ.get('PLAIN'))"
    proc, run_dir = start(tmp_path, [sys.executable, "-c", script])
    events = events_until(proc, "exit")
    proc.stdin.close()
    proc.wait(timeout=10)
    assert {"event": "line", "text": "token True 1"} in events
    assert events[-1]["code"] == 0
    run_call = calls(tmp_path)[0]
    assert run_call["argv"][0] == "run" and run_call["secret_in_env"] is False  # not even in the runtime client's environment
    assert not any("hush" in a for a in run_call["argv"])
    assert not (run_dir / "secrets.json").exists()
    assert (tmp_path / "data").is_dir()  # a mount's directory is made before the runtime needs it


def test_the_container_is_removed_by_name_when_the_run_ends(tmp_path):
    proc, _ = start(tmp_path, [sys.executable, "-c", "raise SystemExit(3)"])
    assert events_until(proc, "exit")[-1]["code"] == 3
    proc.stdin.close()
    proc.wait(timeout=10)
    assert ["rm", "--force", "--time", "5", "mnft-R7-local"] in [c["argv"] for c in calls(tmp_path)]


def test_stop_ends_the_job_and_removes_its_container_and_status_says_it_is_gone(tmp_path):
    proc, run_dir = start(tmp_path, [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"], detach=True)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while not (tmp_path / "container-mnft-R7-local").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.environ["FAKE_RUNTIME_STATE"] = str(tmp_path)  # the stop and status below run the runtime from this process
    try:
        assert queries.status(str(run_dir))["container"] == {"name": "mnft-R7-local", "image": "localhost/lab:1", "runtime": "podman", "present": True}
        result = runprocs.terminate(str(run_dir), grace=2)
        assert result["remaining"] == [] and runprocs.run_pids("R7@local") == []
        assert ["rm", "--force", "--time", "0", "mnft-R7-local"] in [c["argv"] for c in calls(tmp_path)]
        assert queries.status(str(run_dir))["container"]["present"] is False
    finally:
        del os.environ["FAKE_RUNTIME_STATE"]
    assert not (run_dir / "secrets.json").exists()
