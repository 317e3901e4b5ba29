"""`mnft uninstall` on the simulated cluster: after a sync, a short run and a provision, a dry run lists what mnft
put on each host and on the controller (changing nothing); uninstall is refused while a run holds a host; then it
removes all of mnft's, keeps the run's output file and a person's file in the workdir, and a second one finds
nothing left to remove."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wheelmaker import make_wheel, write_lock

pytestmark = pytest.mark.cluster

MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]
MINOR = "%d.%d" % sys.version_info[:2]
WRITES = "open('result.txt', 'w').write('trained\\n')\nprint('wrote result.txt', flush=True)\n"


def mnft(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"), MNFT_RUNS_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    return subprocess.run([*MNFT, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_uninstall_lists_then_removes_mnfts_files_and_keeps_what_runs_and_people_wrote(fresh_cluster_factory, tmp_path, lab_scripts):
    cluster = fresh_cluster_factory(2)
    inv = str(cluster.write_inventory(tmp_path / "inventory.yaml", slots=1))
    (lab_scripts / "writes.py").write_text(WRITES)
    done = mnft(tmp_path, "train", "--hosts", inv, "--src", str(lab_scripts), "--", "writes.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # a run on a host: uninstall is refused there, nothing changed anywhere
    started = mnft(tmp_path, "train", "--hosts", inv, "--src", str(lab_scripts), "--detach", "--", "long.py")
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        refused = mnft(tmp_path, "uninstall", "--hosts", inv)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "nothing was changed on any host" in refused.stderr
        assert all((h.home / "mnft" / ".mnft" / "code").is_dir() for h in cluster.hosts)
    finally:
        stopped = mnft(tmp_path, "stop", "--hosts", inv)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr

    synced = mnft(tmp_path, "sync", "--hosts", inv, "--src", str(lab_scripts))
    assert synced.returncode == 0, synced.stdout[-2000:] + synced.stderr[-2000:]
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "alpha", "1.0", padding=100_000)
    lock = write_lock(tmp_path / "requirements.lock", sorted(wheels.glob("*.whl")), {"alpha": "1.0"}, find_links=wheels, python=MINOR)
    done = mnft(tmp_path, "provision", "--hosts", inv, "--lock", str(lock))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for host in cluster.hosts:
        (host.home / "mnft" / "notes.txt").write_text("a person's file\n")
    [result] = (cluster.hosts[0].home / "mnft" / "outputs").glob("*/result.txt")
    mnft_home = tmp_path / "mnft-home"
    assert (mnft_home / "wheelhouse").is_dir() and (mnft_home / "code").is_dir()

    dry = mnft(tmp_path, "uninstall", "--hosts", inv, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    for name in ("h1", "h2"):
        actions = {i["key"]: i["action"] for i in report["hosts"][name]["items"]}
        assert report["hosts"][name]["status"] == "would-remove"
        assert {k: actions[k] for k in ("env", "env_store", "snapshots", "checkout", "cache", "marks")} == dict.fromkeys(
            ("env", "env_store", "snapshots", "checkout", "cache", "marks"), "remove"), actions
        assert actions["outputs"] == actions["runs"] == "keep" and actions["workdir"] == "remove if empty"
    here = {i["key"]: i for i in report["controller"]["items"]}
    assert here["wheelhouse"]["bytes"] > 100_000 and here["code_store"]["action"] == "remove" and here["provision_record"]["files"] == 2
    table = mnft(tmp_path, "uninstall", "--hosts", inv, "--dry-run")
    assert "would remove" in table.stdout and "nothing was changed" in table.stdout and "setup --undo" in table.stdout, table.stdout
    assert (cluster.hosts[0].home / "mnft-env").is_symlink() and (mnft_home / "wheelhouse").is_dir()  # a dry run changes nothing

    done = mnft(tmp_path, "uninstall", "--hosts", inv, "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert {n: h["status"] for n, h in report["hosts"].items()} == {"h1": "ok", "h2": "ok"}
    for host in cluster.hosts:
        assert not os.path.lexists(host.home / "mnft-env") and not (host.home / "mnft-env.d").exists()
        assert not (host.home / "mnft" / ".mnft").exists() and not (host.home / ".cache" / "mnft").exists()
        assert not (host.home / ".mnft-share").exists() and not (host.home / "mnft" / "writes.py").exists()
        assert (host.home / "mnft" / "notes.txt").read_text() == "a person's file\n"
        assert list((host.home / "mnft" / "runs").iterdir())  # the runs' logs stay
    assert result.read_text() == "trained\n"  # the run's output, in its job's directory
    assert not (mnft_home / "wheelhouse").exists() and not (mnft_home / "code").exists()
    assert json.loads((mnft_home / "provision" / "hosts.json").read_text()) == {}

    again = mnft(tmp_path, "uninstall", "--hosts", inv, "--json")
    assert again.returncode == 0, again.stderr
    left = {n: [i["key"] for i in h["items"] if i["action"] != "keep"] for n, h in json.loads(again.stdout)["hosts"].items()}
    assert left == {"h1": ["workdir"], "h2": ["workdir"]}  # only the workdir, which holds what runs and people wrote
    assert not [i for i in json.loads(again.stdout)["controller"]["items"] if i["action"] != "keep"]
