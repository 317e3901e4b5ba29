#!/usr/bin/env python3
"""Regenerate the torchtune 0.6.1 test data in this directory: real runs of the released recipes, recorded.

Needs a venv with the release (about 3 minutes to build, the wheels are ~1 GB with torch):

    python3 -m venv --system-site-packages /tmp/ttvenv     # system site: torch (CPU) is reused if installed
    /tmp/ttvenv/bin/pip install torchtune==0.6.1 torchao==0.10.0 tiktoken sentencepiece blobfile safetensors
    /tmp/ttvenv/bin/python tests/data/torchtune-0.6.1/make.py [--venv /tmp/ttvenv] [--work /tmp/tt061-work]

It takes about 2 minutes on 2 CPU cores (seven `tune run`s of ~10 s each, two processes each, gloo) and needs no
network: the model, tokenizer and data set are made here.
- base/: a tiny Llama-3 shaped model (1 layer, dim 16, vocab 128256) in HF format, made with torchtune's own
  convert_weights.tune_to_hf + safetensors + config.json; original/tokenizer.model is a tiktoken BPE file of the 256
  byte tokens (llama3_tokenizer puts its special tokens at 128000+); original_repo_id.json as `tune download` writes.
- data.json: 64 lines of random words for text_completion_dataset.
- The runs use the release's recipes as `tune run --nproc_per_node 2 <recipe> --config configs/<x>.yaml k=v...`, with
  cpu_shim/ on PYTHONPATH: 0.6.1's distributed recipes do not start on CPU without it (see cpu_shim/sitecustomize.py).
- The killed runs are SIGKILLed (the launcher and all its workers at once, as when a host dies) when the first step of epoch 3
  appears in the DiskLogger file, i.e. after epoch_1/ and recipe_state/ were written.

For each run it writes <run>/manifest.json (the output tree: path -> size, the write order by ctime, since
shutil.copy2 keeps the source's mtime on copied files; what recipe_state.pt holds), <run>/metrics.txt (the DiskLogger
file), <run>/stdout.txt and <run>/stderr.txt (trimmed: the resolved-config dumps elided, first and last lines kept).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
SHIM = HERE / "cpu_shim"
ERROR = re.compile(r"^(\[rank\d+\]: )?[A-Za-z_.]*(Error|Exception): ")
KILL_AT_STEP = 7  # 3 steps an epoch: step 7 is the first of epoch 3

BASE_SCRIPT = r'''
import base64, json, random, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from torchtune.models import convert_weights
from torchtune.models.llama3 import llama3

work = Path(sys.argv[1])
base = work / "base"
(base / "original").mkdir(parents=True, exist_ok=True)
with open(base / "original" / "tokenizer.model", "w") as f:
    for i in range(256):
        f.write(f"{base64.b64encode(bytes([i])).decode()} {i}\n")
torch.manual_seed(0)
model = llama3(vocab_size=128256, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, max_seq_len=64,
               intermediate_dim=32)
sd = convert_weights.tune_to_hf(model.state_dict(), num_heads=2, num_kv_heads=1, dim=16)
save_file({k: v.contiguous() for k, v in sd.items()}, base / "model-00001-of-00001.safetensors",
          metadata={"format": "pt"})
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 1,
          "vocab_size": 128256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "float32"}
(base / "config.json").write_text(json.dumps(config, indent=2) + "\n")
(base / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}) + "\n")
(base / "original_repo_id.json").write_text(json.dumps({"repo_id": "mnft/tiny-llama3"}) + "\n")
rng = random.Random(0)
words = "the a cat dog sat on mat ran far near home tree big small red blue".split()
rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(8, 20)))} for _ in range(64)]
(work / "data.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
'''

RECIPE_STATE_SCRIPT = r'''
import json, sys, torch
state = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
out = {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool)) or v is None}
out["keys"] = sorted(state)
print(json.dumps(out))
'''

# (name, recipe, config, overrides, output dir, kill at step)
RUNS = [
    ("full", "full_finetune_distributed", "full.yaml", ["save_every_n_steps=2"], "out/full", None),
    ("lora", "lora_finetune_distributed", "lora.yaml", [], "out/lora", None),
    ("full-killed", "full_finetune_distributed", "full.yaml", ["output_dir=out/full-killed", "epochs=3"],
     "out/full-killed", KILL_AT_STEP),
    ("full-resume-plain", "full_finetune_distributed", "full.yaml",
     ["output_dir=out/full-killed", "epochs=3", "resume_from_checkpoint=True"], "out/full-killed", None),
    ("full-resume", "full_finetune_distributed", "full.yaml",
     ["output_dir=out/full-killed", "epochs=3", "resume_from_checkpoint=True",
      "checkpointer.checkpoint_files=[epoch_1/model-00001-of-00001.safetensors]"], "out/full-killed", None),
    ("lora-killed", "lora_finetune_distributed", "lora.yaml", ["output_dir=out/lora-killed", "epochs=3"],
     "out/lora-killed", KILL_AT_STEP),
    ("lora-resume", "lora_finetune_distributed", "lora.yaml",
     ["output_dir=out/lora-killed", "epochs=3", "resume_from_checkpoint=True"], "out/lora-killed", None),
]


def tree(root: Path) -> dict[str, os.stat_result]:
    """Every file under root (relative path -> stat)."""
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): p.stat() for p in sorted(root.rglob("*")) if p.is_file()}


def manifest(venv: Path, root: Path, before: dict[str, os.stat_result], run: tuple, argv: list[str], code: int,
             killed: bool, stderr: str) -> dict:
    after = tree(root)
    first = min((s.st_ctime_ns for s in after.values()), default=0)
    order = sorted(after, key=lambda p: (after[p].st_ctime_ns, p))
    changed = [p for p in order if p not in before or before[p].st_ctime_ns != after[p].st_ctime_ns]
    state = None
    state_file = root / "recipe_state" / "recipe_state.pt"
    if state_file.exists():
        out = subprocess.run([str(venv / "bin" / "python"), "-c", RECIPE_STATE_SCRIPT, str(state_file)],
                             capture_output=True, text=True, check=True)
        state = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "torchtune": "0.6.1",
        "run": run[0],
        "argv": argv,
        "cwd": "the work directory (base/, data.json, out/)",
        "output_dir": run[4],
        "exit_code": code,
        "killed_with_sigkill_at_step": run[5] if killed else None,
        "files": {p: after[p].st_size for p in sorted(after)},
        "write_order": [[p, round((after[p].st_ctime_ns - first) / 1e6, 3)] for p in order],
        "write_order_note": "by ctime (ms after the first file); copied files keep the source's mtime (copy2)",
        "written_by_this_run": changed,
        "recipe_state": state,
        "error_lines": sorted({line for line in stderr.splitlines() if ERROR.match(line)}),
    }


def trim(text: str, head: int = 45, tail: int = 25) -> str:
    """Drop the resolved-config dumps (they are the yaml) and keep the first and last lines (split on \n only:
    tqdm's \r-separated updates stay on their line, as a terminal-less reader gets them)."""
    lines, out, skipping = text.split("\n"), [], 0
    for line in lines:
        if "with resolved config:" in line:
            out.append(line)
            skipping = 1
            continue
        if skipping:
            if line == "" or line.startswith((" ", "-")) or (":" in line and not line.startswith(("[", "INFO", "DEBUG",
                                                                                                   "WARNING", "W1", "E1"))):
                skipping += 1
                continue
            out.append(f"[make.py: {skipping - 1} lines of the resolved config elided]")
            skipping = 0
        out.append(line)
    if len(out) > head + tail + 1:
        out = out[:head] + [f"[make.py: {len(out) - head - tail} lines elided]"] + out[-tail:]
    return "\n".join(out)


def descendants(pid: int) -> list[int]:
    """pid and every process below it (torch's elastic agent starts each worker in a new session,
    torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py:66, so a signal to the
    launcher's process group does not reach the workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher and its workers at once (as when the host dies) and wait until they are gone."""
    pids = descendants(pid)
    for one in pids:
        try:
            os.kill(one, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while any(alive(one) for one in pids if one != pid):
        time.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def launch(venv: Path, work: Path, run: tuple) -> tuple[list[str], int, str, str, bool]:
    name, recipe, config, overrides, out_dir, kill_at = run
    argv = ["tune", "run", "--nproc_per_node", "2", recipe, "--config", f"configs/{config}", *overrides]
    env = dict(os.environ, PYTHONPATH=str(SHIM), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    env.pop("TQDM_DISABLE", None)
    with open(work / f"{name}.stdout", "w") as so, open(work / f"{name}.stderr", "w") as se:
        proc = subprocess.Popen([str(venv / "bin" / "tune"), *argv[1:]], cwd=work, env=env, stdout=so, stderr=se,
                                start_new_session=True)
        killed = False
        if kill_at is not None:
            logs = work / out_dir / "logs"
            while proc.poll() is None and not killed:
                for log in logs.glob("log_*.txt") if logs.exists() else []:
                    if f"Step {kill_at} |" in log.read_bytes().decode():
                        kill_tree(proc.pid)
                        killed = True
                time.sleep(0.01)
            if not killed:
                sys.exit(f"{name}: ended before step {kill_at}; nothing to kill")
        code = proc.wait()
    # bytes, so that tqdm's \r stays (read_text would turn it into \n)
    stdout, stderr = ((work / f"{name}.{kind}").read_bytes().decode() for kind in ("stdout", "stderr"))
    return argv, code, stdout, stderr, killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/tmp/ttvenv"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/tt061-work"))
    args = parser.parse_args()
    venv, work = args.venv.resolve(), args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copytree(CONFIGS, work / "configs")
    subprocess.run([str(venv / "bin" / "python"), "-c", BASE_SCRIPT, str(work)], check=True)
    for run in RUNS:
        name, out_dir = run[0], run[4]
        root = work / out_dir
        before = tree(root)
        logs_before = set(before)
        started = time.monotonic()
        argv, code, stdout, stderr, killed = launch(venv, work, run)
        print(f"{name}: exit {code}{' (killed)' if killed else ''} in {time.monotonic() - started:.1f} s")
        dest = HERE / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        data = manifest(venv, root, before, run, argv, code, killed, stderr)
        (dest / "manifest.json").write_text(json.dumps(data, indent=1) + "\n")
        new_logs = sorted(p for p in data["files"] if p.startswith("logs/") and p not in logs_before)
        (dest / "metrics.txt").write_text("".join((root / p).read_bytes().decode() for p in new_logs))
        (dest / "stdout.txt").write_text(trim(stdout))
        (dest / "stderr.txt").write_text(trim(stderr))


if __name__ == "__main__":
    main()
