#!/usr/bin/env python3
"""Time from command to the first training step: `invoke train --recipe lora` vs a hand-written ssh loop.

For 2, 4 and 8 simulated hosts (network namespaces with sshd, testbed), side by side in one run:

* mnft: `invoke train --recipe lora --hosts INV` (check + sync + launch + gang supervision), timed from the
  command until rank 0 prints its first step; the run record's check and sync seconds are shown separately;
* by hand: the exact torchrun commands mnft ran (taken from the run record), started with one `ssh` per host
  in parallel (the loop a lab writes by hand), timed the same way.

A warm-up run first builds the tiny model on every host, so neither side pays for it. Needs root.

--steady: the cost while training, for a user's own script (bench/assets/steady_ddp.py, a hand-written DDP loop):
`mnft train -- steady_ddp.py` vs the same torchrun commands started by hand over ssh, each timed by the script's
own per-step clock on rank 0; the median step time after a warm-up of 10 steps, repeated --repeat times in turns.

Usage: python bench/launch.py [--hosts 2,4,8] [--steps 3]
       python bench/launch.py --steady [--hosts 2] [--steps 80] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed (tests/testbed.py)

from testbed import Cluster  # noqa: E402

FIRST_STEP = re.compile(r"step +1/")


def first_step(argv: list[str] | list[list[str]], env: dict, timeout: float = 600) -> tuple[float, list[subprocess.Popen]]:
    """Start the command(s); seconds until a 'step 1/' line appears on the first one's output."""
    commands = argv if isinstance(argv[0], list) else [argv]
    started = time.monotonic()
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands]
    deadline = started + timeout
    seen: list[str] = []
    for line in procs[0].stdout:
        seen.append(line)
        if FIRST_STEP.search(line):
            return time.monotonic() - started, procs
        if time.monotonic() > deadline:
            break
    raise RuntimeError("no first step: " + " ".join(commands[0][:6]) + "\n" + "".join(seen[-40:]))


def finish(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench(n: int, steps: int, work: Path) -> dict:
    cluster = Cluster.create(n, work / f"c{n}", outsider=False)
    try:
        inv = cluster.write_inventory(work / f"inv{n}.yaml")
        env = dict(os.environ, HOME=str(work / "home"), MNFT_RUNS_DIR=str(work / f"runs{n}"), PYTHONUNBUFFERED="1")
        (work / "home").mkdir(exist_ok=True)
        train = [sys.executable, "-m", "invoke", "-r", str(REPO), "train", "--recipe", "lora", "--hosts", str(inv),
                 "--src", str(REPO), "--set", f"max_steps={steps}", "--set", "log_every=1", "--set", "save_every=1000"]
        finish(first_step(train, env)[1])  # warm-up: code synced, tiny model built on every host
        mnft_s, procs = first_step(train, env)
        finish(procs)
        runs = sorted((work / f"runs{n}").iterdir())
        record = json.loads((runs[-1] / "run.json").read_text())
        loop = []
        for host in cluster.hosts:
            info = record["hosts"][host.name]
            exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in info["env"].items())
            remote = f"cd {info['cwd']} && env {exports} {info['command'].replace('outputs/', 'outputs/bench-')}"
            loop.append(cluster.ssh_argv(host, ["sh", "-c", remote]))
        hand_s, procs = first_step(loop, env)
        finish(procs)
        return {"hosts": n, "mnft_s": mnft_s, "hand_s": hand_s, "check_s": record["timings"].get("check_s"),
                "sync_s": record["timings"].get("sync_s"), "launch_s": record["timings"].get("launch_s")}
    finally:
        cluster.teardown()


ASSETS = REPO / "bench" / "assets"


def step_times(output: str, warmup: int = 10) -> list[float]:
    """Seconds between rank 0's consecutive steps, after the warm-up steps."""
    stamps = []
    for line in output.splitlines():
        match = re.search(r"\{\"step\": (\d+).*\"t\": ([\d.]+)\}", line)
        if match:
            stamps.append((int(match.group(1)), float(match.group(2))))
    stamps.sort()
    return [b[1] - a[1] for a, b in zip(stamps, stamps[1:]) if a[0] >= warmup]


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def steady(n: int, steps: int, repeat: int, work: Path, width: int = 512) -> dict:
    cluster = Cluster.create(n, work / f"s{n}", outsider=False)
    try:
        inv = cluster.write_inventory(work / f"sinv{n}.yaml")
        env = dict(os.environ, HOME=str(work / "home"), MNFT_RUNS_DIR=str(work / f"sruns{n}"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        (work / "home").mkdir(exist_ok=True)
        mnft = [sys.executable, "-c", "from mnft.cli.main import main; main()", "train", "--hosts", str(inv), "--src", str(ASSETS),
                "--env", "OMP_NUM_THREADS", "--", "steady_ddp.py", "--steps", str(steps), "--width", str(width)]
        mnft_times, hand_times = [], []
        for _ in range(repeat):
            done = subprocess.run(mnft, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError("mnft run failed: " + done.stdout[-2000:] + done.stderr[-2000:])
            mnft_times.append(median(step_times(done.stdout)))
            record = json.loads((sorted((work / f"sruns{n}").iterdir())[-1] / "run.json").read_text())
            loop = []
            for host in cluster.hosts:
                info = record["hosts"][host.name]
                exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in info["env"].items())
                loop.append(cluster.ssh_argv(host, ["sh", "-c", f"cd {info['cwd']} && env {exports} {info['command']}"]))
            procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in loop]
            outputs = [p.communicate(timeout=900)[0] for p in procs]
            hand_times.append(median(step_times(outputs[0])))
        return {"hosts": n, "width": width, "mnft_step_s": median(mnft_times), "hand_step_s": median(hand_times), "runs": repeat}
    finally:
        cluster.teardown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4,8")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--steady", action="store_true", help="steady-state step time of a user script, mnft vs by hand")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--width", default="512", help="--steady: the model's width(s), comma-separated (a wider model: a longer step)")
    args = parser.parse_args()
    if args.steady:
        with tempfile.TemporaryDirectory(prefix="mnft-bench-steady-") as tmp:
            rows = [steady(int(x), max(args.steps, 30), args.repeat, Path(tmp), int(w)) for x in args.hosts.split(",") for w in args.width.split(",")]
        print(f"{'hosts':>5} {'width':>6} {'mnft step ms':>13} {'by hand step ms':>16} {'ratio':>6}")
        for r in rows:
            print(f"{r['hosts']:>5} {r['width']:>6} {r['mnft_step_s'] * 1000:>13.2f} {r['hand_step_s'] * 1000:>16.2f} {r['mnft_step_s'] / r['hand_step_s']:>6.3f}")
        print(f"median of {args.repeat} runs each, taking turns; goal: ratio ≤ 1.02 (mnft costs nothing while training)")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="mnft-bench-launch-") as tmp:
        for n in (int(x) for x in args.hosts.split(",")):
            try:
                rows.append(bench(n, args.steps, Path(tmp)))
            except RuntimeError as exc:  # one failed size (a loaded machine) must not lose the others
                print(f"{n} hosts failed: {exc}", file=sys.stderr, flush=True)
                rows.append({"hosts": n, "failed": str(exc).splitlines()[0]})
                continue
            print(f"{n} hosts done", file=sys.stderr, flush=True)
    print(f"{'hosts':>5} {'mnft s':>8} {'by hand s':>10} {'ratio':>6}   {'check s':>8} {'sync s':>7} {'launch s':>9}")
    for r in rows:
        if "failed" in r:
            print(f"{r['hosts']:>5} failed: {r['failed']}")
            continue
        print(f"{r['hosts']:>5} {r['mnft_s']:>8.2f} {r['hand_s']:>10.2f} {r['mnft_s'] / r['hand_s']:>6.2f}   "
              f"{r['check_s']:>8.2f} {r['sync_s']:>7.2f} {r['launch_s']:>9.2f}")
    print("goal: ratio ≤ 1.2 (mnft includes its check and sync; 'by hand' runs the same torchrun commands over ssh)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
