#!/usr/bin/env python3
"""The lab's image as the environment (issue 27): what running in a container adds to a run's start.

On 2 simulated hosts with their own podman storage (tests/testbed.py `containers=True`) and the test bed's
CPU-torch image (tests/images.py: this machine's Python, torch, transformers and peft) loaded into both:
`mnft train --recipe lora` timed from the command until rank 0's first step, on the hosts' Python and in the image
(`--image`), in turns, --repeat times each, after one warm-up of each (code synced, the tiny model built). The
record's check seconds are shown beside (with an image the check also runs its probe inside the image). The
difference of the medians is what an image costs at start; the goal is ≤ +3 s.

    python bench/image_start.py [--repeat 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "bench")]  # mnft, the test bed, bench/launch.py's clock

from images import torch_image  # noqa: E402
from launch import finish, first_step  # noqa: E402
from testbed import Cluster  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    image = torch_image()
    with tempfile.TemporaryDirectory(prefix="mnft-bench-image-") as tmp:
        work = Path(tmp)
        (work / "home").mkdir()
        env = dict(os.environ, HOME=str(work / "home"), MNFT_RUNS_DIR=str(work / "runs"), PYTHONUNBUFFERED="1")
        with Cluster.create(2, work / "c", outsider=False, containers=True) as cluster:
            cluster.share_image(cluster.hosts, image)
            inv = cluster.write_inventory(work / "inv.yaml")
            base = [sys.executable, "-c", "from mnft.cli.main import main; main()", "train", "--recipe", "lora", "--hosts", str(inv), "--src", str(REPO),
                    "--set", f"max_steps={args.steps}", "--set", "log_every=1", "--set", "save_every=1000"]
            kinds = {"host": base, "image": base + ["--image", image.ref]}
            seconds: dict[str, list[float]] = {k: [] for k in kinds}
            checks: dict[str, list[float]] = {k: [] for k in kinds}
            for kind, argv in kinds.items():  # warm-up: code synced, tiny model built, the image's files in the page cache
                finish(first_step(argv, env)[1])
            for _ in range(args.repeat):
                for kind, argv in kinds.items():
                    took, procs = first_step(argv, env)
                    finish(procs)
                    seconds[kind].append(took)
                    record = json.loads((sorted((work / "runs").iterdir())[-1] / "run.json").read_text())
                    checks[kind].append(record["timings"].get("check_s") or 0.0)
                    print(f"{kind}: {took:.2f} s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"{'':>6} {'start→step 1 s (median)':>24} {'range':>14} {'check s':>8}")
    for kind in kinds:
        print(f"{kind:>6} {med[kind]:>24.2f} {min(seconds[kind]):>6.2f}–{max(seconds[kind]):<6.2f} {statistics.median(checks[kind]):>8.2f}")
    print(f"image − host: {med['image'] - med['host']:+.2f} s ({med['image'] / med['host']:.2f}x); goal ≤ +3 s; "
          f"{args.repeat} runs each in turns, 2 hosts, lora {args.steps} steps, image {image.ref}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
