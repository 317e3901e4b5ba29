"""Where each rank's step time goes: cheap wall-clock timers (no profiler), one JSON line per step and rank.

Every rank writes ``<output_dir>/timings-rank<R>.jsonl`` (R = global rank; on its own host, next to where rank 0
writes metrics.jsonl): first a ``{"event": "start", …}`` line (host, ranks, device, intra-op threads, CPUs), then
per step::

    {"step": 12, "rank": 3, "node_rank": 1, "local_rank": 1, "step_s": 0.41, "data_s": 0.002, "compute_s": 0.33,
     "comm_s": 0.078, "ckpt_s": 0.0, "time": 1700000000.0}

- ``data_s``: drawing the step's micro-batches;
- ``comm_s``: time this rank was blocked in collectives: the step's explicit all-reduces (token count, loss and the
  non-finite flag) and, with DDP (lora), the gradient all-reduce left to wait for after the local backward (from the
  last gradient bucket's launch to the end of backward). A fast rank waits here for a slow one: its comm_s grows,
  the straggler's does not. FSDP2's own all-gathers and reduce-scatters (full) are not separated: they count as
  compute_s;
- ``compute_s``: the rest of the step (forward, backward, clipping, optimizer, moving batches to the device);
- ``step_s`` = data_s + compute_s + comm_s; ``ckpt_s``: the checkpoint written after this step (0 when none);
- ``time``: wall clock (epoch seconds) when the line was written.
Rank 0's metrics.jsonl step lines carry its own data_s, compute_s and comm_s too.

These are host-side wall clocks. On CPU (gloo) collectives block the host, so the split is exact. On GPU (NCCL) the
host runs ahead of the device: the gradient all-reduce's wait shows where the host next synchronises (the grad-norm
``.item()`` right after backward), i.e. in compute_s; the explicit all-reduces of Python numbers still block and
count as comm_s. Separating NCCL time on GPU needs CUDA events on the communication stream (not done here).
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import torch


class StepTimer:
    def __init__(self, output_dir: Path, rank: int, node_rank: int, local_rank: int, resumed: bool):
        self.rank, self.node_rank, self.local_rank = rank, node_rank, local_rank
        self.path = Path(output_dir) / f"timings-rank{rank}.jsonl"
        self.file = open(self.path, "a" if resumed else "w")
        self._start = 0.0
        self.data_s = self.comm_s = 0.0
        self._bucket_launch: float | None = None

    def event(self, name: str, **fields) -> None:
        self._write({"event": name, "rank": self.rank, "node_rank": self.node_rank, "local_rank": self.local_rank,
                     **fields, "time": time.time()})

    def start_info(self, world_size: int, device: torch.device) -> None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count()
        self.event("start", host=socket.gethostname(), world_size=world_size, device=str(device),
                   threads=torch.get_num_threads(), cpus=cpus, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))

    def begin(self) -> None:
        self._start = time.perf_counter()
        self.data_s = self.comm_s = 0.0

    @contextmanager
    def _adding_to(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - t)

    def data(self):
        """Around drawing the step's batches."""
        return self._adding_to("data_s")

    def comm(self):
        """Around a blocking collective."""
        return self._adding_to("comm_s")

    # DDP: the gradient all-reduce runs under backward; what is left to wait for after the last bucket left is comm
    def ddp_hook(self):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(process_group, bucket):
            self._bucket_launch = time.perf_counter()
            return allreduce_hook(process_group, bucket)

        return hook

    @contextmanager
    def synced_backward(self):
        """Around the backward that all-reduces gradients (DDP): the wait after the last bucket counts as comm."""
        self._bucket_launch = None
        t = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if self._bucket_launch is not None:
                self.comm_s += end - max(self._bucket_launch, t)

    def end(self) -> dict:
        """The step's figures (before any checkpoint)."""
        step_s = time.perf_counter() - self._start
        return {"step_s": round(step_s, 6), "data_s": round(self.data_s, 6), "comm_s": round(self.comm_s, 6),
                "compute_s": round(max(0.0, step_s - self.data_s - self.comm_s), 6)}

    def write(self, step: int, figures: dict, ckpt_s: float = 0.0) -> None:
        self._write({"step": step, "rank": self.rank, "node_rank": self.node_rank, "local_rank": self.local_rank,
                     **figures, "ckpt_s": round(ckpt_s, 6), "time": time.time()})

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
