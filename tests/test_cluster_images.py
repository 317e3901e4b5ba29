"""`mnft sync --image` on a simulated cluster whose 4 hosts each have their own podman storage (Cluster.create(
containers=True)): the real CLI, the real runtime, images built on this machine (tests/images.py), no registry.

A host without the image gets it from the host that has it, and both hold the same id; a host holding another image
under the name is refused (named, nothing changed), then replaced with --force; with `invoke setup`'s mesh the image
is relayed host to host and this machine sends none of it; hosts sharing the directory of a .sif get it once. No
staging directory is left on any host. The tags carry this process's id: this machine's own podman storage (the
controller's) never holds them, so the source is always a host.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent
TAG = f"s{os.getpid()}"


@pytest.fixture(scope="module")
def bed(testbed, tmp_path_factory):
    """4 hosts with podman each, ~/img shared by h3 and h4; image A in h1 only, image B (another) in h4."""
    import images

    testbed.check_container_prerequisites()
    where = tmp_path_factory.mktemp("images")
    a, b = images.tiny_image(TAG, where), images.tiny_image(TAG + "b", where)
    testbed.Cluster.cleanup_stale()
    cluster = testbed.Cluster.create(4, tmp_path_factory.mktemp("cluster-images"), outsider=False, containers=True,
                                     shared_dirs={"~/img": ("h3", "h4")})
    try:
        h1, h2, h3, h4 = cluster.hosts
        cluster.load_image([h1], a)
        cluster.load_image([h4], b)
        cluster.podman(h4, "tag", b.ref, a.ref)  # h4: another image under A's name
        yield cluster, a, b
    finally:
        cluster.teardown()


def invoke(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    home = tmp_path / "controller-home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), MNFT_HOME=str(tmp_path / "mnft-home"))
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def sync_image(tmp_path: Path, inventory: Path, image: str, *extra: str) -> tuple[int, dict]:
    done = invoke(tmp_path, "sync", "--hosts", str(inventory), "--image", image, "--json", *extra)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}") from None


def image_id(cluster, host, ref: str) -> str | None:
    done = cluster.podman(host, "image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def staging_left(cluster) -> list[str]:
    """mnft's staging directories anywhere a host could have one: /var/tmp (this machine's, which the hosts share)
    and beside the .sif in each home."""
    found = [p for p in os.listdir("/var/tmp") if p.startswith("mnft-image-")]
    for host in cluster.hosts:
        img = host.home / "img"
        found += [f"{host.name}:{p}" for p in (os.listdir(img) if img.is_dir() else []) if p.startswith(".mnft-image-")]
    found += [f"shared:{p}" for p in os.listdir(cluster.shared_dir("~/img")) if p.startswith(".mnft-image-")]
    return found


def test_a_host_without_the_image_gets_it_from_the_host_that_has_it_with_the_same_id(bed, tmp_path):
    cluster, a, _ = bed
    h1, h2 = cluster.hosts[:2]
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", hosts=[h1, h2])
    assert image_id(cluster, h2, a.ref) is None
    code, report = sync_image(tmp_path, inventory, a.ref)
    assert code == 0, report
    assert (report["source"], report["id"], report["relay"]) == ("h1", "sha256:" + a.id, False)
    assert report["hosts"]["h1"]["status"] == "ok" and report["hosts"]["h2"]["status"] == "changed"
    assert image_id(cluster, h1, a.ref) == image_id(cluster, h2, a.ref) == a.id
    assert staging_left(cluster) == []

    code, again = sync_image(tmp_path, inventory, a.ref)  # nothing to do: said so
    assert code == 0 and {h["status"] for h in again["hosts"].values()} == {"ok"} and again["archive_bytes"] == 0


def test_a_host_holding_another_image_is_refused_by_name_then_replaced_with_force(bed, tmp_path):
    cluster, a, b = bed
    h1, h4 = cluster.hosts[0], cluster.hosts[3]
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml", hosts=[h1, h4])
    done = invoke(tmp_path, "sync", "--hosts", str(inventory), "--image", a.ref)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"h4 has sha256:{b.id[:12]}, h1 has sha256:{a.id[:12]}: pass --force" in done.stderr
    assert "nothing was changed on any host" in done.stderr and image_id(cluster, h4, a.ref) == b.id

    code, report = sync_image(tmp_path, inventory, a.ref, "--force")
    assert code == 0, report
    assert report["hosts"]["h4"]["status"] == "changed" and f"replaced sha256:{b.id[:12]}" in report["hosts"]["h4"]["notes"]
    assert image_id(cluster, h4, a.ref) == a.id
    assert image_id(cluster, h4, b.ref) == b.id, "the other image keeps its own name"
    assert staging_left(cluster) == []


def test_with_the_mesh_the_image_is_relayed_host_to_host_and_this_machine_sends_none_of_it(bed, tmp_path):
    cluster, a, _ = bed
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    book = tmp_path / "trust.yaml"
    book.write_text("- name: controller key\n  authorized_keys: {}\n- name: mesh\n  mesh: {}\n")
    setup = invoke(tmp_path, "setup", "--hosts", str(inventory), "--playbook", str(book))
    assert setup.returncode == 0, setup.stdout + setup.stderr
    for host in cluster.hosts[1:]:
        cluster.podman(host, "rmi", "--force", a.ref, check=False)
    assert [image_id(cluster, h, a.ref) for h in cluster.hosts] == [a.id, None, None, None]

    code, report = sync_image(tmp_path, inventory, a.ref)
    assert code == 0, report
    assert report["relay"] is True and report["source"] == "h1" and report["controller_bytes"] == 0
    vias = {name: h["via"] for name, h in report["hosts"].items() if name != "h1"}
    assert set(vias.values()) <= {"h1", "h2", "h3", "h4"}, vias  # from hosts, never this machine
    assert [image_id(cluster, h, a.ref) for h in cluster.hosts] == [a.id] * 4
    assert staging_left(cluster) == []


def test_hosts_sharing_the_directory_of_a_sif_get_it_once(bed, tmp_path):
    cluster, _, _ = bed
    h1, h2, h3, h4 = cluster.hosts
    sif = h1.home / "img" / "train.sif"
    sif.parent.mkdir(exist_ok=True)
    sif.write_bytes(os.urandom(300_000))
    want = "sha256:" + hashlib.sha256(sif.read_bytes()).hexdigest()
    inventory = cluster.write_inventory(tmp_path / "inventory.yaml")
    code, report = sync_image(tmp_path, inventory, "~/img/train.sif")
    assert code == 0, report
    assert (report["source"], report["id"]) == ("h1", want)
    actions = {name: (h["action"], h["status"]) for name, h in report["hosts"].items()}
    assert actions["h1"] == ("none", "ok") and actions["h2"] == ("receive", "changed")
    assert sorted([actions["h3"], actions["h4"]]) == [("receive", "changed"), ("verify", "ok")], actions
    assert all(h["id"] == want for h in report["hosts"].values())
    assert (h2.home / "img" / "train.sif").read_bytes() == sif.read_bytes()
    assert (cluster.shared_dir("~/img") / "train.sif").read_bytes() == sif.read_bytes()
    assert staging_left(cluster) == []
