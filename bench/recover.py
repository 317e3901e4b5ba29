#!/usr/bin/env python3
"""Automatic recovery, measured: kill one host's lora workers mid-run (or cut its link) and time the way back.

On a fresh simulated cluster (3 training hosts + 1 spare, testbed), side by side in one run:

* reference: `train --recipe lora` uninterrupted (the final loss to compare with);
* recovered: the same with `--max-restarts 2`; at step --kill-at one host's workers are SIGKILLed (--cut: its
  link goes down instead, so the spare takes its place).

Printed: the time from the kill to the first training step of attempt 2 (goal <= 60 s) and where it goes
(detection, teardown, logs of the failed attempt, backoff/wait, re-check, checkpoint copy, start-up of the new
gang up to its first step), the steps lost (goal: only those since the last complete checkpoint) and the final
loss against the reference. Needs root.

Usage: python bench/recover.py [--steps 24] [--save-every 4] [--kill-at 9] [--cut]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # mnft from this checkout; the test bed (tests/testbed.py)

from testbed import Cluster  # noqa: E402


def run(argv: list[str], env: dict, on_line=None) -> tuple[int, str]:
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if on_line:
            on_line(line)
    return proc.wait(), "".join(out)


def latest(runs: Path) -> dict:
    return json.loads((sorted(p for p in runs.iterdir() if (p / "run.json").is_file())[-1] / "run.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=9)
    ap.add_argument("--cut", action="store_true", help="cut the host's link instead of killing its workers")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mnft-bench-recover-"))
    cluster = Cluster.create(4, work / "cluster")
    try:
        inv = cluster.write_inventory(work / "inv.yaml", hosts=cluster.hosts, slots=1, spare={"h4": True})
        env = dict(os.environ, HOME=str(work), MNFT_RUNS_DIR=str(work / "runs"), PYTHONUNBUFFERED="1")
        base = [sys.executable, "-m", "invoke", "-r", str(REPO), "train", "--hosts", str(inv), "--src", str(REPO),
                "--set", f"max_steps={args.steps}", "--set", "log_every=1", "--set", f"save_every={args.save_every}"]
        code, out = run(base, env)
        if code:
            print(out[-3000:])
            return 1
        reference = latest(work / "runs")
        ref_summary = json.loads((work / "runs" / reference["run_id"] / "summary.json").read_text())

        victim = cluster.hosts[1]
        killed: dict[str, float] = {}

        def on_line(line: str) -> None:
            if not killed and re.search(rf"step +{args.kill_at}/", line):
                killed["t"] = time.time()
                if args.cut:
                    cluster.link_down(victim)
                else:
                    for pid, cmd in cluster.processes(victim):
                        if "mnft.recipes.lora" in cmd and "torch.distributed.run" not in cmd:
                            os.kill(pid, signal.SIGKILL)

        code, out = run(base + ["--max-restarts", "2"], env, on_line)
        if args.cut:
            cluster.link_up(victim)
        record = latest(work / "runs")
        if code or len(record.get("attempts") or []) < 2:
            print(out[-4000:])
            return 1
        first, second = record["attempts"][:2]
        summary = json.loads((work / "runs" / record["run_id"] / "summary.json").read_text())
        back = second["started"] + second["first_step_s"]
        detected = first.get("detected") or first["ended"]
        parts = [
            ("detection (kill -> failure seen)", detected - killed["t"]),
            ("teardown of the gang", first["ended"] - detected),
            ("logs of attempt 1", first.get("logs_s", 0.0)),
            ("backoff / wait for the lost host", first.get("wait_s", 0.0)),
            ("re-check of the new gang", first.get("recheck_s", 0.0)),
            ("checkpoint made whole", second.get("checkpoint_s", 0.0)),
            ("start-up to the first step", second["first_step_s"] - second.get("checkpoint_s", 0.0)),
        ]
        accounted = sum(v for _, v in parts)
        print(f"recovery after {'a cut link' if args.cut else 'killed workers'} on {victim.name} at step {args.kill_at} "
              f"(3 hosts + 1 spare, lora, save_every {args.save_every}, {args.steps} steps)")
        print(f"  kill -> first step of attempt 2: {back - killed['t']:.1f} s (goal <= 60 s)")
        for name, value in parts:
            print(f"    {name:<36} {value:6.1f} s")
        print(f"    {'other (between the phases)':<36} {back - killed['t'] - accounted:6.1f} s")
        print(f"  attempt 2 on {', '.join(second['hosts'])}: resumed from step {second['resumed_step']} "
              f"(last step seen in attempt 1: {first['steps'][1]}; steps lost {first.get('steps_lost')}, "
              f"since the last checkpoint: {first['steps'][1] - (first['steps'][1] // args.save_every) * args.save_every})")
        print(f"  final loss {summary['final_loss']!r} vs uninterrupted {ref_summary['final_loss']!r} "
              f"(ratio {summary['final_loss'] / ref_summary['final_loss']:.9f})")
        print(f"  whole run {record['timings']['total_s']:.1f} s vs uninterrupted {reference['timings']['total_s']:.1f} s "
              f"({record['timings']['total_s'] / reference['timings']['total_s']:.2f}x)")
        return 0
    finally:
        cluster.teardown()


if __name__ == "__main__":
    sys.exit(main())
