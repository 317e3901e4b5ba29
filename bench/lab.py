#!/usr/bin/env python3
"""A lab shared by many people (issue 29): what seeing and taking devices costs. Results in docs/lab.md.

On N simulated hosts with the stand-in nvidia-smi (4 GPUs each, tests/fakegpu.py) and stock sshd limits:

* `mnft lab --json` at each size, as the user runs it (`python -m invoke lab`, a subprocess), wall seconds;
  half the hosts' GPUs held by a run of another controller so the table is not empty; the reference beside it
  is `pdsh` running `nvidia-smi --query-gpu=…` on every host (what a lab does today to see its GPUs);
* the cost device leases add to train's start at 8 hosts: taking the run's leases as train takes them now (its
  devices (--gpus 2, nvidia-smi and its topology read on each host, the fastest-linked free pair picked) and its
  workdir) against taking the whole host's lease as train took it before (one file per host), both through one
  open fleet as train does, in turns, --repeat times each; the median difference is what a start pays more.

* (issue 37) the stand-in answering as a real 8-GPU host does: `--gpus 8 --latency-ms 40` (every nvidia-smi
  question takes that long, on top of its own start), and `--stall`: one host's nvidia-smi stalls 15 s on every
  question (persistence off) — `mnft lab`, train's take of its devices and `mnft check` each timed, with whether
  they named the stall.

    python bench/lab.py [--sizes 8,64] [--repeat 7] [--gpus 4] [--latency-ms 0] [--stall] [--lease-hosts 8,1] [--out /tmp/lab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed (tests/testbed.py)

from testbed import Cluster  # noqa: E402

GPUS = 4  # per host (--gpus)
LATENCY_MS = 0  # every stand-in nvidia-smi question's driver time (--latency-ms)
STALL_S = 15


def env(work: Path) -> dict:
    """The commands' environment. mnft runs from its modules' bytecode cache, as an installed mnft does (pip compiles
    them when it installs; an editable checkout writes __pycache__ on its first run): a PYTHONDONTWRITEBYTECODE in
    this environment would have every timed run compile mnft's ~35,000 lines afresh (~80 ms of CPU)."""
    home = work / "home"
    home.mkdir(exist_ok=True)
    out = dict(os.environ, HOME=str(home), MNFT_HOME=str(home / ".mnft"), MNFT_RUNS_DIR=str(work / "runs"), PYTHONUNBUFFERED="1")
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    return out


def timed(argv: list[str], environ: dict) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    done = subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=600)
    return time.monotonic() - started, done


def occupy(inventory_path: Path, hosts: int):
    """Another controller's run holding GPUs 0 and 1 of every other host (a hold process per host, kept open)."""
    from mnft.hosts import leases
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import load

    inv = load(str(inventory_path))
    fleet = Fleet(inv)
    held = leases.Leases("train", "20261127-090000-0ccc", leases.Scope(gpus=2))
    held.take(fleet, inv.hosts[::2])
    return fleet, held


def real_gpus(cluster) -> None:
    """Every host's stand-in answers with a real driver's time per question."""
    if LATENCY_MS:
        for host in cluster.hosts:
            cluster.gpu_faults(host, latency_ms=LATENCY_MS)


def lab_at(n: int, work: Path, repeat: int) -> dict:
    cluster = Cluster.create(n, work / "tb", outsider=False, stock_sshd=True, gpus=GPUS)
    try:
        real_gpus(cluster)
        inventory = cluster.write_inventory(work / "inventory.yaml")
        environ = env(work)
        fleet, held = occupy(inventory, n)
        try:
            walls, pdsh = [], []
            timed([sys.executable, "-m", "invoke", "-r", str(REPO), "lab", "--hosts", str(inventory), "--json"], environ)  # not counted: caches
            for _ in range(repeat):
                wall, done = timed([sys.executable, "-m", "invoke", "-r", str(REPO), "lab", "--hosts", str(inventory), "--json"], environ)
                if done.returncode != 0:
                    raise SystemExit(f"lab failed: {done.stderr[-2000:]}")
                rows = json.loads(done.stdout)["devices"]
                assert sum(1 for r in rows if r["state"] == "held") == 2 * len(range(0, n, 2)), rows
                walls.append(wall)
                if shutil.which("pdsh"):
                    key = str(cluster.controller_key)
                    hosts = ",".join(h.address for h in cluster.hosts)
                    ssh_args = f"-i {key} -o UserKnownHostsFile={cluster.known_hosts} -o BatchMode=yes"
                    wall, done = timed(["pdsh", "-R", "ssh", "-f", "64", "-w", hosts, "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader"],
                                       dict(environ, PDSH_SSH_ARGS_APPEND=ssh_args))
                    if done.returncode == 0:
                        pdsh.append(wall)
        finally:
            held.release()
            fleet.close()
        return {"hosts": n, "lab_s": walls, "pdsh_s": pdsh}
    finally:
        cluster.teardown()


def lease_cost(work: Path, repeat: int, n: int = 8) -> dict:
    from mnft.hosts import leases
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import load

    cluster = Cluster.create(n, work / f"tb{n}", outsider=False, stock_sshd=True, gpus=GPUS)
    try:
        real_gpus(cluster)
        inv = load(str(cluster.write_inventory(work / f"inventory{n}.yaml")))
        devices, host = [], []
        with Fleet(inv) as fleet:
            warm = leases.Leases("warm-up")  # connections open, as train's are when it takes its leases
            warm.take(fleet, inv.hosts)
            warm.release()
            for _ in range(repeat):
                for kind, out in (("devices", devices), ("host", host)):
                    taking = leases.Leases("train", "20261127-100000-bbbb", leases.Scope(gpus=2) if kind == "devices" else None)
                    started = time.monotonic()
                    taking.take(fleet, inv.hosts)
                    out.append(time.monotonic() - started)
                    assert kind == "host" or all(len(d) == 2 for d in taking.devices.values())
                    taking.release()
        return {"hosts": n, "device_leases_s": devices, "host_lease_s": host,
                "added_s": statistics.median(devices) - statistics.median(host)}
    finally:
        cluster.teardown()


def stall(work: Path) -> dict:
    """Two hosts, h2's nvidia-smi stalling STALL_S on every question: how long lab, train's take of its devices and
    check take, and what they said of h2."""
    from mnft.hosts import leases
    from mnft.hosts.fleet import Fleet
    from mnft.hosts.inventory import load

    cluster = Cluster.create(2, work / "tb-stall", outsider=False, stock_sshd=True, gpus=GPUS)
    try:
        real_gpus(cluster)
        cluster.gpu_faults(cluster.hosts[1], stall=STALL_S, persistence=False)
        path = cluster.write_inventory(work / "inventory-stall.yaml")
        environ = env(work)
        out = {}
        for name, argv in (("lab", ["lab", "--hosts", str(path), "--json"]), ("check", ["check", "--hosts", str(path)])):
            wall, done = timed([sys.executable, "-m", "invoke", "-r", str(REPO), *argv], environ)
            text = done.stdout + done.stderr
            out[name] = {"s": round(wall, 2), "rc": done.returncode, "named": "did not answer in" in text,
                         "said": next((ln.strip() for ln in text.splitlines() if "did not answer in" in ln), "")[:300]}
        said = []
        inv = load(str(path))
        with Fleet(inv) as fleet:
            taking = leases.Leases("train", "20261128-100000-stal", leases.Scope(gpus=2))
            started = time.monotonic()
            taking.take(fleet, inv.hosts, on_problem=lambda host, why: said.append(f"{host}: {why}"))
            wall = time.monotonic() - started
            taking.release()
        out["take"] = {"s": round(wall, 2), "named": any("did not answer in" in w for w in said), "said": "; ".join(said)[:300]}
        return out
    finally:
        cluster.teardown()


def main() -> None:
    global GPUS, LATENCY_MS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=GPUS, help="stand-in GPUs per host")
    parser.add_argument("--latency-ms", type=float, default=LATENCY_MS, help="each nvidia-smi question's driver time")
    parser.add_argument("--stall", action="store_true", help=f"also: one host's nvidia-smi stalling {STALL_S} s")
    parser.add_argument("--lease-hosts", default="8", help="hosts of the lease cost's test bed (comma-separated sizes; 0: skip it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    GPUS, LATENCY_MS = args.gpus, args.latency_ms
    print(f"stand-in: {GPUS} GPUs per host, {LATENCY_MS:g} ms per nvidia-smi question; load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {"lab": [], "leases": None, "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory(prefix="mnft-bench-lab-") as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            found = lab_at(n, Path(tmp) / f"lab{n}", args.repeat)
            results["lab"].append(found)
            ref = f", pdsh nvidia-smi median {statistics.median(found['pdsh_s']):.2f}s" if found["pdsh_s"] else ""
            ratio = f" ({statistics.median(found['lab_s']) / statistics.median(found['pdsh_s']):.2f}x)" if found["pdsh_s"] else ""
            print(f"lab at {n} hosts: median {statistics.median(found['lab_s']):.2f}s, runs {', '.join(f'{w:.2f}' for w in found['lab_s'])}{ref}{ratio}",
                  flush=True)
        for n in [int(x) for x in args.lease_hosts.split(",") if int(x)]:
            cost = lease_cost(Path(tmp), args.repeat, n)
            results["leases"] = results["leases"] or cost
            results.setdefault("leases_at", []).append(cost)
            print(f"train's leases at {n} hosts: devices (--gpus 2 + workdir) median {statistics.median(cost['device_leases_s']):.3f}s, "
                  f"the host's lease median {statistics.median(cost['host_lease_s']):.3f}s: +{cost['added_s']:.3f}s per start", flush=True)
        if args.stall:
            results["stall"] = found = stall(Path(tmp))
            for name, what in found.items():
                print(f"{STALL_S} s stall, {name}: {what['s']:.2f}s" + (f", exit {what['rc']}" if "rc" in what else "")
                      + f", named: {what['named']} ({what['said']})", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
