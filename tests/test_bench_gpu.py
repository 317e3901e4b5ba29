"""bench/gpu.py, the prepared proof of the GPU path (issue 30), runs here on the CPU so that it is ready whenever a
GPU is: every step runs (check, the lora and full recipes through mnft and the HF Trainer + PEFT baseline on the
same model and data), what needs CUDA (the out-of-memory) says it was skipped, and the Markdown for docs/gpu.md is
written with the figures, the device and the date."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(600)
def test_the_gpu_bench_runs_every_step_on_the_cpu_and_writes_its_report(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs bench/gpu.py for real")
    out, figures = tmp_path / "gpu.md", tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--steps", "5", "--out", str(out), "--json", str(figures)],
                          capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["device"] is None and result["check"]["exit_code"] == 0 and result["check"]["torch"]
    for name in ("lora", "full"):
        mnft, hf = result["recipes"][name], result["baselines"][name]
        assert mnft["exit_code"] == 0 and mnft["steps"] == 5 and mnft["tokens_per_s"] > 0 and mnft["devices"] == {"local": [None]}
        assert hf["exit_code"] == 0 and hf["tokens_per_s"] > 0 and hf["steps"] == 5
    assert result["oom"] == {"skipped": "no CUDA device: a CUDA out-of-memory needs one"}
    text = out.read_text()
    assert text.startswith(f"## bench/gpu.py on CPU only (no CUDA): a dry run of the script, not GPU figures, {time.strftime('%Y-%m-%d')}")
    assert "| lora | " in text and "| full | " in text and "CUDA out of memory: no CUDA device" in text
