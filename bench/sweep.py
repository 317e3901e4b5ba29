#!/usr/bin/env python3
"""Sweeps (issue 43): what a 100-point sweep costs, against one detached run, side by side in the same run.

One test bed (8 hosts x 4 stand-in GPUs; bob with his mesh, alice without). alice holds every GPU of the lab (one
4-GPU run per host, each ending when this script says), so bob's points wait. Measured, as bob runs mnft:

* submit: the command's wall time, `mnft train --detach --gpus 1 --wait` of one run against `mnft train --sweep
  seed=1..100 --gpus 1` (100 points), and whether any process of bob's controller is left once it returned;
* lab: `mnft lab` over the 8 hosts with nothing waiting, against with the 100-point sweep waiting (one point in each
  host's line, the others in the sweep's queue);
* start: from a host's GPUs freeing (alice's run there told to end) to a waiting run's gang started there (its
  record's first attempt), and to its script's first output: one detached --wait run (the line's own mechanism)
  against the sweep's point waiting in that line (the sweep then starts its next points there at once: on this
  test bed their torch imports share this machine's 2 cores with the first point's, which the first output shows).

    python bench/sweep.py [--repeat 3] [--out /tmp/sweep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from fakegpu import HOLD_UNTIL_TOLD, RANK_SNIPPET  # noqa: E402
from testbed import Cluster  # noqa: E402

POINT = RANK_SNIPPET + '''
import os, sys, time
print("started at %.3f" % time.time(), flush=True)
end = "/tmp/mnft-test-end-" + sys.argv[sys.argv.index("--tag") + 1]
deadline = time.time() + 600
while not os.path.exists(end) and time.time() < deadline:
    time.sleep(0.2)
'''
POINTS = 100


class Member:
    def __init__(self, cluster: Cluster, work: Path, user: str, hosts=None) -> None:
        self.cluster, self.user, self.dir = cluster, user, work / user
        self.dir.mkdir(exist_ok=True)
        (self.dir / "home").mkdir(exist_ok=True)
        self.src = self.dir / "src"
        self.src.mkdir(exist_ok=True)
        (self.src / "point.py").write_text(POINT)
        (self.src / "hold.py").write_text(HOLD_UNTIL_TOLD)
        self.inventory = str(cluster.write_inventory(self.dir / f"lab-{hosts[0].name if hosts else 'all'}.yaml", hosts=hosts, user=user, workdir=f"/tmp/home-{user}/mnft"))

    def env(self) -> dict:
        return dict(os.environ, HOME=str(self.dir / "home"), MNFT_HOME=str(self.dir / "home" / ".mnft"), MNFT_RUNS_DIR=str(self.dir / "runs"))

    def run(self, *args: str, inventory: str | None = None) -> str:
        argv = [sys.executable, "-m", "invoke", "-r", str(REPO), *args]
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=600, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed: {(done.stdout + done.stderr)[-3000:]}")
        return done.stdout

    def my_pids(self) -> list[int]:
        marker = f"MNFT_HOME={self.dir / 'home' / '.mnft'}".encode()
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                        out.append(int(entry))
                except OSError:
                    pass
        return out


def timed(fn) -> tuple[float, object]:
    t0 = time.monotonic()
    out = fn()
    return time.monotonic() - t0, out


def wait_for(predicate, timeout: float = 300, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(every)
    raise SystemExit("timed out")


def end(cluster: Cluster, tag: str, hosts) -> float:
    at = time.time()
    for host in hosts:
        (host.root / "tmp" / f"mnft-test-end-{tag}").write_text("")
    return at


def first_output(cluster: Cluster, host, user: str, since: float) -> float | None:
    """The earliest `started at T` printed on that host by a run of user's whose output appeared after `since`."""
    runs = host.root / "tmp" / f"home-{user}" / "mnft" / "runs"
    found = []
    for log in runs.glob(f"*/{host.name}/output.log") if runs.is_dir() else []:
        for m in re.finditer(r"started at ([\d.]+)", log.read_text(errors="replace")):
            if float(m.group(1)) > since:
                found.append(float(m.group(1)))
    return min(found) if found else None


def gang_started(cluster: Cluster, since: float) -> float | None:
    """The earliest start of a gang of bob's (its record's first attempt, on the supervisor's host h1) after `since`."""
    found = []
    for path in (cluster.hosts[0].root / "tmp" / "home-bob" / ".mnft" / "supervised").glob("*/runs/*/run.json"):
        try:
            attempts = json.loads(path.read_text()).get("attempts") or []
        except (OSError, ValueError):
            continue
        if attempts and isinstance(attempts[0].get("started"), (int, float)) and attempts[0]["started"] > since:
            found.append(attempts[0]["started"])
    return min(found) if found else None


def alice_holds(alice_by_host: list[Member], tag: str) -> list[str]:
    """One 4-GPU run of alice's on each of these hosts (detached, unsupervised: she has no mesh): their run ids."""
    ids = []
    for member in alice_by_host:
        runs = member.dir / "runs"
        before = {p.name for p in runs.iterdir() if (p / "run.json").is_file()} if runs.is_dir() else set()
        member.run("train", "--hosts", member.inventory, "--src", str(member.src), "--detach", "--gpus", "4", "--", "hold.py", tag)
        ids += sorted({p.name for p in runs.iterdir() if (p / "run.json").is_file()} - before)
    return ids


def lab_seconds(bob: Member, times: int = 5) -> float:
    return statistics.median(timed(lambda: bob.run("lab", "--hosts", bob.inventory, "--json"))[0] for _ in range(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    fig: dict = {"submit_s": {"one run": [], f"{POINTS} points": []}, "left_on_controller": [], "lab_s": {"nothing waiting": [], "sweep waiting": []},
                 "start_s": {"one run": [], "sweep point": []}, "output_s": {"one run": [], "sweep point": []}}
    with tempfile.TemporaryDirectory(prefix="mnft-bench-sweep-") as tmp, Cluster.create(8, Path(tmp), outsider=False, gpus=4) as cluster:
        for user in ("bob", "alice"):
            cluster.add_user(user, torch=True)
        bob = Member(cluster, Path(tmp), "bob")
        (bob.dir / "mesh.yaml").write_text("- name: mesh\n  mesh: {}\n")
        bob.run("setup", "--hosts", bob.inventory, "--playbook", str(bob.dir / "mesh.yaml"))
        alice = [Member(cluster, Path(tmp), "alice", hosts=[h]) for h in cluster.hosts]
        seeds = ",".join(str(n) for n in range(1, POINTS + 1))
        for turn in range(args.repeat):
            tag = f"a{turn}"
            hers = alice_holds(alice, tag)
            lab_quiet = lab_seconds(bob)
            spent, out = timed(lambda: bob.run("train", "--hosts", bob.inventory, "--src", str(bob.src), "--detach", "--gpus", "1", "--nodes", "1",
                                               "--wait", "--", "point.py", "--tag", f"one{turn}"))
            run_id = re.search(r"^run (\S+) handed", out, re.M).group(1)
            fig["submit_s"]["one run"].append(spent)
            freed = end(cluster, tag, [cluster.hosts[0]])  # h1 frees: the one run (first in h1's line) starts there
            fig["start_s"]["one run"].append(wait_for(lambda: gang_started(cluster, freed)) - freed)
            fig["output_s"]["one run"].append(wait_for(lambda: first_output(cluster, cluster.hosts[0], "bob", freed)) - freed)
            bob.run("stop", run_id)
            alice[0].run("wait", hers[0])
            hers[0:1] = alice_holds(alice[:1], tag + "x")
            spent, out = timed(lambda: bob.run("train", "--hosts", bob.inventory, "--src", str(bob.src), "--gpus", "1", "--sweep", f"seed={seeds}",
                                               "--", "point.py", "--tag", f"p{turn}" + "{seed}"))
            sweep_id = re.search(r"^sweep (\S+) \(", out, re.M).group(1)
            fig["submit_s"][f"{POINTS} points"].append(spent)
            fig["left_on_controller"].append(len(bob.my_pids()))
            wait_for(lambda: len([p for p in json.loads(bob.run("status", sweep_id, "--json"))["points"] if p["state"] == "waiting"]) >= len(cluster.hosts),
                     every=1.0)
            fig["lab_s"]["nothing waiting"].append(lab_quiet)
            fig["lab_s"]["sweep waiting"].append(lab_seconds(bob))
            freed = end(cluster, tag + "x", [cluster.hosts[0]])
            fig["start_s"]["sweep point"].append(wait_for(lambda: gang_started(cluster, freed)) - freed)
            fig["output_s"]["sweep point"].append(wait_for(lambda: first_output(cluster, cluster.hosts[0], "bob", freed)) - freed)
            bob.run("stop", sweep_id)
            end(cluster, tag, cluster.hosts)
            for run in hers:
                alice[0].run("wait", run)
            print(f"turn {turn + 1}: submit {fig['submit_s']['one run'][-1]:.2f} / {fig['submit_s'][f'{POINTS} points'][-1]:.2f} s, "
                  f"lab {fig['lab_s']['nothing waiting'][-1]:.2f} / {fig['lab_s']['sweep waiting'][-1]:.2f} s, "
                  f"start {fig['start_s']['one run'][-1]:.2f} / {fig['start_s']['sweep point'][-1]:.2f} s, "
                  f"output {fig['output_s']['one run'][-1]:.2f} / {fig['output_s']['sweep point'][-1]:.2f} s", flush=True)
    med = {k: {side: round(statistics.median(v), 2) for side, v in d.items()} for k, d in fig.items() if isinstance(d, dict)}
    print(f"{'':34s}{'reference':>12s}{'sweep':>10s}{'ratio':>8s}")
    for key, label, (ref, new) in (("submit_s", "submit (8 hosts), s", ("one run", f"{POINTS} points")),
                                   ("lab_s", "mnft lab (8 hosts), s", ("nothing waiting", "sweep waiting")),
                                   ("start_s", "GPUs free -> gang started, s", ("one run", "sweep point")),
                                   ("output_s", "GPUs free -> first output, s", ("one run", "sweep point"))):
        a, b = med[key][ref], med[key][new]
        print(f"{label:34s}{a:12.2f}{b:10.2f}{b / a:8.2f}")
    print(f"processes left on the controller after the sweep's submit: {max(fig['left_on_controller'])}")
    if args.out:
        args.out.write_text(json.dumps({"median": med, "raw": fig}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
