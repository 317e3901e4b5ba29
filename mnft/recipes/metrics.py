"""Rank-0 metrics: ``metrics.jsonl`` (one flushed JSON object per line), TensorBoard when installed, and a
readable progress line on stdout; plus the final summary line."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import torch


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no NaN/Infinity: write "nan"/"inf"


class Metrics:
    """Writes only on the main rank; every other rank gets a no-op logger."""

    def __init__(self, output_dir: Path, enabled: bool, max_steps: int, tensorboard: bool, resumed: bool):
        self.enabled, self.max_steps = enabled, max_steps
        self.file = self.tb = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(output_dir / "metrics.jsonl", "a" if resumed else "w")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self.tb = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def event(self, name: str, **fields) -> None:
        self.write({"event": name, **fields, "time": time.time()})

    def step(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float, trained_tokens: int,
             skipped_steps: int, peak_memory_mb: float, show: bool = True, **extra) -> None:
        """One JSONL line (and TensorBoard scalars) for every step; the progress line only when ``show``."""
        if not self.enabled:
            return
        record = {"step": step, "loss": _num(loss), "lr": lr, "grad_norm": _num(grad_norm),
                  "tokens_per_s": tokens_per_s, "trained_tokens": trained_tokens, "skipped_steps": skipped_steps,
                  "peak_memory_mb": round(peak_memory_mb, 1), **extra, "time": time.time()}
        self.write(record)
        if self.tb:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mb"):
                if isinstance(record[key], float) and math.isfinite(record[key]):
                    self.tb.add_scalar(f"train/{key}", record[key], step)
        if not show:
            return
        flag = "  SKIPPED (non-finite)" if extra.get("skipped") else ""
        print(f"step {step:>5}/{self.max_steps}  loss {loss:8.4f}  lr {lr:.2e}  grad_norm {grad_norm:7.3f}  "
              f"tok/s {tokens_per_s:8.0f}  tokens {trained_tokens:>6}  mem {peak_memory_mb:7.0f}MB  "
              f"skipped {skipped_steps}{flag}", flush=True)

    def summary(self, initial_loss: float | None, final_loss: float | None, tokens_per_s: float, steps: int,
                skipped_steps: int, wall_s: float) -> None:
        if not self.enabled:
            return
        self.event("summary", initial_loss=initial_loss, final_loss=final_loss, tokens_per_s=tokens_per_s,
                   steps=steps, skipped_steps=skipped_steps, wall_s=wall_s)
        ratio = f" ({final_loss / initial_loss:.1%} of initial)" if initial_loss and final_loss is not None else ""
        fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
        print(f"summary: steps {steps}  initial loss {fmt(initial_loss)}  final loss {fmt(final_loss)}{ratio}  "
              f"tok/s {tokens_per_s:.0f}  skipped {skipped_steps}  wall {wall_s:.1f}s", flush=True)

    def close(self) -> None:
        if self.tb:
            self.tb.close()
        if self.file:
            self.file.close()
