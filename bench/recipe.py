"""Benchmark: tokens/s of the ``lora`` recipe vs Hugging Face Trainer + PEFT, in one run; and the demo bar.

    python bench/recipe.py [--steps 100] [--micro-batch-size 8] [--threads 1] [--repeat 3]
    python bench/recipe.py --demo-bar

Same model (the tiny locally-built Llama), same LoRA config, same tokenized data and collate, same batch
size, steps, optimizer (AdamW), schedule (cosine with warmup) and clipping; no checkpoints, one process each,
the same number of CPU threads. Only trained (unmasked) tokens are counted for both, divided by the summed
time of the optimizer steps, each step's time including getting its batch (the recipe's ``tokens_per_s``
does; for the Trainer the step-end to step-end time). Prints both and the ratio recipe / Trainer (goal >= 1.0).

``--demo-bar`` runs the default ``lora`` and ``full`` configs as a user would (``torchrun --nproc-per-node 2``,
CPU, a fresh output dir, the tiny model already cached) and prints each one's wall seconds, including start-up
and model load, and final/initial loss against the goals (<= 90 s, <= 50%). The tests assert only the loss.
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

REPO = Path(__file__).resolve().parents[1]


def run_recipe(args, out: Path) -> float:
    """The recipe as a user runs it (its own process, world of one); tokens/s from its summary line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "mnft.recipes.lora", f"output_dir={out}", f"max_steps={args.steps}",
           f"micro_batch_size={args.micro_batch_size}", "grad_accum_steps=1", "save_every=0", "save_final=false",
           f"log_every={args.steps}", "tensorboard=false"]
    subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    summary = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["event"] == "summary"
    return summary["tokens_per_s"]


def run_trainer(args, out: Path) -> float:
    """HF Trainer + PEFT on the same model, data and settings; trained tokens counted in the collator."""
    import peft
    import torch
    import transformers

    from mnft.recipes import common, data, model
    from mnft.recipes.config import load_config

    torch.set_num_threads(args.threads)
    cfg = load_config("lora", [f"max_steps={args.steps}", f"micro_batch_size={args.micro_batch_size}"])
    path = model.cache_root(cfg.model_cache_dir) / model.tiny_key()
    if not path.is_dir():
        raise SystemExit(f"{path} missing: the recipe run builds it first")
    torch.manual_seed(cfg.seed)
    base, tok = model.load(path, torch.float32)
    net = peft.get_peft_model(base, peft.LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules), task_type="CAUSAL_LM"))
    rows = data.build(tok, cfg.data_path, cfg.max_seq_len, cfg.packing)
    counted = {"tokens": 0}

    def collate(features):
        batch = data.collate(features, tok.pad_token_id)
        counted["tokens"] += data.trained_tokens(batch)
        return batch

    class StepTimer(transformers.TrainerCallback):
        """Step-end to step-end, so each step's time includes fetching and collating its batch, as the recipe's
        does (Trainer fetches a step's batches *before* on_step_begin; only step 1's fetch is left out)."""

        def __init__(self):
            self.total, self.last = 0.0, None

        def on_step_begin(self, *a, **k):
            if self.last is None:
                self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            self.total, self.last = self.total + now - self.last, now

    timer = StepTimer()
    targs = transformers.TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=1, learning_rate=cfg.lr, lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps, max_grad_norm=cfg.max_grad_norm, adam_beta1=cfg.adam_betas[0],
        adam_beta2=cfg.adam_betas[1], weight_decay=cfg.weight_decay, optim="adamw_torch", save_strategy="no",
        logging_steps=args.steps, report_to=[], use_cpu=True, dataloader_num_workers=0, seed=cfg.seed,
        remove_unused_columns=False, disable_tqdm=True)
    trainer = transformers.Trainer(model=net, args=targs, train_dataset=rows, data_collator=collate,
                                   callbacks=[timer])
    del common  # (same loss definition: HF shifts labels and ignores -100 exactly like the recipe)
    trainer.train()
    return counted["tokens"] / timer.total


DEMO_WALL_GOAL_S, DEMO_LOSS_GOAL = 90.0, 0.5


def demo_bar(recipe: str, out: Path) -> tuple[float, float]:
    """Wall seconds of ``torchrun --nproc-per-node 2 -m mnft.recipes.<recipe>`` (default config) and its
    final/initial loss from the summary line of metrics.jsonl."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", f"mnft.recipes.{recipe}",
           f"output_dir={out}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    summary = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("event") == "summary"][-1]
    return wall, summary["final_loss"] / summary["initial_loss"]


def main_demo_bar() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # build (or find) the tiny model first, so its one-off build is not charged to the first recipe
        warm = [sys.executable, "-m", "mnft.recipes.lora", f"output_dir={tmp}/warm", "max_steps=1",
                "save_final=false"]
        subprocess.run(warm, check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
        results = {recipe: demo_bar(recipe, Path(tmp) / recipe) for recipe in ("lora", "full")}
    for recipe, (wall, ratio) in results.items():
        print(f"demo bar {recipe:4}: wall {wall:5.1f} s (goal <= {DEMO_WALL_GOAL_S:.0f} s: "
              f"{'met' if wall <= DEMO_WALL_GOAL_S else 'NOT met'}), final/initial loss {ratio:.1%} "
              f"(goal <= {DEMO_LOSS_GOAL:.0%}: {'met' if ratio <= DEMO_LOSS_GOAL else 'NOT met'})")
    print(f"(2 processes under torchrun, default configs, CPU, {os.cpu_count()} cores; load average "
          f"{os.getloadavg()[0]:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, taking turns; the median is reported")
    parser.add_argument("--demo-bar", action="store_true",
                        help="instead: wall time and loss ratio of the default lora and full configs, 2 processes")
    args = parser.parse_args()
    if args.demo_bar:
        return main_demo_bar()
    recipe, trainer = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):  # the two take turns (and swap order) so a load burst hits both alike
            order = [(recipe, run_recipe), (trainer, run_trainer)]
            for results, run in order if rep % 2 == 0 else order[::-1]:
                results.append(run(args, Path(tmp) / f"{run.__name__}-{rep}"))
    ratios = [r / t for r, t in zip(recipe, trainer)]
    print(f"lora recipe:        {statistics.median(recipe):10.0f} trained tokens/s  (runs: "
          f"{', '.join(f'{x:.0f}' for x in recipe)})")
    print(f"HF Trainer + PEFT:  {statistics.median(trainer):10.0f} trained tokens/s  (runs: "
          f"{', '.join(f'{x:.0f}' for x in trainer)})")
    print(f"ratio recipe/Trainer: {statistics.median(ratios):.2f} median of {len(ratios)} "
          f"({', '.join(f'{x:.2f}' for x in ratios)})  (goal >= 1.0; {args.steps} steps, "
          f"micro-batch {args.micro_batch_size}, {args.threads} thread(s), one process each; "
          f"load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
