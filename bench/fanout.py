#!/usr/bin/env python3
"""Fan-out of the facts probe: mnft vs pdsh vs Ansible's `command` module on 4, 16 and 32 simulated hosts.

    python bench/fanout.py [--sizes 4,16,32] [--reps 3] [--skip-ansible] [--profile]

Needs root (testbed), pdsh, and ansible-core (`pip install -e .[bench]`). Every tool runs the same work on
every host: the interpreter the inventory names runs mnft's stdlib-only probe (`probe.py facts`). mnft ships the
probe on stdin (`python - facts`, one SSH round-trip); pdsh and Ansible run a copy placed in each host's home
beforehand. All three use the same key and known_hosts with strict host key checking, 32 connections at once.

Measured, median of --reps repetitions, every repetition cold (new connections), the tools taking turns:
  floor      the same N probe processes started at once on this machine, no SSH: the hosts' own work, which
             here shares the controller's cores (on real hosts it runs in parallel on N machines)
  mnft lib   Fleet + check.gather_facts in this process: connect + probe (connect and probe also shown apart)
  mnft cli   `invoke check --no-network --json` as a subprocess: adds Python start-up and imports
  pdsh       `pdsh -R ssh -f 32 -w ADDRS PYTHON /root/probe.py facts`
  ansible    `ansible all -i INV -m command -a 'PYTHON /root/probe.py facts' -f 32` (defaults otherwise:
             ControlMaster/ControlPersist on, pipelining off; a fresh control-path dir per repetition)

Goals (from the issue): at 32 hosts mnft <= 0.5x pdsh and <= 0.05x Ansible, and mnft@32 <= 2x mnft@4. The
table prints the measured numbers whether or not they meet them. This machine's 2 cores are shared with other
work, so numbers move between runs; compare ratios from one run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
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

from mnft.onhost import probe  # noqa: E402
from mnft.check.gather import gather_facts  # noqa: E402
from mnft.hosts import inventory as inventory_mod  # noqa: E402
from mnft.hosts.connection import Timeouts  # noqa: E402
from mnft.hosts.fleet import Fleet  # noqa: E402

FORKS = 32


class Bench:
    def __init__(self, cluster: Cluster, workdir: Path, skip_ansible: bool) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.skip_ansible = skip_ansible
        self.n = len(cluster.hosts)
        self.inventory = cluster.write_inventory(workdir / "inventory.yaml")
        self.remote_cmd = [cluster.python, "/root/probe.py", "facts"]
        for host in cluster.hosts:  # the copy pdsh and Ansible run (/root/probe.py inside the host)
            shutil.copy(probe.__file__, host.home / "probe.py")
        self.env = dict(os.environ, HOME=str(workdir / "home"), MNFT_HOME=str(workdir / "mnft-home"))
        Path(self.env["HOME"]).mkdir(exist_ok=True)
        self._write_ansible_inventory()

    # ------------------------------------------------------------------ mnft

    def mnft_lib(self) -> dict:
        inv = inventory_mod.load(self.inventory)
        started = time.perf_counter()
        with Fleet(inv, Timeouts(connect=30, command=120)) as fleet:
            connected = fleet.connect_all()
            connect_s = time.perf_counter() - started
            results, facts, _ = gather_facts(fleet)
        bad = [r.host for r in results if not r.ok] + [r.host for r in connected if not r.ok]
        assert not bad and len(facts) == self.n, f"mnft lib: not ok on {bad}"
        return {"connect": connect_s, "probe": time.perf_counter() - started - connect_s}

    def mnft_cli(self) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "invoke", "-r", str(REPO), "check", "--hosts", str(self.inventory), "--no-network", "--json",
             "--connect-timeout", "30"],
            cwd=REPO, env=self.env, capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, f"mnft cli: exit {done.returncode}: {done.stderr[-6000:]}"
        report = json.loads(done.stdout)
        assert all(h["outcome"] == "ok" for h in report["hosts"].values())

    # ------------------------------------------------------------------ pdsh

    def pdsh(self) -> None:
        c = self.cluster
        env = dict(self.env, PDSH_SSH_ARGS_APPEND=" ".join([
            "-F /dev/null", f"-i {c.controller_key}", f"-o UserKnownHostsFile={c.known_hosts}",
            "-o GlobalKnownHostsFile=/dev/null", "-o StrictHostKeyChecking=yes", "-o BatchMode=yes",
            "-o IdentitiesOnly=yes", "-o IdentityAgent=none", "-o ControlMaster=no", "-o ControlPath=none",
        ]))
        done = subprocess.run(
            ["pdsh", "-R", "ssh", "-f", str(FORKS), "-l", "root", "-w", ",".join(h.address for h in c.hosts), *self.remote_cmd],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, f"pdsh: exit {done.returncode}: {done.stderr[-500:]}"
        answered = {line.split(":", 1)[0] for line in done.stdout.splitlines() if '"probe_version"' in line}
        assert len(answered) == self.n, f"pdsh: {len(answered)} of {self.n} hosts answered"

    # ------------------------------------------------------------------ ansible

    def _write_ansible_inventory(self) -> None:
        c = self.cluster
        lines = ["[all]"] + [f"{h.name} ansible_host={h.address}" for h in c.hosts]
        lines += [
            "[all:vars]",
            "ansible_user=root",
            f"ansible_ssh_private_key_file={c.controller_key}",
            f"ansible_python_interpreter={c.python}",
            f"ansible_ssh_common_args='-F /dev/null -o UserKnownHostsFile={c.known_hosts} "
            "-o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes -o IdentityAgent=none'",
        ]
        self.ansible_inventory = self.workdir / "ansible.ini"
        self.ansible_inventory.write_text("\n".join(lines) + "\n")

    def ansible(self) -> None:
        control = Path(tempfile.mkdtemp(prefix="cp", dir=self.workdir))  # cold: no persistent master from a previous rep
        env = dict(self.env, ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_SSH_CONTROL_PATH_DIR=str(control),
                   ANSIBLE_LOCAL_TEMP=str(self.workdir / "ansible-tmp"), ANSIBLE_NOCOLOR="1")
        done = subprocess.run(
            ["ansible", "all", "-i", str(self.ansible_inventory), "-m", "command", "-a", " ".join(self.remote_cmd), "-f", str(FORKS)],
            env=env, capture_output=True, text=True, timeout=900,
        )
        assert done.returncode == 0, f"ansible: exit {done.returncode}: {done.stdout[-800:]} {done.stderr[-800:]}"
        assert done.stdout.count("CHANGED") == self.n, done.stdout[-800:]
        subprocess.run(["sh", "-c", f"for s in {control}/*; do [ -S \"$s\" ] && ssh -O exit -o ControlPath=\"$s\" x; done 2>/dev/null; true"],
                       env=env, capture_output=True, timeout=60)

    # ------------------------------------------------------------------ all

    def floor(self) -> None:
        """The hosts' own work without any SSH: N probe processes at once on this machine's (shared) cores."""
        procs = [subprocess.Popen([self.cluster.python, probe.__file__, "facts"], stdout=subprocess.DEVNULL)
                 for _ in range(self.n)]
        assert all(p.wait(timeout=300) == 0 for p in procs)

    def measure(self, reps: int) -> dict:
        """Every repetition runs every tool once, in turn: load from other work on the machine hits them alike."""
        tools = {"floor": self.floor, "mnft_lib": self.mnft_lib, "mnft_cli": self.mnft_cli, "pdsh": self.pdsh}
        if not self.skip_ansible:
            tools["ansible"] = self.ansible
        times: dict[str, list[float]] = {name: [] for name in tools}
        phases = []
        for _ in range(reps):
            for name, fn in tools.items():
                started = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - started)
                if name == "mnft_lib":
                    phases.append(out)
        row: dict = {"hosts": self.n, "ansible": None}
        row.update({name: statistics.median(values) for name, values in times.items()})
        row["mnft_connect"] = statistics.median(p["connect"] for p in phases)
        row["mnft_probe"] = statistics.median(p["probe"] for p in phases)
        return row


def profile_lib(bench: Bench) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    bench.mnft_lib()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def print_table(rows: list[dict]) -> None:
    head = ["hosts", "floor s", "mnft lib s", "(connect", "probe)", "mnft cli s", "pdsh s", "ansible s",
            "lib/pdsh", "cli/pdsh", "lib/ansible", "cli/ansible"]
    table = [head]
    for r in rows:
        table.append([str(r["hosts"]), fmt(r["floor"]), fmt(r["mnft_lib"]), fmt(r["mnft_connect"]), fmt(r["mnft_probe"]) , fmt(r["mnft_cli"]),
                      fmt(r["pdsh"]), fmt(r["ansible"]), ratio(r["mnft_lib"], r["pdsh"]), ratio(r["mnft_cli"], r["pdsh"]),
                      ratio(r["mnft_lib"], r["ansible"]), ratio(r["mnft_cli"], r["ansible"])])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for number, row in enumerate(table):
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        if number == 0:
            print("  ".join("-" * w for w in widths))
    by_n = {r["hosts"]: r for r in rows}
    small, large = min(by_n), max(by_n)
    if small != large:
        print(f"\nscaling mnft@{large}/mnft@{small}: lib {ratio(by_n[large]['mnft_lib'], by_n[small]['mnft_lib'])}, "
              f"cli {ratio(by_n[large]['mnft_cli'], by_n[small]['mnft_cli'])}  (goal <= 2)")
        r = by_n[large]
        print(f"goals at {large} hosts: mnft/pdsh <= 0.5 (lib {ratio(r['mnft_lib'], r['pdsh'])}, cli {ratio(r['mnft_cli'], r['pdsh'])}); "
              f"mnft/ansible <= 0.05 (lib {ratio(r['mnft_lib'], r['ansible'])}, cli {ratio(r['mnft_cli'], r['ansible'])})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4,16,32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-ansible", action="store_true")
    parser.add_argument("--profile", action="store_true", help="also cProfile one mnft library run at the largest size")
    args = parser.parse_args()
    if not args.skip_ansible and shutil.which("ansible") is None:
        parser.error("ansible not found: pip install -e .[bench] (or --skip-ansible)")
    if shutil.which("pdsh") is None:
        parser.error("pdsh not found: apt-get install pdsh")
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    profile = ""
    base = Path(tempfile.mkdtemp(prefix="mnft-fanout-"))
    Cluster.cleanup_stale()
    for n in sizes:
        with Cluster.create(n, base / f"c{n}", outsider=False) as cluster:
            bench = Bench(cluster, base / f"c{n}", args.skip_ansible)
            print(f"{n} hosts ...", file=sys.stderr, flush=True)
            rows.append(bench.measure(args.reps))
            if args.profile and n == max(sizes):
                profile = profile_lib(bench)
    print(f"\nfacts probe fan-out, median of {args.reps} (seconds, wall clock, {os.cpu_count()} CPUs)\n")
    print_table(rows)
    if profile:
        print("\nprofile of one mnft library run at", max(sizes), "hosts:\n" + profile)
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
