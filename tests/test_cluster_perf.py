"""check --perf on the simulated cluster: a throttled link, a busy host, a healthy cluster; and the cause of the
issue-13 "2 hosts × 1 process is 10× slower" case (simulated hosts that shared every CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


def check_perf(cluster, tmp_path: Path, *extra: str, hosts=None) -> tuple[int, dict, str]:
    inv = cluster.write_inventory(tmp_path / "inv.yaml", hosts=hosts)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), MNFT_RUNS_DIR=str(tmp_path / "runs"))
    proc = subprocess.run([sys.executable, "-m", "invoke", "-r", str(REPO), "check", "--hosts", str(inv), "--perf", "--json",
                           "--perf-out", str(tmp_path / "perf"), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}") from None
    return proc.returncode, data, proc.stderr


def errors(data: dict) -> set[tuple[str, str]]:
    return {(p["host"], p["field"]) for p in data["perf"]["problems"] if p["severity"] == "error"}


def test_a_throttled_hosts_links_are_named_and_check_perf_exits_1(healthy_cluster, tmp_path):
    slow = healthy_cluster.hosts[2]  # h3: everything sent to it squeezes through 50 Mbit/s
    subprocess.run(["tc", "qdisc", "add", "dev", slow.veth, "root", "tbf", "rate", "50mbit", "burst", "64kb", "latency", "50ms"], check=True)
    try:
        code, data, stderr = check_perf(healthy_cluster, tmp_path, "--perf-launcher", "direct")
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", slow.veth, "root"], check=False)
    assert code == 1, stderr[-2000:]
    assert errors(data) == {("h3", "link")}
    gbps = data["perf"]["links"]["gbps"]
    assert all(gbps[peer]["h3"] < 0.1 for peer in ("h1", "h2", "h4"))  # 50 Mbit/s and a little burst
    assert min(gbps["h1"]["h2"], gbps["h2"]["h1"], gbps["h3"]["h1"]) > 0.2  # the others' links and h3's own sending
    assert data["perf"]["hosts"]["h3"]["verdict"] == "slow" and data["perf"]["hosts"]["h1"]["verdict"] == "ok"
    problem = next(p for p in data["perf"]["problems"] if p["host"] == "h3")
    assert "into h3" in problem["message"] and "tc qdisc" in problem["fix"]
    assert Path(data["perf"]["artifacts"]["heatmap"]).is_file()


def test_a_cpu_burner_on_one_host_is_named_by_the_compute_figure(fresh_cluster_factory, tmp_path):
    cluster = fresh_cluster_factory(3)  # h1 and h3 share a CPU, h2 has its own: the burner hurts h2 only
    busy = cluster.hosts[1]
    burner = cluster.popen(busy, [cluster.python, "-c", "while True: pass"], start_new_session=True)
    burners = [burner]
    # On a real host a burner owns a share of that host's cores; here the CPU is also shared with whatever else
    # runs on this machine (other test runs), which the kernel balances per session (autogroup). Its session's
    # weight makes the burner take h2's CPU the way it would on a machine of its own: -5 leaves h2's rank about a
    # quarter of it (-15 left it 3%: torch's import alone took ~40 s, the test 88 s), well under the half the
    # compute figure names
    Path(f"/proc/{burner.pid}/autogroup").write_text("-5")
    try:
        code, data, stderr = check_perf(cluster, tmp_path, "--perf-launcher", "direct")
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    assert code == 1, stderr[-2000:]
    # the compute figure names h2 alone; a burned host may also send slowly, so its links can be named too
    assert {host for host, field in errors(data) if field == "compute"} == {"h2"}
    hosts = data["perf"]["hosts"]
    assert hosts["h2"]["tflops"] < 0.5 * min(hosts["h1"]["tflops"], hosts["h3"]["tflops"])
    assert hosts["h2"]["verdict"] == "slow"


def test_a_healthy_cluster_passes_with_the_matrix_and_busbw_per_size(healthy_cluster, tmp_path):
    code, data, stderr = check_perf(healthy_cluster, tmp_path, "--perf-launcher", "torchrun")  # as training starts it
    assert code == 0, json.dumps(data.get("perf", {}).get("problems"), indent=1) + stderr[-2000:]
    perf = data["perf"]
    names = ["h1", "h2", "h3", "h4"]
    assert sorted(perf["links"]["gbps"]) == names
    assert all(perf["links"]["gbps"][s][d] > 0 for s in names for d in names if s != d)
    assert len(perf["links"]["rounds"]) == 3 and perf["links"]["ifaces"] == {h: "eth0" for h in names}
    sweep = perf["collectives"]["allreduce"]
    assert perf["collectives"]["backend"] == "gloo" and perf["collectives"]["world_size"] == 4
    assert [s["bytes"] for s in sweep] == [(1 << 20) << i for i in range(9)]  # 1 MiB .. 256 MiB: every size at 4 hosts
    assert perf["collectives"]["dropped_sizes"] == [] and perf["collectives"]["launcher"] == "torchrun"
    for size in sweep:  # nccl-tests: busbw = algbw × 2(n-1)/n
        assert size["busbw_gbps"] == pytest.approx(size["algbw_gbps"] * 1.5, rel=0.01)
    assert {r["host_name"] for r in perf["collectives"]["ranks"]} == set(names)
    assert all(h["verdict"] == "ok" and h["tflops"] > 0 for h in perf["hosts"].values())
    png = Path(perf["artifacts"]["heatmap"])
    assert png.read_bytes()[:4] == b"\x89PNG"


def _ranks_on(cluster) -> list[int]:
    """Perf ranks of this cluster still running (their rendezvous address is one of its hosts')."""
    import psutil

    addresses = {h.address for h in cluster.hosts}
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any("mnft_perf_entry" in part for part in proc.info["cmdline"] or []) and proc.environ().get("MASTER_ADDR") in addresses:
                left.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return left


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_host_whose_torch_cannot_start_is_named_alone_and_the_links_are_still_measured(healthy_cluster, tmp_path, monkeypatch, overlap):
    """h3's torch is broken (an ImportError on import; the check's probe reads its version without importing it).
    With the ranks started during the link matrix (overlap on) or after it (off): h3 fails, named, with the
    ImportError; the others are not blamed and their ranks are stopped instead of waiting for h3 at the
    rendezvous; the matrix is complete; nothing is left running."""
    from mnft.check.findings import CheckOptions
    from mnft.check.gather import gather
    from mnft.hosts import inventory
    from mnft.hosts.connection import Timeouts
    from mnft.hosts.fleet import Fleet
    from mnft.perf.gather import PerfOptions, measure

    cluster = healthy_cluster
    broken = cluster.hosts[2]
    private_tmp = broken.root / "tmp"  # the host's own /tmp
    (private_tmp / "broken-torch" / "torch").mkdir(parents=True, exist_ok=True)
    (private_tmp / "broken-torch" / "torch" / "__init__.py").write_text(
        'raise ImportError("libtorch_cpu.so: cannot open shared object file (a broken install, simulated)")\n')
    wrapper = private_tmp / "python-broken-torch"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH=/tmp/broken-torch exec {cluster.python} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MNFT_HOME", str(tmp_path / "mnft-home"))
    inv = inventory.load(cluster.write_inventory(tmp_path / "inv.yaml", python={broken.name: "/tmp/python-broken-torch"}))
    try:
        with Fleet(inv, Timeouts(connect=10, command=60)) as fleet:
            report = gather(fleet, CheckOptions())
            assert (report.facts[broken.name].get("torch") or {}).get("version"), "the probe should still see a torch"
            perf = measure(fleet, report, PerfOptions(overlap=overlap))
    finally:
        wrapper.unlink()
    assert perf.overlap is (overlap == "on")
    names = [h.name for h in cluster.hosts]
    assert all(perf.links.gbps(s, d) for s in names for d in names if s != d), perf.links.errors
    problems = [p for p in perf.problems if p.field == "collectives"]
    assert [p.host for p in problems] == [broken.name] and "ImportError" in problems[0].message and "simulated" in problems[0].message
    assert perf.failed() and perf.evaluation.rows[broken.name].verdict == "failed"
    outcomes = perf.collectives.outcomes
    assert all(outcomes[n].error.startswith("not run") for n in names if n != broken.name), outcomes
    deadline = time.monotonic() + 30
    while _ranks_on(cluster):
        assert time.monotonic() < deadline, f"perf ranks left running: {_ranks_on(cluster)}"
        time.sleep(0.1)


def test_each_simulated_host_owns_its_cpus_so_one_process_per_host_does_not_oversubscribe(fresh_cluster_factory):
    """Issue 13's 10× case: every simulated host saw all of the machine's CPUs, so with one process per host
    (torchrun sets OMP_NUM_THREADS=1 only for several) each worker ran torch's intra-op pool at the machine's core
    count, N hosts' spinning OpenMP threads oversubscribed the cores N-fold and waited for each other."""
    cluster = fresh_cluster_factory(2)
    probe = "import os, torch; print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    seen = {}
    for host in cluster.hosts:  # through sshd, as a training job starts
        out = subprocess.run(cluster.ssh_argv(host, [cluster.python, "-c", probe]), capture_output=True, text=True, timeout=120, check=True)
        cpus, threads = out.stdout.rsplit(" ", 1)
        seen[host.name] = (set(json.loads(cpus)), int(threads))
    machine = len(os.sched_getaffinity(0))
    (a_cpus, a_threads), (b_cpus, b_threads) = seen.values()
    if machine >= 2:
        assert not a_cpus & b_cpus, f"two hosts share CPUs: {seen}"
    assert a_threads <= len(a_cpus) and b_threads <= len(b_cpus)
    assert a_threads + b_threads <= max(machine, 2), f"intra-op threads of one process per host oversubscribe {machine} CPUs: {seen}"
