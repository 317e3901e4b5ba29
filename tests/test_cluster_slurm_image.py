"""`mnft train --slurm --image`: a user script in a container image on 2 Slurm nodes, with a real Slurm
(tests/slurmbed.py) and a real podman on each node (tests/testbed.py `containers=True`), the test bed's CPU-torch
image given to both (a read-only image store: instant). mnft runs inside h1, which shares its home with h2 (the
shared filesystem a Slurm run needs), as a user at a login node would. Nothing is mocked."""

from __future__ import annotations

import json
import re
import time

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MAIN = "import sys; sys.argv[0] = 'mnft'; from mnft.cli.main import main; main()"
SCRIPT = """\
import os, sys
import time
print(f"script rank={os.environ['RANK']} container={os.path.exists('/run/.containerenv')} python={sys.executable}", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture(scope="module")
def slurm_boxes(testbed, torch_image, tmp_path_factory):
    """h1, h2 sharing one home, each with its own podman holding the torch image, and a Slurm over them."""
    import slurmbed

    try:
        slurmbed.check_prerequisites()
    except testbed.ClusterUnavailable as exc:
        pytest.skip(f"Slurm test bed unavailable: {exc}")
    cluster = testbed.Cluster.create(2, tmp_path_factory.mktemp("slurm-image"), outsider=True, shared_home=("h1", "h2"), containers=True)
    slurm = None
    try:
        cluster.share_image(cluster.hosts, torch_image)
        slurm = slurmbed.Slurm.start(cluster)
        yield slurm
    finally:
        if slurm is not None:
            slurm.stop()
        cluster.teardown()


def test_a_user_script_runs_in_the_image_on_two_slurm_nodes_checked_inside_it_and_leaves_no_container(slurm_boxes, torch_image):
    slurm = slurm_boxes
    home = slurm.cluster.hosts[0].home
    (home / "proj").mkdir(exist_ok=True)
    (home / "proj" / "train.py").write_text(SCRIPT)
    followed = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                            "train", "--slurm", "--nodes", "2", "--image", torch_image.ref, "--", "train.py"],
                                 env=slurm.env, check=False, timeout=180)
    said = followed.stdout + followed.stderr
    assert followed.returncode == 0, said[-4000:]
    run_id = re.search(r"^run (\S+): Slurm job \d+ submitted", followed.stdout, re.M).group(1)
    for rank in (0, 1):  # each rank in a container, with the image's Python
        assert re.search(rf"script rank={rank} container=True python=/usr/local/bin/python", said), said[-3000:]
    assert re.search(rf"^run {run_id}: Slurm job \d+ COMPLETED \(exit 0:0\); run succeeded", followed.stdout, re.M), said[-3000:]
    run_dir = home / "proj" / "runs" / run_id
    record = json.loads((run_dir / "run.json").read_text())
    check = json.loads((run_dir / "check-1.json").read_text())
    ids = set()
    for name in ("h1", "h2"):
        facts = check["hosts"][name]["facts"]
        assert facts["image_probe"]["ok"] is True, facts["image_probe"]
        assert facts["python"]["executable"].startswith("/usr/local/bin/python")  # the check looked inside the image
        ids.add(facts["container"]["image"]["id"])
        assert record["hosts"][name]["command"].startswith("/usr/bin/podman run --rm --name mnft-"), record["hosts"][name]["command"]
        assert record["hosts"][name]["container"]["name"] == f"mnft-{run_id}-{name}"
    assert len(ids) == 1 and None not in ids
    for host in slurm.cluster.hosts:  # the agents removed their containers; the probe's were --rm
        assert slurm.cluster.podman(host, "ps", "-a", "--format", "{{.Names}}").stdout.split() == []


def containers(slurm) -> dict[str, list[str]]:
    return {h.name: slurm.cluster.podman(h, "ps", "-a", "--format", "{{.Names}}").stdout.split() for h in slurm.cluster.hosts}


def test_stop_cancels_the_job_and_every_nodes_container_is_removed(slurm_boxes, torch_image):
    slurm = slurm_boxes
    home = slurm.cluster.hosts[0].home
    (home / "proj").mkdir(exist_ok=True)
    (home / "proj" / "train.py").write_text(SCRIPT)
    h1 = slurm.cluster.hosts[0]

    def mnft(*args: str):
        return slurm.cluster.run(h1, ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN, *args],
                                 env=slurm.env, check=False, timeout=120)

    started = mnft("train", "--slurm", "--detach", "--nodes", "2", "--image", torch_image.ref, "--", "train.py", "300")
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = started.stdout.strip().splitlines()[-1]
    deadline = time.monotonic() + 90
    while not all(any(n.startswith("mnft-" + run_id) for n in names) for names in containers(slurm).values()):
        assert time.monotonic() < deadline, f"the run's containers did not start: {containers(slurm)}"
        time.sleep(0.5)
    stopped = mnft("stop", run_id)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    deadline = time.monotonic() + 30
    while any(containers(slurm).values()):  # scancel: each node's agent ends its torchrun and removes its container
        assert time.monotonic() < deadline, f"left behind after scancel: {containers(slurm)}"
        time.sleep(0.5)


def test_a_node_without_the_image_and_an_image_without_python_refuse_the_attempt_before_anything_starts(slurm_boxes, tiny_images):
    slurm = slurm_boxes
    tiny = tiny_images[0]  # dash and sleep: no python3 inside
    slurm.cluster.load_image(slurm.cluster.hosts[:1], tiny)  # h1 only
    home = slurm.cluster.hosts[0].home
    (home / "proj").mkdir(exist_ok=True)
    (home / "proj" / "train.py").write_text(SCRIPT)
    followed = slurm.cluster.run(slurm.cluster.hosts[0], ["sh", "-c", 'cd proj && exec "$@"', "sh", slurm.cluster.python, "-c", MAIN,
                                                            "train", "--slurm", "--nodes", "2", "--image", tiny.ref, "--", "train.py"],
                                 env=slurm.env, check=False, timeout=180)
    said = followed.stdout + followed.stderr
    assert followed.returncode == 1, said[-4000:]
    assert "check failed on h1, h2" in said, said[-3000:]
    assert f"h2: image: h2 lacks {tiny.ref} (fix: mnft sync --image {tiny.ref}" in said
    assert f"h1: image: the probe inside {tiny.ref} failed: " in said
    assert "script rank=" not in said  # nothing started
    assert containers(slurm) == {"h1": [], "h2": []}  # the probe's container is gone (--rm)
