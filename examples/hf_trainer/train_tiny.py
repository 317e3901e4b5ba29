"""A Hugging Face Trainer script of the usual shape (HfArgumentParser + Trainer), on a tiny randomly initialised
GPT-2 and a generated data set, so it runs anywhere on CPU: the stand-in for run_clm.py in mnft's tests and
examples/jobs/hf_trainer.yaml. Every standard TrainingArguments option works (--output_dir, --max_steps,
--save_steps, --resume_from_checkpoint, …).

    torchrun --nproc-per-node 2 examples/hf_trainer/train_tiny.py --output_dir out --max_steps 40 --use_cpu
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments


@dataclass
class DataArguments:
    samples: int = field(default=512, metadata={"help": "generated training sequences"})
    seq_len: int = field(default=32, metadata={"help": "tokens per sequence"})
    step_sleep: float = field(default=0.0, metadata={"help": "seconds to wait after each step (tests: a window to stop the run in)"})


class Sequences(torch.utils.data.Dataset):
    """Learnable token sequences: each continues an arithmetic progression modulo the vocabulary."""

    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, vocab, (samples, 1), generator=g)
        steps = torch.randint(1, 4, (samples, 1), generator=g)
        self.ids = (starts + steps * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Sleep(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main() -> None:
    training, data = HfArgumentParser((TrainingArguments, DataArguments)).parse_args_into_dataclasses()
    torch.manual_seed(training.seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    callbacks = [Sleep(data.step_sleep)] if data.step_sleep else []
    trainer = Trainer(model=model, args=training, train_dataset=Sequences(data.samples, data.seq_len, config.vocab_size), callbacks=callbacks)
    print(f"rank {os.environ.get('RANK', '0')}: resume_from_checkpoint={training.resume_from_checkpoint}", flush=True)
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    trainer.save_state()
    if torch.distributed.is_initialized():
        # Everything is saved. Leave now, not through Python's teardown: with gloo, freeing the process group that
        # DDP's reducer still holds can deadlock (the group joins its worker thread holding the GIL while that
        # thread frees a finished collective's tensors, which needs the GIL: seen on the test bed, torch 2.13) or
        # abort the interpreter ("terminate called without an active exception").
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
