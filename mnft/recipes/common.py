"""Small pieces both recipes use: the entry-point wrapper, output dir, LR schedule, token-summed loss."""

from __future__ import annotations

import math
import os
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mnft.core.errors import MnftError
from mnft.recipes import dist as mdist
from mnft.recipes.config import ConfigError, TrainConfig, load_config
from mnft.recipes.data import IGNORE

# emitted by transformers' own DDP/PEFT plumbing on every rank, not actionable by users of the recipe
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated")


def run(recipe: str, train: Callable[[TrainConfig, mdist.Dist], None], argv: list[str] | None = None) -> int:
    """Parse the config, set up the process group, train, clean up. Expected errors are one line."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(recipe, argv)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # one line for the whole job, not one per rank
            _error_line(e)
        return int(e.exit_code)
    d = mdist.setup()
    try:
        train(cfg, d)
    except ConfigError as e:  # decided collectively (e.g. an output_dir with an earlier run's checkpoints)
        if d.rank == 0:
            _error_line(e)
        return int(e.exit_code)
    except MnftError as e:  # may be one rank's own (non-finite steps, a world size the checkpoint refuses)
        _error_line(e)
        return int(e.exit_code)
    finally:
        sys.stdout.flush()
        mdist.cleanup()
    return 0


def _error_line(e: Exception) -> None:
    """One write, so the lines of ranks sharing a stderr pipe never run together (print writes the newline apart)."""
    sys.stderr.write(f"mnft.recipes: {e}\n")
    sys.stderr.flush()


def output_dir(cfg: TrainConfig, recipe: str, d: mdist.Dist) -> Path:
    """``output_dir`` with ``{recipe}``, ``{rank}``, ``{node_rank}`` filled in (per-rank dirs emulate nodes that
    share no filesystem)."""
    try:
        path = cfg.output_dir.format(recipe=recipe, rank=d.rank, node_rank=d.node_rank, local_rank=d.local_rank)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"config key 'output_dir': bad placeholder in {cfg.output_dir!r} ({e})") from None
    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    return out


class SaveRequest:
    """A request to save a checkpoint at the end of the current step and stop there: the signal named by
    MNFT_SAVE_SIGNAL (USR2 …), which mnft's Slurm runs set (Slurm's warning before the time limit reaches every
    process of the job). Without the variable nothing is installed."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self.requested = False
        self.name = (os.environ if environ is None else environ).get("MNFT_SAVE_SIGNAL") or None
        number = getattr(signal, f"SIG{self.name}", None) if self.name else None
        if isinstance(number, signal.Signals):
            signal.signal(number, self._set)

    def _set(self, *_: object) -> None:
        self.requested = True


class CosineWithWarmup:
    """LR multiplier: linear warmup to 1, then cosine down to ``min_ratio`` at ``total`` steps."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over trained tokens, in fp32. All-masked -> exactly 0."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:].to(logits.device)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def autocast(d: mdist.Dist, mixed_precision: str):
    """bf16 autocast on GPU (``auto``) or when asked; fp32 otherwise."""
    bf16 = mixed_precision == "bf16" or (mixed_precision == "auto" and d.device.type == "cuda")
    return torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=bf16)


def poison_grad(params: list[torch.nn.Parameter]) -> None:
    """Fault injection (``debug_inf_grad_steps``): one gradient element of this rank becomes inf."""
    for p in params:
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
        if grad is not None and grad.numel():
            grad.view(-1)[0] = float("inf")
            return


@torch.no_grad()
def rank_checksums(params: list[torch.nn.Parameter]) -> list[float]:
    """Every rank's fingerprint of its own parameters (FSDP2: its shards), gathered on all ranks (collective).

    Test aid (``debug_rank_checksums``): a skipped step must leave every rank's value unchanged."""
    total = 0.0
    for i, p in enumerate(params):
        x = (p.to_local() if hasattr(p, "to_local") else p).detach().double()
        total += (i + 1) * (x.sum().item() + 0.5 * x.abs().sum().item())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def sample_ids(micro: list[dict]) -> list[list[int]]:
    """Every rank's dataset row ids of this step's micro-batches, in order, gathered on all ranks (collective).

    Test aid (``debug_sample_ids``): shows which rows each rank trained on, e.g. across a resume on another
    world size."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [i for b in micro for i in b["rows"]])
    return everyone


def crash_now(step: int) -> None:
    """Fault injection (``debug_crash_after_step``): die like a killed process, no cleanup."""
    print(f"mnft.recipes: debug_crash_after_step={step}: exiting hard", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(17)


def stop_after_save(step: int, is_main: bool, log, timer, signal_name: str) -> None:
    """Every rank saved this step on the save signal (Slurm's warning before its time limit): say so, close the
    metrics and timings, and leave together (the caller returns; a resume continues from this step)."""
    if is_main:
        print(f"saved step-{step} on {signal_name}: stopping (resume continues from it)", flush=True)
        log.event("stopped", step=step, signal=signal_name)
    log.close()
    timer.close()
    dist.barrier()
