#!/usr/bin/env python3
"""Benchmark `mnft sync` on the simulated cluster: a generated 100 MB / 2,000-file tree to 8 hosts.

Printed side by side, in one run:
  1. first sync: mnft (read, plan, rsync, verify by hash) vs plain parallel `rsync -a` over ssh   goal ≤ 1.2×
  2. no-op re-sync: mnft with nothing to change                                                  goal ≤ 1 s
  3. one file changed: bytes mnft sent per host vs the tree's size                               goal < 1 %

Each is measured --reps times (default 3) and the median printed; mnft and the baseline alternate which runs
first, so neither always meets a warm page cache. The baseline gets the same exclude rules as mnft.

Run as root: python bench/sync.py [--hosts 8] [--mb 100] [--files 2000] [--reps 3]. Timings vary with the
machine's load; read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]  # mnft; the test bed

from testbed import Cluster  # noqa: E402

from mnft.hosts import inventory as inventory_mod  # noqa: E402
from mnft.sync import mirror, rsync, source  # noqa: E402


def generate(root: Path, files: int, total_mb: int, seed: int = 7) -> int:
    """`files` files in nested directories, `total_mb` MB of incompressible bytes, a .gitignore and ignored junk."""
    rng = random.Random(seed)
    per = total_mb * 1024 * 1024 // files
    total = 0
    for i in range(files):
        path = root / f"pkg{i % 20:02d}" / f"mod{i % 7}" / f"file{i:05d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        size = max(1, int(per * rng.uniform(0.5, 1.5)))
        path.write_bytes(os.urandom(size))
        total += size
    (root / ".gitignore").write_text("*.log\n")
    (root / "ignored.log").write_bytes(os.urandom(1 << 20))
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return total


def plain_rsync(cluster: Cluster, src: Path, workdir: str, rules_file: Path) -> float:
    """The baseline: one `rsync -a` per host over ssh, all at once, with mnft's exclude rules, no verification."""
    def one(host) -> None:
        ssh = f"ssh -F /dev/null -i {cluster.controller_key} -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile={cluster.known_hosts}"
        subprocess.run(["rsync", "-a", "--from0", f"--filter=merge {rules_file}", "-e", ssh, f"{src}/", f"root@{host.address}:{workdir}/"],
                       check=True, capture_output=True)

    started = time.monotonic()
    with ThreadPoolExecutor(len(cluster.hosts)) as pool:
        list(pool.map(one, cluster.hosts))
    return time.monotonic() - started


def timed(fn):
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def wipe(cluster: Cluster, *workdirs: str) -> None:
    for host in cluster.hosts:
        cluster.run(host, ["rm", "-rf", "--", *workdirs], timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3, help="repetitions; mnft and plain rsync alternate which goes first")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mnft-bench-sync-"))
    os.environ["MNFT_HOME"] = str(work / "mnft-home")
    src = work / "src"
    src.mkdir()
    total = generate(src, args.files, args.mb)
    rules_file = work / "rules"
    rules_file.write_bytes(rsync.rules_file_bytes(source.exclude_rules(src)[0]))  # the baseline skips what mnft skips
    print(f"tree: {args.files} files, {total / 2**20:.1f} MiB, {args.hosts} hosts, {args.reps} repetitions, "
          f"{os.cpu_count()} cores (shared: read the ratios)", flush=True)
    Cluster.cleanup_stale()
    cluster = Cluster.create(args.hosts, work / "cluster", outsider=False)
    firsts, plains, noops, ones, sents = [], [], [], [], []
    try:
        inv = inventory_mod.load(cluster.write_inventory(work / "inventory.yaml", workdir="/root/bench-mnft"))
        for rep in range(args.reps):
            wipe(cluster, "/root/bench-mnft", "/root/bench-plain")

            def mnft_first_sync():
                report, seconds = timed(lambda: mirror.sync_code(inv, src, progress=False))
                assert report.ok and {h.status for h in report.hosts.values()} == {"changed"}, report.summary()
                firsts.append(seconds)

            order = [lambda: plains.append(plain_rsync(cluster, src, "/root/bench-plain", rules_file)), mnft_first_sync]
            for step in order if rep % 2 == 0 else reversed(order):
                step()
            noop, t_noop = timed(lambda: mirror.sync_code(inv, src, progress=False))
            assert noop.ok and {h.status for h in noop.hosts.values()} == {"ok"}, noop.summary()
            noops.append(t_noop)
            changed = src / f"pkg{rep % 20:02d}" / f"mod{rep % 7}" / f"file{rep:05d}.py"
            data = bytearray(changed.read_bytes())
            data[len(data) // 2] ^= 0xFF
            changed.write_bytes(bytes(data))
            one, t_one = timed(lambda: mirror.sync_code(inv, src, progress=False))
            assert one.ok and all(h.files_changed == 1 for h in one.hosts.values()), one.summary()
            ones.append(t_one)
            sents.append(max(h.bytes_sent for h in one.hosts.values()))
            print(f"  rep {rep + 1} ({'plain first' if rep % 2 == 0 else 'mnft first'}): plain {plains[-1]:.2f} s, "
                  f"mnft {firsts[-1]:.2f} s, no-op {t_noop:.2f} s, one file {sents[-1]:,} B in {t_one:.2f} s", flush=True)
    finally:
        cluster.teardown()
        shutil.rmtree(work, ignore_errors=True)

    baseline, first, t_noop, sent = median(plains), median(firsts), median(noops), median(sents)
    ratio = first / baseline
    rows = [
        ("first sync", f"plain rsync -a {baseline:.2f} s", f"mnft {first:.2f} s", f"{ratio:.2f}×", "≤ 1.2×", ratio <= 1.2),
        ("no-op re-sync", "", f"mnft {t_noop:.2f} s", f"{t_noop:.2f} s", "≤ 1 s", t_noop <= 1.0),
        ("one file changed", f"tree {total:,} B", f"sent {sent:,.0f} B/host ({median(ones):.2f} s)", f"{100 * sent / total:.3f} %", "< 1 %",
         sent < total / 100),
    ]
    print(f"medians of {args.reps}:")
    width = [max(len(str(r[i])) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r[:5], width)) + ("  ok" if r[5] else "  MISSED"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
