"""`mnft check --image` on a simulated cluster whose 2 hosts each have their own podman (Cluster.create(containers=True)):
the real CLI, the real runtime, images built on this machine (tests/images.py), no registry.

The hosts' own Python is Debian's /usr/bin/python3, which has no torch: what check shows and compares is the image's.
The image is this machine's Python with a stand-in torch (its version.py only, version TORCH): check reads torch's
version without importing it, and the image is 100 MB instead of the torch image's 1 GB (the module stays under a
minute on 2 cores: loading the torch image into 2 hosts' storage alone takes 35-45 s here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
HOST_PYTHON = "/usr/bin/python3"  # Debian's: no torch, no paramiko
TORCH = "2.13.0+image"  # the stand-in torch's version in the image
OTHER = "localhost/mnft-check:other"  # h1: the Python image; h2: a tiny one without Python
ONLY_H1 = "localhost/mnft-check:only-h1"


def python_image(directory: Path):
    """localhost/mnft-check:py: this machine's Python at /usr/local (python3 on PATH) and a stand-in torch."""
    import images

    root = images._torch_root([])  # the interpreter and its stdlib, no distribution
    site = f"{images.PYTHON_HOME}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
    root[f"{site}/torch/__init__.py"] = images.Data(b"raise ImportError('a stand-in: check reads torch/version.py')\n")
    root[f"{site}/torch/version.py"] = images.Data(f"__version__ = {TORCH!r}\ncuda = None\ngit_version = 'stand-in'\n".encode())
    return images.build(root, "localhost/mnft-check:py", directory / "mnft-check-py.tar", cmd=["python3"])


@pytest.fixture(scope="module")
def bed(container_cluster, tiny_images, tmp_path_factory):
    """The 2 hosts with podman each (conftest's container_cluster), the Python image in both, OTHER and ONLY_H1 tagged
    as described above."""
    if not os.access(HOST_PYTHON, os.X_OK):
        pytest.skip(f"needs {HOST_PYTHON} (Debian's python3) as the hosts' own Python")
    cluster, image, tiny = container_cluster, python_image(tmp_path_factory.mktemp("images")), tiny_images[0]
    h1, h2 = cluster.hosts
    cluster.load_image([h1, h2], image)
    cluster.load_image([h2], tiny)
    cluster.podman(h1, "tag", image.ref, OTHER, ONLY_H1)
    cluster.podman(h2, "tag", tiny.ref, OTHER)
    return cluster, image, tiny


def check(cluster, tmp_path: Path, *args: str, python: str = HOST_PYTHON) -> tuple[int, dict]:
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", python=python)
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"))
    done = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "check", "--hosts", str(inventory), "--json", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 2, done.stderr
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}") from None


def errors(report: dict, host: str) -> list[dict]:
    return [p for p in report["hosts"][host]["problems"] if p["severity"] == "error"]


def test_the_same_image_everywhere_passes_and_the_torch_shown_is_the_images(bed, tmp_path):
    cluster, torch_image, _ = bed
    code, report = check(cluster, tmp_path, "--image", torch_image.ref)  # the network test too: on the hosts' Python
    assert code == 0, json.dumps(report["hosts"], indent=1)[-3000:]
    assert report["port_free"] is True and all(report["hosts"][n]["reach"]["ok"] for n in ("h1", "h2"))
    for name in ("h1", "h2"):
        facts = report["hosts"][name]["facts"]
        assert facts["container"]["runtime"] == "podman"
        assert facts["container"]["image"] == {"ref": torch_image.ref, "present": True, "id": "sha256:" + torch_image.id}
        assert facts["host_python"]["executable"] == HOST_PYTHON  # no torch there
        assert facts["torch"]["version"] == TORCH  # the image's: the hosts' own Python has no torch
        assert facts["python"]["executable"] == "/usr/local/bin/python3" and facts["image_probe"]["ok"]


def test_a_different_image_on_h2_is_named_with_both_ids_and_the_fix(bed, tmp_path):
    cluster, torch_image, tiny = bed
    code, report = check(cluster, tmp_path, "--image", OTHER, "--no-network")
    assert code == 1 and errors(report, "h1") == []
    assert {p["field"] for p in errors(report, "h2")} == {"image"}
    messages = [p["message"] for p in errors(report, "h2")]
    assert f"h2 has sha256:{tiny.id[:12]}…, the master h1 has sha256:{torch_image.id[:12]}…" in messages
    assert any(p["fix"] == f"mnft sync --image {OTHER} --force" for p in errors(report, "h2"))
    # and the tiny image has no python3: the probe inside it says so, with the fix
    inside = next(p for p in errors(report, "h2") if p["message"].startswith("the probe inside"))
    assert "python3" in inside["message"] and inside["fix"].startswith("the image needs python3")


def test_an_image_absent_on_h2_is_named_with_the_sync_fix(bed, tmp_path):
    cluster, _, _ = bed
    code, report = check(cluster, tmp_path, "--image", ONLY_H1, "--no-network")
    assert code == 1 and errors(report, "h1") == []
    assert [(p["field"], p["message"], p["fix"]) for p in errors(report, "h2")] == [
        ("image", f"h2 lacks {ONLY_H1}", f"mnft sync --image {ONLY_H1} (relays it from a host that has it)")]
    assert report["hosts"]["h2"]["facts"]["torch"] is None  # not compared: nothing ran inside


def test_a_module_the_image_lacks_is_named_by_the_preflight_inside_it(bed, tmp_path):
    cluster, torch_image, _ = bed
    src = tmp_path / "lab"
    src.mkdir()
    (src / "train.py").write_text("import torch\nimport paramiko\n")
    # the hosts' Python here is this machine's, which has paramiko (mnft's own dependency); the image has not
    code, report = check(cluster, tmp_path, "--image", torch_image.ref, "--no-network", "--src", str(src), "--", "train.py",
                         python=cluster.python)
    assert code == 1
    for name in ("h1", "h2"):
        assert [(p["field"], p["message"]) for p in errors(report, name)] == [
            ("module", f"paramiko is not importable by /usr/local/bin/python3 in the image {torch_image.ref} (imported at train.py:2)")]
        assert report["hosts"][name]["facts"]["modules"] == {"paramiko": False, "torch": True}
