#!/usr/bin/env python3
"""The job preflight's cost: `check` of 8 simulated hosts without a job, and with the job mnft would launch (the
lora recipe: its entry point read, its imports followed through mnft's recipe modules, every module it needs looked
up in each host's Python within the facts probe). Side by side in one run, the two taking turns.

    python bench/preflight.py [--hosts 8] [--reps 5]

Printed: the median wall time of each, the difference (goal: ≤ 1 s added at 8 hosts), the controller-side reading
of the source (job_needs) alone, and the modules each host looked up. Needs root (the test bed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed (tests/testbed.py)

from testbed import Cluster  # noqa: E402

from mnft.check.findings import CheckOptions  # noqa: E402
from mnft.check.gather import gather  # noqa: E402
from mnft.hosts import inventory as inventory_mod  # noqa: E402
from mnft.hosts.fleet import Fleet  # noqa: E402
from mnft.run.job import recipe_job  # noqa: E402
from mnft.run.needs import job_needs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mnft-bench-preflight-"))
    with Cluster.create(args.hosts, work / "cluster") as cluster:
        inv = inventory_mod.load(cluster.write_inventory(work / "inv.yaml"))
        t = time.perf_counter()
        needs = job_needs(recipe_job("lora"), REPO, synced=True)
        read_s = time.perf_counter() - t
        plain = CheckOptions(network=True, code=False)
        with_job = replace(plain, modules=needs.modules)
        times: dict[str, list[float]] = {"check": [], "check + job preflight": []}
        for rep in range(args.reps):
            order = [("check", plain), ("check + job preflight", with_job)]
            for name, options in order if rep % 2 == 0 else reversed(order):
                t = time.perf_counter()
                with Fleet(inv) as fleet:
                    report = gather(fleet, options)
                times[name].append(time.perf_counter() - t)
                assert report.exit_code() == 0, [p.message for p in report.problems]
        base, job = (statistics.median(times[k]) for k in times)
        print(f"{args.hosts} hosts, {args.reps} repetitions each, medians:")
        print(f"  check                  {base:6.2f} s")
        print(f"  check + job preflight  {job:6.2f} s   ({job / base:.2f}×, {job - base:+.2f} s on the hosts)")
        print(f"  reading the job's source on the controller: {read_s * 1000:.0f} ms, {needs.read} files, "
              f"{len(needs.modules)} modules looked up on every host: {', '.join(n.module for n in needs.modules)}")
        print(f"  the preflight adds {job - base + read_s:+.2f} s in all (goal ≤ +1 s at 8 hosts)")


if __name__ == "__main__":
    main()
