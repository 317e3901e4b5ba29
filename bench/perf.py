"""Benchmarks of `check --perf` on the simulated cluster (needs root, like the cluster tests).

    python bench/perf.py [links] [check] [tenx] [--hosts 2,4,8] [--repeats 2] [--launchers default,torchrun]
                         [--reference REV]

links  the link agent's TCP figure vs iperf3 on the same pair, same duration, interleaved (goal: ≥ 0.8×)
check  the whole `invoke check --perf` wall time at 2, 4 and 8 hosts (min / median / max of the repeats) and its
       phases; with --reference REV that revision's tree (git archive) runs interleaved on the same cluster
tenx   issue 13's case: a 2-host × 1-process lora run with the hosts sharing every CPU (the old test bed) vs each
       host owning its CPU share (the fix), plus OMP_NUM_THREADS=1 and 1 host × 2 processes for reference

Machines are noisy (other work shares the 2 cores): each figure is a median of interleaved repeats and the
reference runs side by side in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed (tests/testbed.py)

from testbed import Cluster  # noqa: E402

from mnft.hosts import pyrun  # noqa: E402


def agent_figure(cluster, a, b, seconds: float) -> float:
    """a→b Gbit/s as check --perf measures it (the link agents, inside the hosts)."""
    server = cluster.popen(b, [cluster.python, "-c", pyrun.BOOTSTRAP, "serve", "--bind", b.address, "--lifetime", "60"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    client = cluster.popen(a, [cluster.python, "-c", pyrun.BOOTSTRAP, "serve", "--bind", a.address, "--lifetime", "60"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        for proc in (server, client):
            proc.stdin.write(pyrun.payload("linkagent"))
            proc.stdin.flush()
        port = json.loads(server.stdout.readline())["port"]
        json.loads(client.stdout.readline())
        client.stdin.write((json.dumps({"op": "measure", "id": 1, "peer": b.address, "port": port, "seconds": seconds, "pings": 10}) + "\n").encode())
        client.stdin.flush()
        answer = json.loads(client.stdout.readline())
        return answer["tx_gbps"]
    finally:
        for proc in (server, client):
            proc.stdin.close()
            proc.wait(timeout=10)


def iperf3_figure(cluster, a, b, seconds: float) -> float:
    server = cluster.popen(b, ["iperf3", "-s", "-1", "-B", b.address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = cluster.run(a, ["iperf3", "-c", b.address, "-t", str(seconds), "-J"], timeout=seconds + 30).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9
    finally:
        server.wait(timeout=10)


def bench_links(repeats: int = 3) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster.create(2, Path(tmp), outsider=False)
        try:
            a, b = cluster.hosts
            for seconds in (2, 1):  # iperf3 takes whole seconds (-t 0 means forever)
                agent, iperf = [], []
                for _ in range(repeats):
                    iperf.append(iperf3_figure(cluster, a, b, seconds))
                    agent.append(agent_figure(cluster, a, b, seconds))
                ia, ag = statistics.median(iperf), statistics.median(agent)
                print(f"links {seconds:g}s  iperf3 {ia:6.2f} Gbit/s  mnft agent {ag:6.2f} Gbit/s  ratio {ag / ia:.2f}  "
                      f"(iperf3 {', '.join(f'{x:.2f}' for x in iperf)}; agent {', '.join(f'{x:.2f}' for x in agent)})", flush=True)
        finally:
            cluster.teardown()


def export_revision(rev: str, into: Path) -> Path:
    """The tree of git revision `rev` (e.g. the commit before a change) under `into`, to run side by side."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def one_check(repo: Path, inv: Path, env: dict, launcher: str | None) -> dict:
    """One `invoke check --perf --json` from `repo`'s tree: wall time and the phases perf.json reports."""
    argv = [sys.executable, "-m", "invoke", "-r", str(repo), "check", "--hosts", str(inv), "--perf", "--json"]
    if launcher:
        argv += ["--perf-launcher", launcher]
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=repo, env=dict(env, PYTHONPATH=str(repo)), capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    try:
        perf = json.loads(proc.stdout)["perf"]
    except (ValueError, KeyError):
        raise SystemExit(f"{repo}: no JSON (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}") from None
    c = perf.get("collectives") or {}
    ranks = c.get("ranks") or []
    imports = [r["phases"]["import_s"] for r in ranks if isinstance(r.get("phases"), dict)]
    return {"exit": proc.returncode, "whole": wall, "perf": perf["elapsed_s"], "links": (perf.get("links") or {}).get("elapsed_s"),
            "collectives": c.get("elapsed_s"), "ready_wait": c.get("ready_wait_s"), "import": max(imports) if imports else None,
            "link_median": (perf.get("medians") or {}).get("link_gbps"), "sizes": len(c.get("allreduce") or []),
            "load": os.getloadavg()[0]}


def _fmt(value, unit="s") -> str:
    return "-" if value is None else f"{value:5.1f}{unit}"


def _spread(values: list[float]) -> str:
    return f"{min(values):5.1f} / {statistics.median(values):5.1f} / {max(values):5.1f}"


def bench_check(sizes=(2, 4, 8), repeats: int = 2, launchers=(None,), reference: str | None = None) -> None:
    """`invoke check --perf` at each host count, `repeats` times per launcher (None: the default one); with a
    reference revision, that tree runs interleaved with this one on the same cluster and the ratio is printed."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": REPO}
        if reference:
            trees[f"reference {reference}"] = export_revision(reference, Path(tmp) / "reference")
        for n in sizes:
            cluster = Cluster.create(n, Path(tmp) / f"c{n}", outsider=False)
            try:
                inv = cluster.write_inventory(Path(tmp) / f"inv{n}.yaml")
                env = dict(os.environ, HOME=tmp, MNFT_RUNS_DIR=str(Path(tmp) / "runs"))
                runs: dict[tuple[str, str], list[dict]] = {}
                for _ in range(repeats):
                    for launcher in launchers:
                        for label, tree in trees.items():
                            r = one_check(tree, inv, env, launcher)
                            runs.setdefault((label, launcher or "default"), []).append(r)
                            print(f"check --perf {n} hosts {label:22} {launcher or 'default':8} exit {r['exit']}  whole {_fmt(r['whole'])}  "
                                  f"perf part {_fmt(r['perf'])} (links {_fmt(r['links'])}, collectives {_fmt(r['collectives'])}, "
                                  f"waited for torch {_fmt(r['ready_wait'])}, slowest import {_fmt(r['import'])})  "
                                  f"median link {_fmt(r['link_median'], ' Gbit/s')}  all_reduce sizes {r['sizes']}  load {r['load']:.1f}", flush=True)
                for (label, launcher), rs in runs.items():
                    whole = [r["whole"] for r in rs]
                    line = (f"SUMMARY {n} hosts {label:22} {launcher:8} whole min/median/max {_spread(whole)} s  perf part "
                            f"{_spread([r['perf'] for r in rs])} s  median link {statistics.median(r['link_median'] or 0 for r in rs):.2f} Gbit/s")
                    ref = runs.get((f"reference {reference}", launcher)) if reference and not label.startswith("reference") else None
                    if ref:
                        line += f"  vs reference: {statistics.median(whole) / statistics.median(r['whole'] for r in ref):.2f}x"
                    print(line, flush=True)
            finally:
                cluster.teardown()


def lora_tok_s(cluster, hosts, nproc: int, env: dict, steps: int = 40) -> float:
    base = {"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1", **env}
    port = str(29600 + int(time.time() * 10) % 300)
    procs = []
    for rank, host in enumerate(hosts):
        argv = [cluster.python, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", str(nproc),
                "--node-rank", str(rank), "--master-addr", hosts[0].address, "--master-port", port, "-m", "mnft.recipes.lora",
                f"max_steps={steps}", "output_dir=/tmp/bench-out", "save_every=0", "save_final=false", "tensorboard=false",
                "log_every=1000", "overwrite=true"]
        procs.append(cluster.popen(host, argv, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    line = next(ln for out in outs for ln in out.splitlines() if ln.startswith("summary"))
    return float(line.split("tok/s")[1].split()[0])


def bench_tenx(repeats: int = 2) -> None:
    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        for share in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                cluster = Cluster.create(2, Path(tmp), outsider=False, share_cpus=share)
                try:
                    label = "shared CPUs (old test bed)" if share else "own CPU share (fixed)"
                    lora_tok_s(cluster, cluster.hosts[:1], 1, {}, steps=1)  # builds the tiny model in h1's cache
                    lora_tok_s(cluster, cluster.hosts[1:], 1, {}, steps=1)
                    rows.setdefault(f"2 hosts x 1 proc, {label}", []).append(lora_tok_s(cluster, cluster.hosts, 1, {}))
                    rows.setdefault(f"2 hosts x 1 proc, {label}, OMP_NUM_THREADS=1", []).append(
                        lora_tok_s(cluster, cluster.hosts, 1, {"OMP_NUM_THREADS": "1"}))
                finally:
                    cluster.teardown()
        with tempfile.TemporaryDirectory() as tmp:
            cluster = Cluster.create(1, Path(tmp), outsider=False)
            try:
                lora_tok_s(cluster, cluster.hosts, 1, {}, steps=1)
                rows.setdefault("1 host x 2 procs (reference)", []).append(lora_tok_s(cluster, cluster.hosts, 2, {}))
            finally:
                cluster.teardown()
    reference = statistics.median(rows["1 host x 2 procs (reference)"])
    for label, values in rows.items():
        med = statistics.median(values)
        print(f"tenx  {label:55} tok/s {med:7.0f}  ({', '.join(f'{v:.0f}' for v in values)})  vs 1x2: {med / reference:.2f}×", flush=True)


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", help="links, check, tenx (default: all three)")
    parser.add_argument("--hosts", default="2,4,8", help="check: host counts (default 2,4,8)")
    parser.add_argument("--repeats", type=int, default=2, help="check: runs per host count, launcher and tree")
    parser.add_argument("--launchers", default="default", help="check: comma-separated: default, direct, torchrun")
    parser.add_argument("--reference", help="check: a git revision to run interleaved with this tree (e.g. main)")
    args = parser.parse_args(argv)
    chosen = args.what or ["links", "check", "tenx"]
    unknown = set(chosen) - {"links", "check", "tenx"}
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))} (use links, check, tenx)")
    print(f"load average at start: {os.getloadavg()[0]:.1f} (2 cores)", flush=True)
    if "links" in chosen:
        bench_links()
    if "check" in chosen:
        launchers = tuple(None if x == "default" else x for x in args.launchers.split(","))
        bench_check(tuple(int(x) for x in args.hosts.split(",")), args.repeats, launchers, args.reference)
    if "tenx" in chosen:
        bench_tenx()


if __name__ == "__main__":
    main(sys.argv[1:])
