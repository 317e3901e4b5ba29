"""The baseline of bench/gpu.py: the same model and data as mnft's recipe, trained by Hugging Face's Trainer (+ PEFT
for LoRA) the way a lab's script would, for the same steps, micro-batch, sequence length and precision; prints one
JSON line with its tokens/s (tokens that carry loss, counted as the recipes count them, after the first steps) and
peak GPU memory.

    python bench/assets/hf_baseline.py --recipe lora --model-dir DIR --steps 30 --micro-batch 8 --seq 64 --bf16 --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # mnft's recipes: the same data and model loading

from mnft.recipes import data, model  # noqa: E402

WARMUP = 3  # steps left out of tokens/s (allocator, kernels' first launch)


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]


class Clock(transformers.TrainerCallback):
    """Tokens and seconds of the steps after the warm-up."""

    def __init__(self) -> None:
        self.tokens, self.started, self.seconds, self.step_tokens = 0, None, 0.0, []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == WARMUP:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.started is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", choices=("lora", "full"), required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if args.bf16 and args.recipe == "lora" else torch.float32  # as the recipes store the base
    base, tokenizer = model.load(Path(args.model_dir), dtype)
    if args.recipe == "lora":
        import peft

        lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
        base = peft.get_peft_model(base, lora)
    rows = data.build(tokenizer, None, args.seq, False)
    counted = []

    def collate(batch):
        out = data.collate(batch, tokenizer.pad_token_id)
        counted.append(data.trained_tokens(out))
        return out

    clock = Clock()
    targs = transformers.TrainingArguments(
        output_dir=str(Path(args.out).parent / f"hf-{args.recipe}"), max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        learning_rate=args.lr, bf16=args.bf16 and cuda, use_cpu=not cuda, logging_steps=10, save_strategy="no", report_to=[],
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True, seed=0,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = transformers.Trainer(model=base, args=targs, train_dataset=Rows(rows), data_collator=collate, callbacks=[clock])
    trainer.train()
    tokens = sum(counted[WARMUP:args.steps])
    result = {"recipe": args.recipe, "steps": args.steps, "tokens_per_s": tokens / clock.seconds if clock.seconds else None,
              "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None, "device": "cuda" if cuda else "cpu"}
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
