#!/usr/bin/env python3
"""The GPU path, proven on one machine (issue 30): one H100/H200 with CUDA torch installed, the embedded kind of
inventory (this machine, `connection: local`, no SSH), NCCL. In under 8 minutes it runs:

1. `mnft check --json`: the real driver, CUDA, NCCL and devices as mnft reads and judges them;
2. the lora and the full recipe through mnft (torchrun; `--gpus 1`: the device picked and set by mnft's device
   leases) for a fixed number of steps in bf16, with tokens/s and peak memory from the recipe's metrics; and the
   same model and data through Hugging Face's Trainer (+ PEFT for LoRA) as the baseline, in the same run
   (bench/assets/hf_baseline.py);
3. a real CUDA out-of-memory in a rank (a script that asks for more than the device has), which mnft must name
   as the failure with its fix;

4. the GPU health read (issue 37) as mnft's lease script reads it, through NVML (ctypes on libnvidia-ml.so.1) and
   through nvidia-smi, side by side: each way's time per look (median of 10) and what it read;

then writes the figures, the device and the date as Markdown for docs/gpu.md (--out) and JSON (--json).

On a machine without CUDA it runs the same steps on the CPU in fp32 (no --gpus: a host without nvidia-smi is
one device) and says what it skipped: the script is tested there (tests/test_bench_gpu.py), so it is ready
whenever a GPU is.

    python bench/gpu.py [--steps 40] [--model tiny|DIR] [--out /tmp/gpu.md] [--json /tmp/gpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MNFT = [sys.executable, "-c", "from mnft.cli.main import main; main()"]
WARMUP = 3  # the recipes' first steps (allocator, first kernel launches) are left out of tokens/s
OOM_SCRIPT = '''"""Ask the device for more memory than it has: a real CUDA out-of-memory in a rank."""
import torch

total = torch.cuda.get_device_properties(0).total_memory
torch.empty(int(total * 4), dtype=torch.uint8, device="cuda")
'''


def cuda() -> dict | None:
    """The device this machine's torch sees (None: no CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__, "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}", "bf16": torch.cuda.is_bf16_supported()}


class Bench:
    def __init__(self, work: Path, steps: int, model: str, device: dict | None) -> None:
        self.work, self.steps, self.model, self.device = work, steps, model, device
        self.home = work / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.inventory = work / "local.yaml"
        self.inventory.write_text(f"hosts:\n  local:\n    connection: local\n    python: {json.dumps(sys.executable)}\n    slots: 1\n"
                                  f"    workdir: {work / 'wd'}\n    data_dir: {work / 'data'}\n")
        self.env = dict(os.environ, HOME=str(self.home), MNFT_RUNS_DIR=str(work / "runs"), PYTHONUNBUFFERED="1")

    def mnft(self, *args: str, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
        return subprocess.run([*MNFT, *args], cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def latest_record(self) -> dict:
        runs = sorted((self.work / "runs").iterdir())
        return json.loads((runs[-1] / "run.json").read_text())

    # ------------------------------------------------------------------------------------------------ the steps

    def check(self) -> dict:
        done = self.mnft("check", "--hosts", str(self.inventory), "--json", "--no-network")
        report = json.loads(done.stdout)
        facts = ((report.get("hosts") or {}).get("local") or {}).get("facts") or {}
        nvidia = facts.get("nvidia") or {}
        return {"exit_code": done.returncode, "driver": nvidia.get("driver"), "cuda_driver": nvidia.get("cuda_driver"),
                "torch": (facts.get("torch") or {}).get("version"), "torch_cuda": (facts.get("torch") or {}).get("cuda"), "nccl": facts.get("nccl"),
                "gpus": [{k: g.get(k) for k in ("index", "name", "memory_total_mib")} for g in nvidia.get("gpus") or []],
                "problems": [f"{p.get('field')}: {p.get('message')}" for p in report.get("problems") or []]}

    def recipe(self, name: str) -> dict:
        args = ["train", "--hosts", str(self.inventory), "--recipe", name, "--set", f"max_steps={self.steps}", "--set", "save_every=0",
                "--set", "log_every=1", "--set", f"model={self.model}", "--set", "mixed_precision=" + ("bf16" if self.device else "fp32")]
        if self.device:
            args += ["--gpus", "1"]  # the device picked, leased and set (CUDA_VISIBLE_DEVICES) by mnft
        started = time.monotonic()
        done = self.mnft(*args, timeout=600)
        wall = time.monotonic() - started
        record = self.latest_record()
        host = record["hosts"]["local"]
        lines = [json.loads(line) for line in Path(os.path.expanduser(host["metrics"].replace("~", str(self.home), 1))).read_text().splitlines()
                 if line.startswith("{")]
        steps = [m for m in lines if "step" in m and not m.get("skipped")]
        timed = [m for m in steps if m["step"] > WARMUP]
        return {"exit_code": done.returncode, "wall_s": round(wall, 1), "steps": len(steps), "devices": record.get("devices"),
                "visible": (host.get("env") or {}).get("CUDA_VISIBLE_DEVICES"),
                "tokens_per_s": round(statistics.median(m["tokens_per_s"] for m in timed), 1) if timed else None,
                "peak_memory_mb": round(max(m["peak_memory_mb"] for m in steps), 1) if steps else None,
                "final_loss": round(steps[-1]["loss"], 4) if steps else None, "error": done.stderr[-1500:] if done.returncode else None}

    def model_dir(self) -> str:
        if self.model != "tiny":
            return self.model
        models = self.home / ".cache" / "mnft" / "models"  # built by the recipe run under this HOME
        return str(next(p for p in models.iterdir() if p.is_dir() and not p.name.startswith(".")))

    def baseline(self, name: str) -> dict:
        out = self.work / f"hf-{name}.json"
        argv = [sys.executable, str(REPO / "bench" / "assets" / "hf_baseline.py"), "--recipe", name, "--model-dir", self.model_dir(),
                "--steps", str(self.steps), "--micro-batch", "8", "--seq", "64", "--out", str(out)] + (["--bf16"] if self.device else [])
        # on the CPU, torchrun gives each rank OMP_NUM_THREADS=1: the baseline gets the same threads, or it compares cores
        env = dict(self.env, CUDA_VISIBLE_DEVICES=self.env.get("CUDA_VISIBLE_DEVICES", "0")) if self.device else dict(self.env, OMP_NUM_THREADS="1")
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return {"exit_code": done.returncode, "error": done.stderr[-1500:]}
        return dict(json.loads(out.read_text()), exit_code=0)

    def oom(self) -> dict:
        if not self.device:
            return {"skipped": "no CUDA device: a CUDA out-of-memory needs one"}
        src = self.work / "oom-src"
        src.mkdir(exist_ok=True)
        (src / "oom.py").write_text(OOM_SCRIPT)
        done = self.mnft("train", "--hosts", str(self.inventory), "--gpus", "1", "--src", str(src), "--", "oom.py", cwd=src)
        said = done.stdout + done.stderr
        named = next((line.strip() for line in said.splitlines() if "CUDA out of memory" in line), None)
        fix = next((line.strip() for line in said.splitlines() if line.strip().startswith("fix:")), None)
        return {"exit_code": done.returncode, "named": named, "fix": fix, "traceback_shown": "Traceback" in said}


def health(repeats: int = 10) -> dict:
    """The health read both ways (mnft.onhost.nvml.read_nvml, mnft.onhost.health.smi_gpus), timed per look, and what each read
    (health as mnft.onhost.health.health_problems judges it): {"nvml": …, "nvidia-smi": …}, a way missing here skipped."""
    import shutil

    from mnft.onhost.health import health_problems, smi_gpus
    from mnft.onhost.nvml import read_nvml

    out = {}
    exe = shutil.which("nvidia-smi")
    ways = {"nvml": read_nvml, "nvidia-smi": (lambda: smi_gpus(exe)) if exe else None}
    for name, read in ways.items():
        if read is None:
            out[name] = {"skipped": "no nvidia-smi on the PATH"}
            continue
        times, devices = [], None
        try:
            for _ in range(repeats):
                t = time.perf_counter()
                devices = read()
                times.append(time.perf_counter() - t)
        except OSError as exc:
            out[name] = {"skipped": f"{type(exc).__name__}: {exc}"}
            continue
        out[name] = {"median_ms": round(statistics.median(times) * 1000, 3), "first_ms": round(times[0] * 1000, 3), "gpus": len(devices),
                     "problems": {str(d.get("index")): [p["what"] for p in health_problems(d)] for d in devices}}
    return out


def health_markdown(found: dict) -> list[str]:
    lines = ["", "GPU health read, per look (median of 10; the first, with NVML's start, apart):", "",
             "| way | median ms | first ms | GPUs | what it judged |", "|---|---|---|---|---|"]
    for name, h in found.items():
        if "skipped" in h:
            lines.append(f"| {name} | skipped: {h['skipped']} | | | |")
        else:
            judged = "; ".join(f"GPU {i}: {', '.join(p)}" for i, p in h["problems"].items() if p) or "healthy"
            lines.append(f"| {name} | {h['median_ms']} | {h['first_ms']} | {h['gpus']} | {judged} |")
    return lines


def ratio(a, b) -> str:
    return f"{a / b:.2f}×" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "–"


def markdown(result: dict) -> str:
    dev = result["device"]
    where = f"{dev['name']} ({dev['memory_gib']} GiB, CUDA {dev['cuda']}, torch {dev['torch']})" if dev else "CPU only (no CUDA): a dry run of the script, not GPU figures"
    lines = [f"## bench/gpu.py on {where}, {result['date']}", "",
             f"check: exit {result['check']['exit_code']}; driver {result['check']['driver']}, CUDA (driver) {result['check']['cuda_driver']}, "
             f"torch {result['check']['torch']} (CUDA {result['check']['torch_cuda']}), NCCL {result['check']['nccl']}, "
             f"GPUs {', '.join(g['name'] or '?' for g in result['check']['gpus']) or 'none'}", "",
             f"{result['steps']} steps each, micro-batch 8, sequence ≤ 64 tokens, {'bf16' if dev else 'fp32'}; tokens/s is the median "
             f"after the first {WARMUP} steps, of the tokens that carry loss.", "",
             "| recipe | mnft tokens/s | HF Trainer tokens/s | mnft / HF | mnft peak MiB | HF peak MiB | devices mnft set | mnft wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("lora", "full"):
        m, h = result["recipes"][name], result["baselines"][name]
        lines.append(f"| {name} | {m.get('tokens_per_s')} | {h.get('tokens_per_s') and round(h['tokens_per_s'], 1)} | "
                     f"{ratio(m.get('tokens_per_s'), h.get('tokens_per_s'))} | {m.get('peak_memory_mb')} | "
                     f"{h.get('peak_memory_mb') and round(h['peak_memory_mb'], 1)} | {m.get('visible') or m.get('devices')} | {m.get('wall_s')} |")
    oom = result["oom"]
    lines += ["", "CUDA out of memory: " + (oom["skipped"] if "skipped" in oom else
                                            f"exit {oom['exit_code']}; named: {oom['named']!r}; {oom['fix']!r}; a traceback on the terminal: {oom['traceback_shown']}"), ""]
    if result.get("health"):
        lines += health_markdown(result["health"]) + [""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model", default="tiny", help="tiny (built locally) or a local model directory")
    parser.add_argument("--out", default=None, help="write the Markdown for docs/gpu.md here")
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    started = time.monotonic()
    device = cuda()
    with tempfile.TemporaryDirectory(prefix="mnft-bench-gpu-") as tmp:
        bench = Bench(Path(tmp), args.steps, args.model, device)
        result = {"date": time.strftime("%Y-%m-%d"), "device": device, "steps": args.steps, "check": bench.check(), "recipes": {}, "baselines": {}}
        print(f"check: {json.dumps(result['check'])}", flush=True)
        for name in ("lora", "full"):
            result["recipes"][name] = bench.recipe(name)
            print(f"mnft {name}: {json.dumps(result['recipes'][name])}", flush=True)
            result["baselines"][name] = bench.baseline(name)
            print(f"HF Trainer {name}: {json.dumps(result['baselines'][name])}", flush=True)
        result["oom"] = bench.oom()
        print(f"oom: {json.dumps(result['oom'])}", flush=True)
        result["health"] = health()
        print(f"health: {json.dumps(result['health'])}", flush=True)
    result["wall_s"] = round(time.monotonic() - started, 1)
    text = markdown(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    failed = [n for n in ("lora", "full") if result["recipes"][n]["exit_code"] or result["baselines"][n]["exit_code"]]
    oom_ok = "skipped" in result["oom"] or (result["oom"]["exit_code"] == 1 and result["oom"]["named"] and not result["oom"]["traceback_shown"])
    return 1 if failed or not oom_ok else 0


if __name__ == "__main__":
    sys.exit(main())
