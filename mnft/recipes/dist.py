"""Process group from the torchrun environment: NCCL + cuda:LOCAL_RANK with CUDA, gloo + CPU otherwise.

Without torchrun variables (``python -m mnft.recipes.lora``) the run is a world of one on a free local port,
so every code path (collectives included) is the same as under torchrun.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup() -> Dist:
    if "RANK" not in os.environ:  # plain `python -m`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", rank // max(local_world, 1))))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    d = Dist(rank, world, local_rank, local_world, node_rank, device)
    print(f"rank={rank}/{world} node_rank={node_rank} local_rank={local_rank} device={device} "
          f"backend={dist.get_backend()}", flush=True)
    return d


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    """All-reduce a few Python numbers in one float64 collective (no collective in a world of one)."""
    if dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()
