"""The test bed's container runtime (Cluster.create(containers=True), tests/images.py): every host has a podman and a
storage of its own, images are built here and loaded into chosen hosts, and teardown leaves nothing running or
mounted. What issue 27's tests stand on."""

from __future__ import annotations

import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parent.parent


def exists(cluster, host, ref: str) -> bool:
    return cluster.podman(host, "image", "exists", ref, check=False).returncode == 0


def image_id(cluster, host, ref: str) -> str:
    return cluster.podman(host, "image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()


def conmons(cluster, host) -> list[int]:
    return [pid for pid, cmd in cluster.processes(host) if os.path.basename(cmd.split(" ", 1)[0]) == "conmon"]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture(scope="module")
def torch_on_h1(container_cluster, torch_image):
    container_cluster.share_image([container_cluster.hosts[0]], torch_image)
    return torch_image


def test_an_image_loaded_into_one_host_is_in_that_host_only(container_cluster, tiny_images):
    cluster, (a, b) = container_cluster, tiny_images
    h1, h2 = cluster.hosts
    cluster.load_image([h1], a)
    cluster.load_image([h2], b)
    assert a.id != b.id
    assert (exists(cluster, h1, a.ref), exists(cluster, h2, a.ref)) == (True, False)
    assert (exists(cluster, h1, b.ref), exists(cluster, h2, b.ref)) == (False, True)
    assert (image_id(cluster, h1, a.ref), image_id(cluster, h2, b.ref)) == (a.id, b.id)  # the id: the config's digest
    shown = cluster.podman(h1, "run", "--rm", "--network", "host", a.ref, "sh", "-c", "read tag < /etc/mnft-tiny; echo $tag")
    assert shown.stdout.strip() == "a"


def test_a_saved_and_reloaded_image_keeps_its_id(container_cluster, tiny_images):
    cluster, (a, _) = container_cluster, tiny_images
    h1, h2 = cluster.hosts
    cluster.load_image([h1], a)
    cluster.podman(h1, "save", "--output", "/tmp/a.tar", a.ref)  # h1's private /tmp: here, under its root
    cluster.load_image([h2], h1.root / "tmp" / "a.tar")
    assert image_id(cluster, h2, a.ref) == a.id
    cluster.podman(h2, "rmi", a.ref)
    assert not exists(cluster, h2, a.ref) and exists(cluster, h1, a.ref)


def test_a_shared_image_is_in_the_hosts_given_only_and_read_only_there(container_cluster, torch_on_h1):
    cluster = container_cluster
    h1, h2 = cluster.hosts
    assert (exists(cluster, h1, torch_on_h1.ref), exists(cluster, h2, torch_on_h1.ref)) == (True, False)
    assert image_id(cluster, h1, torch_on_h1.ref) == torch_on_h1.id
    refused = cluster.podman(h1, "rmi", torch_on_h1.ref, check=False)
    assert refused.returncode != 0 and "read-only" in refused.stderr
    cluster.podman(h1, "tag", torch_on_h1.ref, "localhost/other:1")  # a name in h1's own storage, not in the store
    assert image_id(cluster, h1, "localhost/other:1") == torch_on_h1.id
    cluster.share_image([h2], torch_on_h1)
    assert exists(cluster, h2, torch_on_h1.ref) and not exists(cluster, h2, "localhost/other:1")


def test_a_container_on_the_host_network_has_its_hosts_address_and_no_other(container_cluster, torch_on_h1):
    cluster = container_cluster
    h1, h2 = cluster.hosts
    probe = textwrap.dedent(f"""
        import errno, socket
        socket.socket().bind(({h1.address!r}, 0))
        socket.create_connection(({h1.address!r}, 22), timeout=5).close()  # h1's own sshd, on h1's address
        try:
            socket.socket().bind(({h2.address!r}, 0))
        except OSError as exc:
            print("h2's address:", errno.errorcode[exc.errno])
        print("hostname:", socket.gethostname())
    """)
    done = cluster.podman(h1, "run", "--rm", "--network", "host", "--pull", "never", torch_on_h1.ref, "python3", "-c", probe)
    assert done.stdout.split("\n")[:2] == ["h2's address: EADDRNOTAVAIL", "hostname: h1"]


def test_the_torch_image_runs_a_two_process_gloo_all_reduce(container_cluster, torch_on_h1):
    cluster, h1 = container_cluster, container_cluster.hosts[0]
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():g}", flush=True)
        dist.destroy_process_group()
    """)
    job = h1.root / "tmp" / "job"  # /tmp/job inside h1, bound at the same path into the container
    job.mkdir()
    (job / "allreduce.py").write_text(script)
    done = cluster.podman(
        h1, "run", "--rm", "--network", "host", "--ipc", "host", "--pull", "never", "--log-driver", "none",
        "-v", "/tmp/job:/tmp/job:ro", "--workdir", "/tmp/job", "-e", "GLOO_SOCKET_IFNAME=eth0", torch_on_h1.ref,
        "python3", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", h1.address,
        "--master-port", "29611", "allreduce.py", timeout=180)
    assert sorted(re.findall(r"rank \d of \d: \d+", done.stdout)) == ["rank 0 of 2: 3", "rank 1 of 2: 3"]  # lines may interleave


def test_the_lora_recipe_imports_in_the_torch_image_as_a_user_with_the_run_paths_flags(container_cluster, torch_on_h1):
    """What mnft's command line for a run passes (docs/containers.md): the checkout bound read-only at its own path,
    --user, the host's network and IPC; the recipe's every import (torch, transformers, peft, tokenizers, yaml…)."""
    cluster, h1 = container_cluster, container_cluster.hosts[0]
    cluster.run(h1, ["sh", "-c", "mkdir -p /tmp/out && chown 4242:4242 /tmp/out"])
    imports = "import os, mnft.recipes.lora, mnft.recipes.full; open('/tmp/out/ok', 'w').write(str(os.getuid()))"
    cluster.podman(
        h1, "run", "--rm", "--network", "host", "--ipc", "host", "--pull", "never", "--log-driver", "none",
        "--user", "4242:4242", "--security-opt", "label=disable", "-v", f"{REPO}:{REPO}:ro", "-v", "/tmp/out:/tmp/out",
        "-e", f"PYTHONPATH={REPO}", "--workdir", "/tmp/out", torch_on_h1.ref, "python3", "-c", imports, timeout=180)
    written = h1.root / "tmp" / "out" / "ok"
    assert (written.read_text(), written.stat().st_uid) == ("4242", 4242)


def test_a_user_runs_podman_rootless_over_ssh_with_images_of_its_own(container_cluster, tiny_images):
    cluster, (_, b) = container_cluster, tiny_images
    h1 = cluster.hosts[0]
    cluster.podman(h1, "rmi", "--ignore", b.ref)
    cluster.add_user("pod")
    uid = subprocess.run(cluster.ssh_argv(h1, ["id", "-u"], user="pod"), capture_output=True, text=True, check=True).stdout.strip()
    ssh = cluster.ssh_argv(h1, ["podman", "load", "--quiet"], user="pod")
    with open(b.archive, "rb") as archive:
        subprocess.run(ssh, stdin=archive, capture_output=True, check=True, timeout=120)
    show = "read tag < /etc/mnft-tiny; echo $tag; while read key value rest; do [ $key = Uid: ] && echo $value; done < /proc/self/status; echo end"
    run = ["podman", "run", "--rm", "--network", "host", "--userns", "keep-id", "--pull", "never", b.ref, "sh", "-c", show]
    done = subprocess.run(cluster.ssh_argv(h1, run, user="pod"), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["b", uid, "end"]  # --userns keep-id: the user's own uid inside
    assert not exists(cluster, h1, b.ref)  # root's storage is another one


def test_teardown_leaves_no_container_no_conmon_no_mount_and_no_storage(fresh_cluster_factory, tiny_images):
    cluster, (a, _) = fresh_cluster_factory(2, containers=True), tiny_images
    h1, h2 = cluster.hosts
    cluster.load_image(cluster.hosts, a)
    cluster.podman(h1, "run", "-d", "--name", "on-host-net", "--network", "host", a.ref, "sleep", "1000")
    cluster.podman(h2, "run", "-d", "--name", "own-net", "--network", "none", a.ref, "sleep", "1000")  # not in h2's netns
    cluster.podman(h2, "run", "-d", "--name", "orphan", "--network", "none", a.ref, "sleep", "1000")
    ids = {h.name: cluster.container_ids(h) for h in cluster.hosts}
    running = {h.name: sorted(cluster.podman(h, "ps", "--quiet", "--no-trunc").stdout.split()) for h in cluster.hosts}
    assert [len(ids["h1"]), len(ids["h2"])] == [1, 2] and running == ids
    held = conmons(cluster, h1) + conmons(cluster, h2)
    assert len(held) == 3
    workers = [int(p) for i in ids["h1"] + ids["h2"]
               for p in Path(f"/sys/fs/cgroup/pids/libpod_parent/libpod-{i}/cgroup.procs").read_text().split()]
    orphan_conmon = next(pid for pid in held if "orphan" in Path(f"/proc/{pid}/cmdline").read_text())
    os.kill(orphan_conmon, 9)  # a container whose conmon is gone: it runs on, podman still lists it
    assert cluster.podman(h2, "ps", "--quiet", "--filter", "name=orphan").stdout.strip()
    storage = [cluster._storage(h) for h in cluster.hosts]

    cluster.teardown()

    assert not [pid for pid in held + workers if alive(pid)]
    assert not [g for i in ids["h1"] + ids["h2"] for g in Path("/sys/fs/cgroup").glob(f"*/libpod_parent/libpod-{i}")]
    mounted = Path("/proc/self/mountinfo").read_text()
    assert str(cluster.workdir) not in mounted and not [s for s in storage if s.exists()]
