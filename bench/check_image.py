#!/usr/bin/env python3
"""Benchmark: `check` at N simulated hosts (default 2) with and without `--image`, each host with its own podman.

Cases, interleaved run by run (the same load for each):

  no image        the hosts' own Python has torch (this machine's, as the test bed gives it): today's check
  slim image      --image: this machine's Python with a stand-in torch (≈ 100 MB); the hosts' own Python is
                  Debian's /usr/bin/python3, without torch (tests/test_cluster_check_image.py's image)
  torch image     --image: the test bed's CPU-torch image (≈ 1 GB, tests/images.py), hosts' Python Debian's

Each case is timed as the library call (a fresh Fleet: connect + gather, the network test included) and as the CLI
(`mnft check --json`, a new Python each time). One warm-up run per case first (the page cache, each host's first
container start), then --repeat runs; prints the median and every run, and the load average before and after.
Also the image step alone on an open fleet, per host: the host step's own time, and the container's (podman run of
the probe inside). Needs root (the simulated cluster) and podman with runc.

    python bench/check_image.py [--hosts 2] [--repeat 5] [--no-torch-image]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed and its images

import images  # noqa: E402
from test_cluster_check_image import HOST_PYTHON, python_image  # noqa: E402
from testbed import Cluster, check_container_prerequisites  # noqa: E402

from mnft.check.findings import CheckOptions  # noqa: E402
from mnft.check.gather import gather  # noqa: E402
from mnft.check.inimage import gather_image_facts  # noqa: E402
from mnft.hosts.connection import Timeouts  # noqa: E402
from mnft.hosts.fleet import Fleet  # noqa: E402
from mnft.hosts.inventory import load  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-torch-image", action="store_true", help="leave out the 1 GB image (its load takes 35-45 s)")
    args = parser.parse_args()
    check_container_prerequisites()
    work = Path(tempfile.mkdtemp(prefix="mnft-bench-check-image-"))
    slim = python_image(work)
    cluster = Cluster.create(args.hosts, work / "bed", outsider=False, containers=True)
    times: dict[tuple[str, str], list[float]] = {}
    try:
        cluster.load_image(cluster.hosts, slim)
        cases = [("no image", cluster.python, None), ("slim image (100 MB)", HOST_PYTHON, slim.ref)]
        if not args.no_torch_image:
            torch_image = images.torch_image()
            cluster.load_image(cluster.hosts, torch_image)
            cases.append(("torch image (1 GB)", HOST_PYTHON, torch_image.ref))
        inventories = {python: cluster.write_inventory(work / f"inventory-{i}.yaml", python=python)
                       for i, python in enumerate({p for _, p, _ in cases})}
        home = work / "home"
        home.mkdir()
        env = dict(os.environ, HOME=str(home), MNFT_HOME=str(work / "mnft-home"))

        def lib(python: str, image: str | None) -> float:
            started = time.perf_counter()
            with Fleet(load(str(inventories[python])), Timeouts(connect=10, command=60)) as fleet:
                report = gather(fleet, CheckOptions(image=image))
            took = time.perf_counter() - started
            if int(report.exit_code()) != 0:
                raise SystemExit(f"check failed: {[(p.host, p.message) for p in report.problems]}")
            return took

        def cli(python: str, image: str | None) -> float:
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", "from mnft.cli.main import main; main()", "check", "--hosts", str(inventories[python]), "--json",
                                   *(["--image", image] if image else [])], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            took = time.perf_counter() - started
            if done.returncode != 0:
                raise SystemExit(f"mnft check exited {done.returncode}: {done.stderr[-2000:]}")
            return took

        print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
        for _, python, image in cases:
            lib(python, image)
        for _ in range(args.repeat):
            for name, python, image in cases:
                times.setdefault((name, "lib"), []).append(lib(python, image))
                times.setdefault((name, "cli"), []).append(cli(python, image))
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        with Fleet(load(str(inventories[HOST_PYTHON])), Timeouts(connect=10, command=60)) as fleet:
            fleet.connect_all()
            for _ in range(3):
                started = time.perf_counter()
                results, facts, _ = gather_image_facts(fleet, slim.ref)
                took = time.perf_counter() - started
                print(f"image step alone (slim image, open connections) {took:.2f}s: " + ", ".join(
                    f"{name} {results[name].seconds:.2f}s (container {facts[name]['image_probe']['seconds']:.2f}s, "
                    f"host facts {facts[name]['timings']['total_s']:.2f}s)" for name in facts))
    finally:
        cluster.teardown()
    print(f"\ncheck at {args.hosts} hosts, seconds, median of {args.repeat}:")
    for (name, kind), values in times.items():
        print(f"  {kind}  {name:22} {statistics.median(values):5.2f}   ({', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
