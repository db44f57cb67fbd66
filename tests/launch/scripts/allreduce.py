"""Every rank all-reduces its rank number and prints the sum; exits 0."""

import os
import sys

import torch
import torch.distributed as dist

rank = dist.get_rank()
total = torch.tensor([float(rank)])
dist.all_reduce(total)
print(f"rank {rank} of {dist.get_world_size()} sum {int(total.item())} args {sys.argv[1:]}", flush=True)
print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
os.write(1, f"rank {rank} raw fd write\n".encode())
