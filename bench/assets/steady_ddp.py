"""A user's hand-written DDP loop for bench/launch.py --steady: rank 0 prints each step's wall-clock time.

    torchrun … steady_ddp.py --steps 60
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--width", type=int, default=512)
args = parser.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, args.width)
for step in range(1, args.steps + 1):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if dist.get_rank() == 0:
        print(json.dumps({"step": step, "loss": loss.item(), "t": time.time()}), flush=True)
dist.destroy_process_group()
