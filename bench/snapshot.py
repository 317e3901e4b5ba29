#!/usr/bin/env python3
"""Benchmark a run's code placement (mnft.sync.snapshot: fixed here, a snapshot on every host, the job's directory)
on the simulated cluster: a generated tree (default 2 GB in 400 files) to 4 hosts.

Printed side by side, in one run:
  1. the first run of the tree: seconds, bytes sent, disk used per host (its snapshot and its job directory)
  2. a second run of the tree with one file changed: the same, and its ratio to the first     goal: that file's cost
  3. a no-op start (the same tree, a new job): seconds against the sync goal                  goal ≤ 1 s at 4 hosts
     and, beside it, `mnft sync`'s no-op into the workdir (the reference: what a start cost before)

"Disk used" is what `du` counts for the new directories beside the ones already there (hard links counted once:
what the run really added to the host's disk). Run as root: python bench/snapshot.py [--hosts 4] [--mb 2048]
[--files 400] [--reps 3]. Timings vary with the machine's load; read the bytes and ratios first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]  # mnft; the test bed

from testbed import Cluster  # noqa: E402

from mnft.core.output import fmt_size  # noqa: E402
from mnft.hosts import inventory as inventory_mod  # noqa: E402
from mnft.hosts.fleet import Fleet  # noqa: E402
from mnft.sync import mirror, snapshot  # noqa: E402


def generate(root: Path, files: int, total_mb: int) -> None:
    per = total_mb * 1024 * 1024 // files
    chunk = os.urandom(1 << 20)
    for i in range(files):
        path = root / f"pkg{i % 20:02d}" / f"shard{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:  # distinct contents per file, cheaply: a counter ahead of each MiB
            left = per
            while left > 0:
                piece = min(left, len(chunk))
                f.write(i.to_bytes(8, "little") + chunk[: piece - 8])
                left -= piece
    (root / "train.py").write_text("print('v1')\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)


def du(cluster: Cluster, host, *paths: str) -> int:
    """Bytes `du` counts for the paths together on the host (a hard link counted once)."""
    done = cluster.run(host, ["du", "-s", "-B1", "-c", "--", *paths], timeout=600)
    return int(done.stdout.strip().splitlines()[-1].split()[0])


def place(inventory, src: Path, store: Path, job: str):
    started = time.monotonic()
    fixed = snapshot.fix(src, root=store)
    with Fleet(inventory) as fleet:
        placed = snapshot.place(inventory, fixed.tree, job, fleet=fleet)
    seconds = time.monotonic() - started
    fixed.release()
    assert placed.ok, [r.summary() for r in placed.reports]
    sent = sum(h.bytes_sent for r in placed.reports for h in r.hosts.values())
    return fixed.tree.digest, seconds, sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--mb", type=int, default=2048)
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mnft-bench-snapshot-"))
    src, store = work / "src", work / "store"
    src.mkdir()
    print(f"generating {args.mb} MB in {args.files} files …", flush=True)
    generate(src, args.files, args.mb)
    with Cluster.create(args.hosts, work / "cluster", outsider=False) as cluster:
        inv = inventory_mod.load(cluster.write_inventory(work / "inv.yaml", workdir="/root/bench"))
        host = cluster.hosts[0]
        code = "/root/bench/.mnft/code"

        first, t1, sent1 = place(inv, src, store, "job-1")
        disk1 = du(cluster, host, f"{code}/{first[:16]}", "/root/bench/outputs/job-1")

        (src / "train.py").write_text("print('v2: one changed file')\n")
        second, t2, sent2 = place(inv, src, store, "job-2")
        both = du(cluster, host, f"{code}/{first[:16]}", "/root/bench/outputs/job-1", f"{code}/{second[:16]}", "/root/bench/outputs/job-2")
        disk2 = both - disk1

        noop = []
        for i in range(args.reps):
            _, seconds, _ = place(inv, src, store, f"job-noop-{i}")
            noop.append(seconds)
        assert mirror.sync_code(inv, src, progress=False).ok  # the workdir's checkout, once, then its no-op
        ref = []
        for _ in range(args.reps):
            started = time.monotonic()
            assert mirror.sync_code(inv, src, progress=False).ok
            ref.append(time.monotonic() - started)

    tree = sum(p.stat().st_size for p in src.rglob("*") if p.is_file() and ".git" not in p.parts)
    print(f"\ntree: {fmt_size(tree)} in {args.files + 1} files, {args.hosts} hosts\n")
    print(f"{'':44} {'first run':>14} {'one file changed':>18} {'ratio':>10}")
    print(f"{'seconds (fix here + place on every host)':44} {t1:14.2f} {t2:18.2f} {t2 / t1:10.4f}")
    print(f"{'bytes sent to the hosts (all)':44} {fmt_size(sent1):>14} {fmt_size(sent2):>18} {sent2 / max(sent1, 1):10.6f}")
    print(f"{'disk added on a host (snapshot + job dir)':44} {fmt_size(disk1):>14} {fmt_size(disk2):>18} {disk2 / max(disk1, 1):10.6f}")
    print(f"\nno-op start (median of {args.reps}): {median(noop):.2f} s (runs: {', '.join(f'{s:.2f}' for s in noop)}); "
          f"reference, `mnft sync` no-op into the workdir: {median(ref):.2f} s; ratio {median(noop) / median(ref):.2f}")
    subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
