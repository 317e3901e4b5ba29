#!/usr/bin/env python3
"""A detached run's supervisor on the lab (issue 41): what it costs against an attached run, side by side, in turns,
in the same run of this script.

One test bed (4 hosts, a login user `bob` with his mesh made by `mnft setup`) and one script (steps.py: gloo, a
collective per step, a step every STEP_S seconds, its progress saved every other step). Measured, as bob runs mnft:

* start: from the command's start to the first step line in rank 0's output on the master (read on the host),
  attached (`mnft train`) against detached (`mnft train --detach`: the hand-over, then the supervisor's own start
  on the master), with mnft's bundle already on the master (a second run of the same mnft);
* footprint: the supervisor process's CPU (user+system over wall) and RSS while a run trains, against the attached
  controller's over the same window;
* recovery: from killing one host's ranks to the next step after the restart (--max-restarts 1), attached against
  detached with the controller gone.

    python bench/supervisor.py [--repeat 3] [--out /tmp/supervisor.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import psutil  # noqa: E402
from testbed import Cluster  # noqa: E402

STEPS = '''\
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
progress = os.path.join(os.environ["MNFT_OUTPUT_DIR"], f"progress-{rank}")
os.makedirs(os.path.dirname(progress), exist_ok=True)
start = int(open(progress).read()) if os.path.exists(progress) else 0
for step in range(start + 1, int(os.environ.get("STEPS", "8")) + 1):
    if rank == 0:
        print(json.dumps({"step": step, "loss": 1.0 / step, "t": time.time()}), flush=True)
    dist.all_reduce(torch.ones(1))
    if step % 2 == 0:
        with open(progress, "w") as fh:
            fh.write(str(step))
    time.sleep(float(os.environ.get("STEP_S", "0.2")))
dist.barrier()
os._exit(0)
'''
JOB = "name: steps\nscript: steps.py\nresume:\n  layout: none\nmetrics:\n  format: jsonl\n"


class Bob:
    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.cluster, self.dir = cluster, work / "bob"
        self.dir.mkdir()
        (self.dir / "home").mkdir()
        self.src = self.dir / "src"
        self.src.mkdir()
        (self.src / "steps.py").write_text(STEPS)
        (self.src / "job.yaml").write_text(JOB)
        self.inventory = str(cluster.write_inventory(self.dir / "lab.yaml", user="bob", workdir="/tmp/home-bob/mnft"))

    def env(self) -> dict:
        return dict(os.environ, HOME=str(self.dir / "home"), MNFT_HOME=str(self.dir / "home" / ".mnft"), MNFT_RUNS_DIR=str(self.dir / "runs"),
                    PYTHONUNBUFFERED="1")

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "invoke", "-r", str(REPO), *args]

    def run(self, *args: str) -> str:
        done = subprocess.run(self.argv(*args), env=self.env(), capture_output=True, text=True, timeout=600, cwd=REPO)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed: {(done.stdout + done.stderr)[-3000:]}")
        return done.stdout

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)

    def output(self, run_id: str, attempt: int = 1) -> str:
        name = run_id if attempt == 1 else f"{run_id}-a{attempt}"
        path = self.cluster.hosts[0].root / "tmp" / "home-bob" / "mnft" / "runs" / name / "h1" / "output.log"
        return path.read_text() if path.is_file() else ""

    def latest(self) -> str:
        return max((p for p in (self.dir / "runs").glob("[!.]*") if p.is_dir()), key=lambda p: p.stat().st_mtime).name


def wait_for(predicate, timeout: float = 300, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(every)
    raise SystemExit("timed out")


def first_step_at(bob: Bob, run_id: str, attempt: int = 1, after: int = 0) -> float:
    def seen():
        for line in bob.output(run_id, attempt).splitlines():
            m = re.search(r'\{"step": (\d+), .*"t": ([\d.]+)\}', line)
            if m and int(m.group(1)) > after:
                return float(m.group(2))
        return None

    return wait_for(seen)


def run_ids_before(bob: Bob) -> set[str]:
    return {p.name for p in (bob.dir / "runs").glob("[!.]*")} if (bob.dir / "runs").is_dir() else set()


def attached(bob: Bob, *extra: str, steps: int = 6) -> tuple[subprocess.Popen, str, float]:
    before = run_ids_before(bob)
    t0 = time.time()
    proc = bob.start("train", "--hosts", bob.inventory, "--src", str(bob.src), "--job", str(bob.src / "job.yaml"), "--env", f"STEPS={steps}",
                     *extra)
    run_id = wait_for(lambda: next(iter(run_ids_before(bob) - before), None))
    return proc, run_id, t0


def detached(bob: Bob, *extra: str, steps: int = 6) -> tuple[str, float]:
    t0 = time.time()
    out = bob.run("train", "--hosts", bob.inventory, "--src", str(bob.src), "--job", str(bob.src / "job.yaml"), "--env", f"STEPS={steps}",
                  "--detach", *extra)
    return re.search(r"^run (\S+) handed to its supervisor", out, re.M).group(1), t0


def footprint(pid: int, seconds: float) -> dict:
    proc = psutil.Process(pid)
    before, t = proc.cpu_times(), time.monotonic()
    rss = []
    end = t + seconds
    while time.monotonic() < end:
        rss.append(proc.memory_info().rss)
        time.sleep(0.5)
    after = proc.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    return {"cpu_pct": round(100 * used / (time.monotonic() - t), 2), "rss_mb": round(max(rss) / 2**20, 1)}


def recovery(bob: Bob, run_id: str) -> float:
    """Seconds from killing h2's ranks (after step 4) to attempt 2's first step on the master."""
    first_step_at(bob, run_id, 1, after=4)
    killed = time.time()
    bob.cluster.run(bob.cluster.hosts[1], ["pkill", "-KILL", "-u", "bob", "-f", "steps.py"], check=False)
    return first_step_at(bob, run_id, 2) - killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    figures: dict = {"start_s": {"attached": [], "detached": []}, "recovery_s": {"attached": [], "detached": []}}
    with tempfile.TemporaryDirectory(prefix="mnft-bench-supervisor-") as tmp, Cluster.create(4, Path(tmp), outsider=False) as cluster:
        cluster.add_user("bob", torch=True)
        bob = Bob(cluster, Path(tmp))
        (bob.dir / "mesh.yaml").write_text("- name: mesh\n  mesh: {}\n")
        bob.run("setup", "--hosts", bob.inventory, "--playbook", str(bob.dir / "mesh.yaml"))
        run_id, _ = detached(bob)  # places the bundle on the master: the runs measured below find it there
        bob.run("wait", run_id)
        for turn in range(args.repeat):
            proc, run_id, t0 = attached(bob)
            figures["start_s"]["attached"].append(first_step_at(bob, run_id) - t0)
            proc.wait(timeout=300)
            run_id, t0 = detached(bob)
            figures["start_s"]["detached"].append(first_step_at(bob, run_id) - t0)
            bob.run("wait", run_id)

            proc, run_id, _ = attached(bob, "--max-restarts", "1", "--backoff", "0.5", steps=14)
            figures["recovery_s"]["attached"].append(recovery(bob, run_id))
            proc.wait(timeout=300)
            run_id, _ = detached(bob, "--max-restarts", "1", "--backoff", "0.5", steps=14)
            figures["recovery_s"]["detached"].append(recovery(bob, run_id))
            bob.run("wait", run_id)
            print(f"turn {turn + 1}: start {figures['start_s']['attached'][-1]:.2f} / {figures['start_s']['detached'][-1]:.2f} s, "
                  f"recovery {figures['recovery_s']['attached'][-1]:.2f} / {figures['recovery_s']['detached'][-1]:.2f} s", flush=True)

        proc, run_id, _ = attached(bob, "--env", "STEP_S=0.5", steps=80)
        first_step_at(bob, run_id)
        controller = psutil.Process(proc.pid)
        mnft_pid = next((c.pid for c in [controller, *controller.children(recursive=True)] if "invoke" in " ".join(c.cmdline())), proc.pid)
        figures["footprint"] = {"attached_controller": footprint(mnft_pid, 20)}
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        run_id, _ = detached(bob, "--env", "STEP_S=0.5", steps=80)
        first_step_at(bob, run_id)
        pid = json.loads((bob.dir / "runs" / run_id / "run.json").read_text())["supervisor"]["pid"]
        figures["footprint"]["supervisor"] = footprint(pid, 20)
        bob.run("stop", run_id)

    med = {k: {side: round(statistics.median(v), 2) for side, v in d.items()} for k, d in figures.items() if k != "footprint"}
    print(f"{'':28s}{'attached':>10s}{'detached':>10s}{'ratio':>8s}")
    for key, label in (("start_s", "start to first step, s"), ("recovery_s", "kill to next step, s")):
        a, d = med[key]["attached"], med[key]["detached"]
        print(f"{label:28s}{a:10.2f}{d:10.2f}{d / a:8.2f}")
    fp = figures["footprint"]
    print(f"{'CPU while training, %':28s}{fp['attached_controller']['cpu_pct']:10.2f}{fp['supervisor']['cpu_pct']:10.2f}")
    print(f"{'RSS while training, MB':28s}{fp['attached_controller']['rss_mb']:10.1f}{fp['supervisor']['rss_mb']:10.1f}")
    if args.out:
        args.out.write_text(json.dumps({"median": med, "raw": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
