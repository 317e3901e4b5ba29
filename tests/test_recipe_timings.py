"""Per-rank step timers of the recipes: every rank writes timings-rank<R>.jsonl (data, compute, comm, checkpoint
time per step), rank 0's metrics.jsonl carries its own figures. Real torchrun runs on gloo, 2 ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

FIELDS = {"step", "rank", "node_rank", "local_rank", "step_s", "data_s", "compute_s", "comm_s", "ckpt_s", "time"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


def torchrun(recipe: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.pop("XDG_CACHE_HOME", None)
    env.update(HOME=str(home), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", f"mnft.recipes.{recipe}", *args]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("recipe", ["lora", "full"])
def test_every_rank_records_where_each_step_went(recipe, home, tmp_path):
    out = tmp_path / "out"
    proc = torchrun(recipe, home, f"output_dir={out}", "max_steps=4", "save_every=2", "save_final=false", "tensorboard=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        start, *steps = lines(out / f"timings-rank{rank}.jsonl")
        assert start["event"] == "start" and start["rank"] == rank and start["world_size"] == 2
        assert start["threads"] >= 1 and start["cpus"] >= 1 and start["device"] == "cpu"
        assert [s["step"] for s in steps] == [1, 2, 3, 4]
        for s in steps:
            assert set(s) == FIELDS and s["rank"] == rank and s["local_rank"] == rank
            assert min(s["data_s"], s["compute_s"], s["comm_s"]) >= 0 and s["comm_s"] > 0  # two all-reduces a step
            assert s["step_s"] == pytest.approx(s["data_s"] + s["compute_s"] + s["comm_s"], abs=1e-5)
        assert [s["ckpt_s"] > 0 for s in steps] == [False, True, False, True]  # checkpoints after steps 2 and 4
    metrics = [r for r in lines(out / "metrics.jsonl") if "loss" in r]
    assert all({"data_s", "compute_s", "comm_s", "step_s"} <= set(r) for r in metrics)


def test_a_resumed_run_appends_to_each_ranks_timings(home, tmp_path):
    out = tmp_path / "out"
    common = (f"output_dir={out}", "save_every=2", "save_final=false", "tensorboard=false")
    assert torchrun("lora", home, *common, "max_steps=2").returncode == 0
    proc = torchrun("lora", home, *common, "max_steps=4", "resume=latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = lines(out / "timings-rank1.jsonl")
    assert [r.get("event") or r["step"] for r in records] == ["start", 1, 2, "start", 3, 4]
