#!/usr/bin/env python3
"""The host package (issue 42): what shipping mnft.onhost as payloads costs, against the single host scripts before it.

One test bed (8 hosts, stand-in GPUs, stock sshd) and two checkouts side by side in the same run, in turns: this
one and a reference checkout from before the host package (`--before PATH`, e.g. `git worktree add /tmp/before
ee268f6`). Each command runs as a user runs it (`python -m invoke -r CHECKOUT …`, that checkout's mnft first on
PYTHONPATH), its wall time measured:

* `mnft lab --json` at 8 hosts;
* `mnft check --json` at 8 hosts;
* `mnft train --hosts 4 hosts -- quick.py`: a whole start at 4 hosts (check, code placed, leases taken, agents
  launched) of a script that ends at once, to its end;

and the bytes each command sends before its own input (the payload: lease script, agent, probe, tree hash).

    python bench/hostpkg.py --before /tmp/before [--repeat 5] [--latency-ms 0] [--out /tmp/hostpkg.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from testbed import Cluster  # noqa: E402

QUICK = "import os\nprint('rank', os.environ.get('RANK'), 'done', flush=True)\n"


def env(work: Path, tree: Path) -> dict:
    home = work / f"home-{tree.name}"
    home.mkdir(exist_ok=True)
    out = dict(os.environ, HOME=str(home), MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(work / f"runs-{tree.name}"),
               PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
    out.pop("PYTHONDONTWRITEBYTECODE", None)  # each checkout runs from its bytecode cache, as an installed mnft does
    return out


def timed(tree: Path, args: list[str], environ: dict, cwd: Path) -> float:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "invoke", "-r", str(tree), *args], env=environ, capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed ({done.returncode}): {(done.stdout + done.stderr)[-3000:]}")
    return wall


def payload_bytes(tree: Path) -> dict:
    """Bytes each host command sends before its own input, as that checkout builds them."""
    code = ("import json\nfrom mnft.hosts import pyrun\n"
            "try:\n"
            "    from mnft.hosts import payload\n"
            "    out = {e: payload.size(e) for e in ('leasehost', 'agent', 'probe', 'treehash')}\n"
            "except ImportError:\n"
            "    from mnft.hosts import leasehost\n    from mnft.run import agent\n    from mnft.check import probe\n"
            "    from mnft.sync import treehash\n"
            "    out = {'leasehost': len(pyrun.module_payload(leasehost)), 'agent': len(pyrun.payload(agent.source())),\n"
            "           'probe': len(pyrun.compiled_payload(probe.source())), 'treehash': len(pyrun.payload(treehash.source()))}\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True,
                          check=True, cwd="/")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of mnft from before the host package")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="each stand-in nvidia-smi question's driver time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": REPO}
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    sizes = {name: payload_bytes(tree) for name, tree in trees.items()}
    for entry in sizes["after"]:
        print(f"payload of {entry}: before {sizes['before'][entry]} B, after {sizes['after'][entry]} B "
              f"({sizes['after'][entry] / sizes['before'][entry]:.2f}x)", flush=True)
    results: dict = {"bytes": sizes, "date": time.strftime("%Y-%m-%d"), "s": {}}
    with tempfile.TemporaryDirectory(prefix="mnft-bench-hostpkg-") as tmp:
        work = Path(tmp)
        cluster = Cluster.create(8, work / "tb", outsider=False, stock_sshd=True, gpus=4)
        try:
            if args.latency_ms:
                for host in cluster.hosts:
                    cluster.gpu_faults(host, latency_ms=args.latency_ms)
            inv8 = cluster.write_inventory(work / "inventory8.yaml")
            inv4 = cluster.write_inventory(work / "inventory4.yaml", hosts=cluster.hosts[:4])
            project = work / "project"
            project.mkdir()
            (project / "quick.py").write_text(QUICK)
            commands = {
                "lab at 8 hosts": ["lab", "--hosts", str(inv8), "--json"],
                "check at 8 hosts": ["check", "--hosts", str(inv8), "--json"],
                "train start at 4 hosts": ["train", "--hosts", str(inv4), "--", "quick.py"],
            }
            walls = {name: {tree: [] for tree in trees} for name in commands}
            for name, argv in commands.items():
                for tree_name, tree in trees.items():  # warm-up, not counted: caches, known hosts, bytecode
                    timed(tree, argv, env(work, tree), project)
                for _ in range(args.repeat):
                    for tree_name, tree in trees.items():
                        walls[name][tree_name].append(timed(tree, argv, env(work, tree), project))
                before, after = (statistics.median(walls[name][t]) for t in trees)
                print(f"{name}: before median {before:.2f}s, after median {after:.2f}s ({after / before:.3f}x); "
                      f"runs before {', '.join(f'{w:.2f}' for w in walls[name]['before'])}, "
                      f"after {', '.join(f'{w:.2f}' for w in walls[name]['after'])}", flush=True)
            results["s"] = walls
        finally:
            cluster.teardown()
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
