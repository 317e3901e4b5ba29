"""check --perf without a cluster: the schedule, the rules, the inventory's floors, the link agent and the
launcher on this machine's loopback, the heatmap."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from mnft.core.errors import InputError
from mnft.hosts import inventory, pyrun, settings
from mnft.perf import schedule
from mnft.onhost import torchlaunch
from mnft.perf.collectives import parse_figures, torchrun_argv
from mnft.perf.evaluate import Thresholds, evaluate, slow_links
from mnft.perf.links import disjoint_rounds

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------------------ schedule


@pytest.mark.parametrize("n", range(0, 12))
def test_round_robin_meets_every_pair_exactly_once_in_rounds_of_disjoint_pairs(n):
    names = [f"h{i}" for i in range(n)]
    rounds = schedule.round_robin(names)
    met = [tuple(sorted(p)) for r in rounds for p in r]
    assert sorted(met) == sorted(itertools.combinations(sorted(names), 2))
    for r in rounds:
        hosts = [h for p in r for h in p]
        assert len(hosts) == len(set(hosts)), f"a host does two transfers at once in {r}"
    expected_rounds = 0 if n < 2 else (n - 1 if n % 2 == 0 else n)
    assert len(rounds) == expected_rounds
    if n >= 2 and n % 2 == 0:
        assert all(len(r) == n // 2 for r in rounds), "with an even count every host plays every round"


def test_round_robin_refuses_duplicate_hosts():
    with pytest.raises(ValueError):
        schedule.round_robin(["a", "b", "a"])


def test_link_seconds_shrink_with_the_host_count_within_bounds():
    values = [schedule.link_seconds(n) for n in (2, 4, 8, 16, 64)]
    assert values == sorted(values, reverse=True)
    assert values[0] == 0.5 and values[-1] == 0.1
    rounds_8 = 7
    assert 2 * rounds_8 * schedule.link_seconds(8) <= 3.0 + 1e-9  # the budget holds at 8 hosts


def test_message_sizes_double_from_1_to_256_mib_and_bus_factor_is_nccl_tests():
    sizes = schedule.message_sizes()
    assert sizes[0] == 1 << 20 and sizes[-1] == 256 << 20 and len(sizes) == 9
    assert schedule.bus_factor(2) == 1.0 and schedule.bus_factor(8) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        schedule.message_sizes(0, 10)


def test_disjoint_rounds_never_put_a_host_twice_in_a_round():
    rounds = disjoint_rounds([("a", "b"), ("a", "c"), ("b", "c"), ("c", "d")])
    assert rounds == [[("a", "b"), ("c", "d")], [("a", "c")], [("b", "c")]]


# ------------------------------------------------------------------------------------------------ rules

HOSTS = ["h1", "h2", "h3", "h4"]


def matrix(default: float = 2.0, **special: float) -> dict:
    """All directed links at `default` Gbit/s; special "h1_h2=0.05" sets h1→h2."""
    links = {}
    for s, d in itertools.permutations(HOSTS, 2):
        links[(s, d)] = {"gbps": special.get(f"{s}_{d}", default), "rtt_ms": 0.05, "rtt_min_ms": 0.04, "error": None}
    return links


def ranks(**tflops: float) -> list[dict]:
    return [{"rank": i, "host_name": h, "device": "cpu", "device_name": "cpu", "threads": 1, "cpus": 1,
             "compute": {"tflops": tflops.get(h, 0.07)}} for i, h in enumerate(HOSTS)]


def errors_of(ev) -> list[tuple[str, str]]:
    return sorted({(p.host, p.field) for p in ev.problems if p.severity == "error"})


def test_a_healthy_cluster_has_no_problem_and_every_host_is_ok():
    ev = evaluate(HOSTS, matrix(), ranks(), [{"bytes": 1 << 20, "busbw_gbps": 0.2}], Thresholds())
    assert ev.problems == []
    assert {r.verdict for r in ev.rows.values()} == {"ok"}
    assert ev.link_median_gbps == 2.0 and ev.compute_median_tflops == 0.07


def test_a_host_with_slow_incoming_links_is_named_alone():
    slow = {f"{s}_h2": 0.05 for s in ("h1", "h3", "h4")}
    ev = evaluate(HOSTS, matrix(**slow), ranks(), [], Thresholds())
    assert errors_of(ev) == [("h2", "link")]
    (problem,) = [p for p in ev.problems if p.field == "link"]
    assert "into h2" in problem.message and "h1→h2" in problem.message and "median" in problem.message
    assert ev.rows["h2"].verdict == "slow" and ev.rows["h1"].verdict == "ok"
    assert ev.rows["h1"].slowest == ("h1", "h2", 0.05)


def test_one_slow_pair_names_both_of_its_hosts_as_a_pair():
    ev = evaluate(HOSTS, matrix(h1_h3=0.1, h3_h1=0.1), ranks(), [], Thresholds())
    assert errors_of(ev) == [("h1", "link"), ("h3", "link")]
    assert all("between h1 and h3" in p.message for p in ev.problems)


def test_two_hosts_with_one_slow_direction_blame_the_pair_not_one_host():
    links = {("h1", "h2"): {"gbps": 0.05}, ("h2", "h1"): {"gbps": 2.0}}
    ev = evaluate(["h1", "h2"], links, [], [], Thresholds())
    assert errors_of(ev) == [("h1", "link"), ("h2", "link")]
    assert "between h1 and h2" in ev.problems[0].message


def test_the_inventory_floor_fails_a_uniformly_slow_cluster():
    ev = evaluate(HOSTS, matrix(default=0.9), ranks(), [], Thresholds(min_link_gbps=10))
    assert {h for h, f in errors_of(ev)} == set(HOSTS)
    assert "min_link_gbps 10" in ev.problems[0].message


def test_a_host_far_below_the_median_compute_is_named():
    ev = evaluate(HOSTS, matrix(), ranks(h3=0.02), [], Thresholds())
    assert errors_of(ev) == [("h3", "compute")]
    assert "29% of the median" in ev.problems[0].message


def test_the_compute_floor_names_every_host_under_it():
    ev = evaluate(HOSTS, matrix(), ranks(h1=0.5, h2=0.5, h3=0.5, h4=2.0), [], Thresholds(min_tflops=1.0))
    assert errors_of(ev) == [("h1", "compute"), ("h2", "compute"), ("h3", "compute")]


def test_a_slow_round_trip_is_a_warning_unless_over_the_inventory_limit():
    links = matrix()
    links[("h1", "h4")]["rtt_min_ms"] = links[("h4", "h1")]["rtt_min_ms"] = 5.0
    ev = evaluate(HOSTS, links, ranks(), [], Thresholds())
    assert {(p.host, p.severity) for p in ev.problems} == {("h1", "warning"), ("h4", "warning")}
    ev = evaluate(HOSTS, links, ranks(), [], Thresholds(max_rtt_ms=2))
    assert errors_of(ev) == [("h1", "rtt"), ("h4", "rtt")]


def test_a_failed_link_test_is_an_error_on_both_hosts():
    links = matrix()
    links[("h1", "h2")] = {"gbps": None, "error": "connect: no route to host"}
    links[("h2", "h1")] = {"gbps": None, "error": "connect: no route to host"}
    ev = evaluate(HOSTS, links, ranks(), [], Thresholds())
    assert errors_of(ev) == [("h1", "link"), ("h2", "link")]
    assert "no route to host" in ev.problems[0].message


def test_oversubscribed_cpu_threads_are_a_warning_with_the_omp_fix():
    rs = ranks()
    rs[0].update(threads=2, cpus=2)
    rs.append({**rs[0], "rank": 9})  # a second rank on h1, also 2 threads: 4 > 2 CPUs
    ev = evaluate(HOSTS, matrix(), rs, [], Thresholds())
    (problem,) = [p for p in ev.problems if p.field == "threads"]
    assert problem.host == "h1" and problem.severity == "warning" and "OMP_NUM_THREADS=1" in problem.fix


def test_busbw_under_the_inventory_floor_fails_the_cluster():
    ev = evaluate(HOSTS, matrix(), ranks(), [{"bytes": 64 << 20, "busbw_gbps": 0.2}], Thresholds(min_busbw_gbps=1))
    assert errors_of(ev) == [("*", "busbw")]


def test_slow_links_are_those_under_the_cut():
    assert slow_links(matrix(h1_h2=0.5), Thresholds()) == {("h1", "h2")}
    assert slow_links(matrix(h1_h2=1.5), Thresholds()) == set()


# ------------------------------------------------------------------------------------------------ inventory


def test_inventory_perf_floors_are_read_and_checked(tmp_path):
    text = "perf:\n  min_link_gbps: 80\n  link_ratio: 0.7\nhosts:\n  a: {address: 10.0.0.1}\n"
    inv = inventory.parse(text, tmp_path / "inv.yaml")
    assert inv.perf == {"min_link_gbps": 80.0, "link_ratio": 0.7}
    assert Thresholds.from_inventory(inv.perf).min_link_gbps == 80.0


@pytest.mark.parametrize("perf, words", [
    ("{min_link_gbs: 80}", ["min_link_gbs", "min_link_gbps"]),
    ("{min_tflops: -1}", ["perf.min_tflops", "> 0"]),
    ("{min_tflops: yes}", ["perf.min_tflops"]),
    ("[1, 2]", ["'perf'", "mapping"]),
])
def test_a_bad_perf_key_or_value_is_bad_input_naming_it(tmp_path, perf, words):
    with pytest.raises(InputError) as err:
        inventory.parse(f"perf: {perf}\nhosts:\n  a: {{address: 10.0.0.1}}\n", tmp_path / "inv.yaml")
    assert all(w in str(err.value) for w in words), str(err.value)


def test_ansible_inventory_sets_perf_floors_in_all_vars(tmp_path):
    text = "all:\n  vars:\n    mnft_perf: {min_busbw_gbps: 20}\n  hosts:\n    a: {ansible_host: 10.0.0.1}\n"
    assert inventory.parse(text, tmp_path / "inv.yaml").perf == {"min_busbw_gbps": 20.0}


def test_every_perf_key_of_the_inventory_is_a_threshold():
    assert set(settings.PERF_KEYS) == {f.name for f in fields(Thresholds)}


# ------------------------------------------------------------------------------------------------ launcher


def test_torchrun_argv_is_static_rendezvous_with_the_inventory_rank(tmp_path):
    inv = inventory.parse("hosts:\n  a: {address: 10.0.0.1, slots: 2}\n  b: {address: 10.0.0.2, slots: 2}\n", tmp_path / "i.yaml")
    argv = torchrun_argv(inv.hosts[1], inv, "10.0.0.1", 29500, ["--sizes", "1"])
    assert argv == ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                    "--master-port", "29500", "--max-restarts", "0", "--", "--sizes", "1"]
    with pytest.raises(ValueError):
        torchrun_argv(inv.hosts[1], inv, "10.0.0.1", 29500, [], "mpirun")


def test_direct_launch_gives_each_local_rank_torchruns_environment():
    args = ["--nnodes", "3", "--nproc-per-node", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"]
    envs = torchlaunch.direct_envs(args, {"PATH": "/bin"})
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["GROUP_RANK"], e["OMP_NUM_THREADS"]) for e in envs] == [
        ("2", "0", "6", "1", "1"), ("3", "1", "6", "1", "1")]
    assert "OMP_NUM_THREADS" not in torchlaunch.direct_envs(args[:2] + ["--nproc-per-node", "1"] + args[4:], {})[0]
    with pytest.raises(ValueError):
        torchlaunch.direct_envs(["--node-rank", "3", "--nnodes", "2", "--master-addr", "a", "--master-port", "1"], {})


def test_rank_zero_figures_are_found_among_other_output():
    text = "rank=0 hello\nMNFT-PERF {\"world_size\": 2, \"allreduce\": []}\nbye\n"
    assert parse_figures(text) == {"world_size": 2, "allreduce": []}
    assert parse_figures("MNFT-PERF {broken\n") is None


@pytest.mark.timeout(120)
def test_direct_launch_runs_the_allreduce_worker_on_this_machine():
    """Two ranks on loopback: compute per rank, all_reduce per size, figures with nccl-tests' busbw."""
    from mnft.perf.collectives import ENTRY

    port = str(29000 + os.getpid() % 1000)
    args = ["direct", "--nnodes", "1", "--nproc-per-node", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--master-port", port, "--", "--sizes", f"{1 << 20},{2 << 20}", "--budget", "1", "--compute", "0.1"]
    payload = pyrun.payload("torchlaunch") + pyrun.text(ENTRY.read_text())
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdin.write(payload)
    proc.stdin.flush()  # and kept open: closing it means "the controller is gone, stop"
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdin.close()
    assert proc.wait(timeout=100) == 0, err.decode()[-2000:]
    figures = parse_figures(out.decode())
    assert figures["world_size"] == 2 and figures["backend"] == "gloo"
    assert [r["rank"] for r in figures["ranks"]] == [0, 1]
    assert all(r["compute"]["tflops"] > 0 and r["threads"] == 1 for r in figures["ranks"])
    first = figures["allreduce"][0]
    assert first["bytes"] == 1 << 20 and first["busbw_gbps"] == pytest.approx(first["algbw_gbps"] * 2 * (2 - 1) / 2, rel=1e-3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(120)
def test_held_ranks_say_ready_and_join_the_process_group_only_when_released():
    """--hold: the ranks import torch, print MNFT-READY and wait; nothing listens on the rendezvous port until "go"."""
    from mnft.perf.collectives import ENTRY

    port = _free_port()
    args = ["direct", "--hold", "--nnodes", "1", "--nproc-per-node", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--", "--sizes", f"{1 << 20},{2 << 20},{4 << 20}", "--budget", "0.001", "--limit", "60",
            "--compute", "0.05"]
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        proc.stdin.write(pyrun.payload("torchlaunch") + pyrun.text(ENTRY.read_text()))
        proc.stdin.flush()
        ready = sorted(proc.stdout.readline() for _ in range(2))
        assert ready == [b"MNFT-READY 0\n", b"MNFT-READY 1\n"], proc.stderr.read(2000) if b"" in ready else ready
        with pytest.raises(ConnectionRefusedError):  # rank 0 has not created the rendezvous store: it is held
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        proc.stdin.close()
    assert proc.wait(timeout=100) == 0, err.decode()[-2000:]
    figures = parse_figures(out.decode())
    assert figures["world_size"] == 2
    assert [r["bytes"] for r in figures["allreduce"]] == [1 << 20, 2 << 20, 4 << 20]  # --limit: past the budget
    for rank in figures["ranks"]:  # where a rank's time went, for the docs' cost table and the bench
        assert set(rank["phases"]) == {"import_s", "held_s", "rendezvous_s", "compute_s", "allreduce_s"}


def test_the_sizes_the_sweep_did_not_reach_are_listed_as_dropped():
    from mnft.perf.collectives import CollectiveRun

    run = CollectiveRun(sizes=[1 << 20, 2 << 20, 4 << 20], figures={"allreduce": [{"bytes": 1 << 20}]})
    assert run.dropped() == [2 << 20, 4 << 20]
    assert CollectiveRun(sizes=[1 << 20]).dropped() == []  # no figures: nothing was measured, nothing "dropped"


def test_the_markers_the_controller_reads_are_the_ones_the_shipped_entry_prints():
    """collectives.py must not import allreduce.py (it imports torch, seconds on the controller): the constants
    are written twice and held equal here."""
    import ast

    from mnft.perf import collectives

    tree = ast.parse(collectives.ENTRY.read_text())
    shipped = {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name) and t.id in ("MARKER", "READY")}
    assert shipped == {"MARKER": collectives.MARKER, "READY": collectives.READY}
    out = subprocess.run([sys.executable, "-c", "import sys, mnft.perf.gather, mnft.perf.report; print('torch' in sys.modules)"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "False", "the controller imports torch"


def local_hosts(tmp_path, **pythons: str):
    """An inventory of `connection: local` hosts (one local shell each), host name -> its python."""
    text = "hosts:\n" + "".join(f"  {name}: {{connection: local, python: {json.dumps(py)}}}\n" for name, py in pythons.items())
    return inventory.parse(text, tmp_path / "inv.yaml")


def ranks_left(port: int) -> list:
    """Processes of this test's job still running: ranks whose environment names its rendezvous port."""
    import psutil

    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            entry = any(torchlaunch.SCRIPT_NAME in part for part in proc.info["cmdline"] or [])
            if entry and proc.environ().get("MASTER_PORT") == str(port):
                left.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return left


def wait_until_gone(port: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while ranks_left(port):
        assert time.monotonic() < deadline, f"ranks left behind: {ranks_left(port)}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_ranks_started_early_run_when_released_after_other_work(tmp_path, monkeypatch):
    """The overlap's shape: start (the ranks import torch), do other work, release: figures as without a hold."""
    from mnft.hosts.connection import Timeouts
    from mnft.hosts.fleet import Fleet
    from mnft.perf.collectives import start_allreduce

    monkeypatch.setenv("HOME", str(tmp_path))
    port = _free_port()
    with Fleet(local_hosts(tmp_path, a=sys.executable, b=sys.executable), Timeouts(connect=5, command=30)) as fleet:
        pending = start_allreduce(fleet, "127.0.0.1", port, {}, [1 << 20, 2 << 20], 0.5, 0.05, 90)
        other = fleet.run(lambda host: pyrun.command(host, "python"), stdin=pyrun.payload("probe"))  # the links' turn: another host command
        run = pending.release()
    assert all(r.ok for r in other)
    assert run.figures is not None, run.error
    assert run.figures["world_size"] == 2 and [r["node_rank"] for r in run.figures["ranks"]] == [0, 1]
    assert all(r.ok for r in run.outcomes.values()) and run.not_started == {}
    assert all("held_s" in r["phases"] for r in run.figures["ranks"])
    wait_until_gone(port)


@pytest.mark.timeout(120)
def test_a_host_whose_torch_worker_cannot_start_fails_alone_and_nobody_is_released(tmp_path, monkeypatch):
    """b's Python is missing: b fails, named, with its shell's error; a's ranks (started and held) are stopped
    instead of waiting for b at the rendezvous until the timeout; nothing is left running."""
    from mnft.hosts.connection import Timeouts
    from mnft.hosts.fleet import Fleet
    from mnft.perf.collectives import start_allreduce

    monkeypatch.setenv("HOME", str(tmp_path))
    port = _free_port()
    with Fleet(local_hosts(tmp_path, a=sys.executable, b=str(tmp_path / "no-such-python")), Timeouts(connect=5, command=30)) as fleet:
        run = start_allreduce(fleet, "127.0.0.1", port, {}, [1 << 20], 0.5, 0.05, 90).release()
    assert run.figures is None
    assert list(run.not_started) == ["b"] and "127" in run.not_started["b"] and "no-such-python" in run.not_started["b"]
    assert run.outcomes["b"].error.startswith("the torch worker did not start")
    assert run.outcomes["a"].error.startswith("not run") and "on b" in run.outcomes["a"].error
    assert "b" in run.error
    wait_until_gone(port)


@pytest.mark.timeout(120)
def test_when_one_host_fails_after_the_release_the_others_are_stopped_not_left_to_time_out(tmp_path, monkeypatch):
    """b's gloo cannot use its interface (a typo in 'iface'): b fails at the rendezvous; a, which would wait for
    b until the collectives' timeout (90 s here), is stopped a few seconds later and says why."""
    from mnft.hosts.connection import Timeouts
    from mnft.hosts.fleet import Fleet
    from mnft.perf.collectives import start_allreduce

    monkeypatch.setenv("HOME", str(tmp_path))
    port = _free_port()
    with Fleet(local_hosts(tmp_path, a=sys.executable, b=sys.executable), Timeouts(connect=5, command=30)) as fleet:
        run = start_allreduce(fleet, "127.0.0.1", port, {"b": "nosuchif0"}, [1 << 20], 0.5, 0.05, 90).release()
    assert run.figures is None and run.not_started == {}
    assert not run.outcomes["b"].ok and "nosuchif0" in run.outcomes["b"].error
    assert run.outcomes["a"].error.startswith("stopped after b failed")
    wait_until_gone(port)


def test_a_launcher_whose_controller_goes_away_leaves_nothing_behind(tmp_path):
    """stdin closing (the controller gave up) stops every rank's process group."""
    marker = tmp_path / "pid"
    script = f"import os, time\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    args = ["direct", "--nnodes", "1", "--nproc-per-node", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "1", "--"]
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, *args], stdin=subprocess.PIPE)
    proc.stdin.write(pyrun.payload("torchlaunch") + pyrun.text(script))
    proc.stdin.flush()
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the rank never started"
        time.sleep(0.05)
    pid = int(marker.read_text())
    proc.stdin.close()
    assert proc.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the rank outlived its launcher"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ link agent


def start_agent():
    proc = subprocess.Popen([sys.executable, "-c", pyrun.BOOTSTRAP, "serve", "--bind", "127.0.0.1", "--lifetime", "60"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=False)
    proc.stdin.write(pyrun.payload("linkagent"))
    proc.stdin.flush()
    hello = json.loads(proc.stdout.readline())
    assert hello["ok"], hello
    return proc, hello["port"]


def ask(proc, command: dict) -> dict:
    proc.stdin.write((json.dumps(command) + "\n").encode())
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_two_link_agents_measure_rtt_and_both_directions_on_loopback():
    a, _ = start_agent()
    b, port_b = start_agent()
    try:
        answer = ask(a, {"op": "measure", "id": "a>b", "peer": "127.0.0.1", "port": port_b, "seconds": 0.2, "pings": 5})
        assert answer["ok"] and answer["id"] == "a>b", answer
        assert answer["tx_gbps"] > 0 and answer["rx_gbps"] > 0 and answer["tx_bytes"] > 0
        assert 0 < answer["rtt_min_ms"] <= answer["rtt_ms"]
        refused = ask(a, {"op": "measure", "id": 2, "peer": "127.0.0.1", "port": 1, "seconds": 0.1})
        assert not refused["ok"] and refused["error"] == "connect: connection refused"
        bad = ask(a, {"op": "jump", "id": 3})
        assert not bad["ok"] and bad["error"].startswith("bad command") and bad["id"] == 3
    finally:
        for proc in (a, b):
            proc.stdin.close()
            assert proc.wait(timeout=10) == 0  # closing stdin stops an agent


def test_the_link_agent_refuses_a_malformed_command_line():
    proc = subprocess.run([sys.executable, "-c", pyrun.BOOTSTRAP, "serve"], input=pyrun.payload("linkagent"), capture_output=True, timeout=30)
    proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())
    assert proc.returncode == 2 and "usage" in proc.stderr


# ------------------------------------------------------------------------------------------------ heatmap


def test_the_heatmap_png_is_written_with_the_blamed_host(tmp_path):
    from mnft.perf.gather import PerfReport
    from mnft.perf.links import Link, LinkMatrix
    from mnft.perf.report import write_outputs

    links = matrix(**{f"{s}_h2": 0.05 for s in ("h1", "h3", "h4")})
    m = LinkMatrix(HOSTS, {h: f"10.0.0.{i}" for i, h in enumerate(HOSTS)}, {h: "eth0" for h in HOSTS}, 0.2, schedule.round_robin(HOSTS))
    m.links = {k: Link(k[0], k[1], v["gbps"], v["rtt_ms"], v["rtt_min_ms"]) for k, v in links.items()}
    perf = PerfReport(HOSTS, Thresholds(), links=m)
    perf.evaluation = evaluate(HOSTS, links, ranks(), [], Thresholds())
    write_outputs(perf, tmp_path)
    png = Path(perf.artifacts["heatmap"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    data = json.loads(Path(perf.artifacts["json"]).read_text())
    assert data["links"]["gbps"]["h1"]["h2"] == 0.05 and data["hosts"]["h2"]["verdict"] == "slow"


# ------------------------------------------------------------------------------------------------ test bed


def test_simulated_hosts_get_disjoint_cpu_shares_like_machines():
    from testbed import cpu_shares

    assert cpu_shares(1, [0, 1]) == [(0, 1)]
    assert cpu_shares(2, [0, 1]) == [(0,), (1,)]
    assert cpu_shares(3, [0, 1, 2, 3, 4, 5, 6, 7]) == [(0, 1), (2, 3), (4, 5)]
    assert cpu_shares(4, [0, 1]) == [(0,), (1,), (0,), (1,)]  # more hosts than CPUs: one each, dealt round-robin
    assert cpu_shares(2, [3, 1]) == [(1,), (3,)]
