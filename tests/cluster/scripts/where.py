"""Every rank says which node it runs on and what it sees of /dev/shm, then all-reduces its rank."""

import os
import socket

import torch
import torch.distributed as dist

rank = dist.get_rank()
marker = f"/dev/shm/zrc-test-rank{rank}"
open(marker, "w").close()
dist.barrier()
seen = sorted(name for name in os.listdir("/dev/shm") if name.startswith("zrc-test-rank"))
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} host {socket.gethostname()} shm {','.join(seen)} sum {int(total.item())}", flush=True)
dist.barrier()
os.unlink(marker)
