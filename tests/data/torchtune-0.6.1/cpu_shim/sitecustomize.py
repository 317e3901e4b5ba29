"""CPU shim for torchtune 0.6.1's distributed recipes (put this directory on PYTHONPATH; make.py does).

0.6.1's full_finetune_distributed.py:627-629 and lora_finetune_distributed.py:543-545 log memory stats after model
init on rank 0 unconditionally, and torchtune/training/memory.py:263-264 raises
"ValueError: Logging memory stats is not supported on CPU devices" for a CPU device, so neither recipe starts on CPU.
Then torchtune/training/memory.py:51 (cleanup_before_training, the first line of train()) calls
get_torch_device_namespace().empty_cache() and (line 52) .reset_peak_memory_stats(), which for CPU is torch.cpu,
and torch.cpu has neither ("AttributeError: module 'torch.cpu' has no attribute 'empty_cache'").
And lora_finetune_distributed.py:918 calls init_process_group("cuda:nccl,cpu:gloo"), which a torch built without
NCCL refuses ("RuntimeError: Distributed package doesn't have NCCL built in").
This makes get_memory_stats return zeros for a CPU device, gives torch.cpu those two as no-ops, and makes
init_process_group drop the "cuda:nccl" part of a backend string when NCCL is not built in; nothing else is
touched (the recipes, checkpointers, metric loggers and `tune run` are the release's own code).
"""

import torch
import torch.distributed
import torchtune.training
import torchtune.training.memory

_real_get_memory_stats = torchtune.training.memory.get_memory_stats


def _get_memory_stats(device, reset_stats=True):
    if device.type == "cpu":
        return {"peak_memory_active": 0.0, "peak_memory_alloc": 0.0, "peak_memory_reserved": 0.0}
    return _real_get_memory_stats(device, reset_stats=reset_stats)


torchtune.training.memory.get_memory_stats = _get_memory_stats
torchtune.training.get_memory_stats = _get_memory_stats

for _name in ("empty_cache", "reset_peak_memory_stats"):
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda *args, **kwargs: None)

_real_init_process_group = torch.distributed.init_process_group


def _init_process_group(backend=None, *args, **kwargs):
    if isinstance(backend, str) and "nccl" in backend and not torch.distributed.is_nccl_available():
        backend = ",".join(part for part in backend.split(",") if "nccl" not in part) or "gloo"
    return _real_init_process_group(backend, *args, **kwargs)


torch.distributed.init_process_group = _init_process_group
