#!/usr/bin/env python3
"""Benchmark: `sync --image` to N simulated hosts (default 8), each with its own podman storage, side by side in one
run on the same image:

  relay        `invoke setup`'s SSH mesh: this machine sends the image to one host, hosts relay it to each other
               (holders doubling each round), then every host loads it
  controller   --no-relay: this machine sends the image to every host itself (16 at once), each host loads it

The image (default ≈ 300 MB of incompressible data, one layer) is on this machine only, in
a podman storage of the bench's own (the machine's own storage is never touched); before each run every host's copy
is removed. Prints seconds, the ratio, and the bytes this machine sent (its bridge's tx counter) against the image's
size. Needs root (the simulated cluster) and podman with runc.

    python bench/image_relay.py [--hosts 8] [--mb 300] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed and its images

import images  # noqa: E402
from testbed import Cluster, check_container_prerequisites  # noqa: E402

from mnft.hosts.inventory import load  # noqa: E402
from mnft.image.distribute import sync_image  # noqa: E402


def make_image(work: Path, megabytes: int) -> images.Image:
    """localhost/mnft-bench:<pid>: the tiny image's base and `megabytes` of random files (nothing compresses)."""
    data = work / "data"
    data.mkdir()
    root = images._base_root(["/usr/bin/dash"])
    chunk = max(1, megabytes // 6)
    for i in range(6):
        path = data / f"blob{i}"
        with open(path, "wb") as f:
            for _ in range(chunk):
                f.write(os.urandom(1 << 20))
        root[f"opt/bench/blob{i}"] = path
    return images.build(root, f"localhost/mnft-bench:{os.getpid()}", work / "bench.tar", cmd=["/bin/sh"])


def controller_podman(work: Path) -> str:
    """A podman of the bench's own on this machine (its storage in a short path: podman refuses a long runroot)."""
    root = Path(tempfile.mkdtemp(prefix="mnft-bench-", dir="/tmp"))
    wrapper = work / "podman"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("podman")} --root {root}/root --runroot {root}/run --storage-driver vfs --runtime runc "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def invoke(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--mb", type=int, default=300, help="megabytes of data in the image")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    check_container_prerequisites()
    work = Path(tempfile.mkdtemp(prefix="mnft-bench-image-"))
    Cluster.cleanup_stale()
    cluster = Cluster.create(args.hosts, work / "cluster", outsider=False, containers=True)
    podman = controller_podman(work)
    storage = Path(open(podman).read().split("--root ")[1].split("/root")[0])
    try:
        started = time.monotonic()
        image = make_image(work, args.mb)
        size = image.archive.stat().st_size
        subprocess.run([podman, "load", "-i", str(image.archive)], check=True, capture_output=True, timeout=600)
        print(f"image {image.ref}: {size / 1e6:.0f} MB, built and loaded here in {time.monotonic() - started:.1f} s", flush=True)
        inventory_path = cluster.write_inventory(work / "inventory.yaml")
        home = work / "controller-home"
        home.mkdir()
        env = dict(os.environ, HOME=str(home), MNFT_HOME=str(work / "mnft-home"))
        book = work / "trust.yaml"
        book.write_text("- name: controller key\n  authorized_keys: {}\n- name: mesh\n  mesh: {}\n")
        done = invoke(env, "setup", "--hosts", str(inventory_path), "--playbook", str(book))
        if done.returncode != 0:
            sys.exit(f"setup failed:\n{done.stdout}\n{done.stderr}")
        os.environ["HOME"] = str(home)  # sync_image runs here, as the controller the setup made
        inventory = load(inventory_path)
        counter = Path(f"/sys/class/net/{cluster.bridge}/statistics/tx_bytes")
        rows = []
        for attempt in range(args.repeat):
            for mode in ("relay", "controller"):
                for host in cluster.hosts:
                    cluster.podman(host, "rmi", "--force", image.ref, check=False)
                before = int(counter.read_text())
                t0 = time.monotonic()
                report = sync_image(inventory, image.ref, relay=mode == "relay", controller_runtime=podman)
                seconds = time.monotonic() - t0
                sent = int(counter.read_text()) - before
                if not report.ok or report.relay != (mode == "relay"):
                    sys.exit(f"{mode}: not ok: {[(h.host, h.status, h.error) for h in report.hosts.values()]}")
                loads = sorted(h.seconds for h in report.hosts.values())
                rows.append((mode, attempt, seconds, sent, loads[-1]))
                print(f"  {mode:<10} run {attempt + 1}: {seconds:6.1f} s, this machine sent {sent / 1e6:7.0f} MB "
                      f"({sent / size:4.1f}x the image), slowest host {loads[-1]:.1f} s", flush=True)
        relay = min(r[2] for r in rows if r[0] == "relay")
        direct = min(r[2] for r in rows if r[0] == "controller")
        relay_sent = min(r[3] for r in rows if r[0] == "relay")
        direct_sent = min(r[3] for r in rows if r[0] == "controller")
        print(f"\n{args.hosts} hosts, {size / 1e6:.0f} MB image (best of {args.repeat}):")
        print(f"  {'':<22}{'seconds':>9}{'MB sent by this machine':>26}")
        print(f"  {'relay over the mesh':<22}{relay:9.1f}{relay_sent / 1e6:26.0f}")
        print(f"  {'each from controller':<22}{direct:9.1f}{direct_sent / 1e6:26.0f}")
        print(f"  ratio relay/controller: {relay / direct:.2f} in time, {relay_sent / max(direct_sent, 1):.2f} in bytes sent")
    finally:
        cluster.teardown()
        subprocess.run([podman, "rmi", "--all", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
