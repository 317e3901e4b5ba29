"""torchrun entry point of the perf check: compute per rank, then all_reduce over message sizes.

    torchrun --nnodes N --nproc-per-node G ... allreduce.py --sizes 1048576,2097152,... [--budget 3] [--compute 0.3]

Uses only torch and the standard library (the controller ships this file; the hosts' mnft code may not be synced
yet). NCCL and the GPU of LOCAL_RANK when CUDA is available, gloo and the CPU otherwise — what the recipes use.

1. Compute: a square matmul (fp32 on CPU, bf16 on GPU) repeated for `--compute` seconds in 3 passes, the best
   pass counts; TFLOP/s = 2·n³·iters/t. GPUs measure all at once. CPU ranks take turns (one rank at a time, the
   others wait in a barrier; all turns together within `--compute-budget`), because hosts may share cores (VMs on
   one hypervisor, the simulated cluster) and would otherwise measure each other.
2. all_reduce (sum, float32) per size: one warm-up, then as many iterations as fit the size's share of
   `--budget` (1..20, the same on every rank); the sweep stops before a size whose warm-up and one call
   (about twice the last size's each) would overrun the budget (with `--limit L`: L seconds, each size getting
   one timed call at least, so that every size is measured unless the network is slow). Per size: time (the
   average over ranks of each rank's mean time per call, as nccl-tests reports by default), algbw = bytes / time,
   busbw = algbw × 2(n-1)/n — nccl-tests' definitions, in GB/s (1e9 bytes/s).
3. Rank 0 prints one line: "MNFT-PERF " + JSON {world_size, backend, ranks: [...], allreduce: [...]}; each rank's
   record has its `phases` in seconds (import_s: Python's start to torch imported; held_s: waiting to be released;
   rendezvous_s: process group up and every rank joined; compute_s; allreduce_s).

`--hold FILE` (mnft.onhost.torchlaunch passes it): after importing torch, print "MNFT-READY <rank>" and wait until
FILE exists before joining the process group. The controller may start the ranks while it measures the link matrix
(torch's import is most of a rank's start-up); it releases them when the links are done and every rank is ready.

When the figures are out the rank leaves with os._exit: an interpreter that imported torch takes about half a
second of CPU to tear itself down, which on a host running several ranks is time nobody waits for.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before torch: the phases below include its import

import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

MARKER = "MNFT-PERF "
READY = "MNFT-READY "
MAX_ITERS = 20
PASSES = 3


def _best(old: dict | None, new: dict) -> dict:
    return new if old is None or new["tflops"] > old["tflops"] else old


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, seconds: float, n: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up (allocator, kernels, thread pool)
    _sync(device)
    iters, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        iters += 1
        if iters % 4 == 0 or device.type != "cuda":
            _sync(device)
            if time.perf_counter() - start >= seconds:
                break
    elapsed = time.perf_counter() - start
    return {"tflops": round(2 * n**3 * iters / elapsed / 1e12, 5), "n": n, "dtype": str(dtype).replace("torch.", ""),
            "iters": iters, "seconds": round(elapsed, 4)}


def cpu_facts() -> dict:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    return {"threads": torch.get_num_threads(), "cpus": cpus, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def collective_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def sweep(sizes: list[int], budget: float, device: torch.device, world: int, limit: float | None = None) -> list[dict]:
    """Per size: warm-up, then iterations within its share of `budget`; stops before a size that would overrun
    the budget, or with `limit` that many seconds (each size gets one timed call at least: every size is
    measured unless a slow network makes the sweep take longer than `limit`)."""
    results = []
    spent, last_warm = 0.0, 0.0
    share = budget / max(1, len(sizes))
    stop = max(budget, limit or 0.0)
    for size in sizes:
        spent_all = collective_max(spent, device)  # decisions use collective values: every rank agrees
        # a size doubles the last one's time: its warm-up and one iteration must fit what is left
        if spent_all >= stop or (results and spent_all + 4 * last_warm > stop):
            break
        begin = time.perf_counter()
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        warm = last_warm = collective_max(time.perf_counter() - start, device)
        iters = max(1, min(MAX_ITERS, int(share / max(warm, 1e-6)), int((budget - spent_all) / max(warm, 1e-6))))
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        _sync(device)
        mine = (time.perf_counter() - start) / iters
        t = torch.tensor([mine], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        seconds = float(t.item()) / world
        algbw = size / seconds / 1e9
        results.append({"bytes": size, "iters": iters, "time_us": round(seconds * 1e6, 1), "algbw_gbps": round(algbw, 4),
                        "busbw_gbps": round(algbw * 2 * (world - 1) / world, 4)})
        del x
        spent += time.perf_counter() - begin
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mnft.perf.allreduce")
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds for the whole all_reduce sweep")
    parser.add_argument("--limit", type=float, default=None,
                        help="measure every size even past the budget, within this many seconds")
    parser.add_argument("--compute", type=float, default=0.3, help="seconds of matmul per rank")
    parser.add_argument("--compute-budget", type=float, default=1.5,
                        help="CPU ranks take turns: at most this many seconds for all turns together")
    parser.add_argument("--init-timeout", type=float, default=120, help="seconds to wait for every rank to join")
    parser.add_argument("--matmul", type=int, default=0, help="matrix size (default: 4096 on GPU, 512 on CPU)")
    parser.add_argument("--hold", metavar="FILE", help="when ready, print MNFT-READY and wait for FILE to exist")
    args = parser.parse_args(argv)
    phases = {"import_s": round(time.perf_counter() - STARTED, 3)}
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.hold:
        mark = time.perf_counter()
        if not hold(args.hold, rank, args.init_timeout):
            sys.stderr.write("rank %d: not released within %gs (--init-timeout)\n" % (rank, args.init_timeout))
            return 3
        phases["held_s"] = round(time.perf_counter() - mark, 3)
    mark = time.perf_counter()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=args.init_timeout)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
        name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        name = "cpu"
    try:
        dist.barrier()
        phases["rendezvous_s"] = round(time.perf_counter() - mark, 3)  # every rank joined: the others' start-up too
        mark = time.perf_counter()
        n = args.matmul or (4096 if device.type == "cuda" else 512)
        compute = None
        # best of PASSES short runs: a burst of someone else's work costs one pass, a steady load shows in all
        seconds = args.compute if device.type == "cuda" else min(args.compute, args.compute_budget / world)
        for _ in range(PASSES):
            if device.type == "cuda":
                compute = _best(compute, matmul_tflops(device, seconds / PASSES, n))
            else:
                for turn in range(world):
                    if turn == rank:
                        compute = _best(compute, matmul_tflops(device, seconds / PASSES, n))
                    dist.barrier()
        phases["compute_s"] = round(time.perf_counter() - mark, 3)
        me = {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(), "node_rank": int(os.environ.get("GROUP_RANK", 0)),
              "device": str(device), "device_name": name, "compute": compute, **cpu_facts(),
              "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", 1))}
        mark = time.perf_counter()
        results = sweep(sizes, args.budget, device, world, args.limit)
        phases["allreduce_s"] = round(time.perf_counter() - mark, 3)
        me["phases"] = phases
        everyone = [None] * world
        dist.all_gather_object(everyone, me)
        if rank == 0:
            out = {"world_size": world, "backend": dist.get_backend(), "ranks": everyone, "allreduce": results}
            sys.stdout.write(MARKER + json.dumps(out) + "\n")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


def hold(path: str, rank: int, timeout: float) -> bool:
    """Say this rank is ready; wait until `path` exists (True) or `timeout` seconds pass (False)."""
    sys.stdout.write("%s%d\n" % (READY, rank))
    sys.stdout.flush()
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def leave(code: int) -> None:
    """Exit now: flush what was printed, skip the interpreter's teardown (torch makes it slow). torchlaunch.py has
    the same function: each file is shipped to the hosts on its own."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    leave(main())
