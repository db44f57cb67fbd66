"""A few ZeRO steps of a tiny MLP; every rank prints its last loss and a checksum of the parameters.

Each global rank draws its own batches from a seed that depends only on (seed, rank, step), so the
same world size gives the same numbers however the ranks are spread over nodes.
"""

import os

import torch
import torch.distributed as dist

import zerorun
from zerorun.telemetry import probe


class TinyRegression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


recipe = zerorun.recipe()
torch.manual_seed(recipe.train.seed)
model = TinyRegression()
engine = zerorun.initialize(model)
rank = dist.get_rank()
for step in range(recipe.train.steps):
    data = torch.Generator().manual_seed(recipe.train.seed * 100_003 + rank * 1009 + step)
    x = torch.randn(4, 8, generator=data)
    loss = engine(x, x.sum(dim=1, keepdim=True).sin())
    engine.backward(loss)
    engine.step()
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"rank {rank} of {dist.get_world_size()} final loss {loss.item():.9e} checksum {checksum:.12e}", flush=True)
# Leave at once: a multi-rank CPU run of the engine sometimes aborts at interpreter exit ("terminate
# called without an active exception"), a runtime problem that these launch tests are not about.
dist.barrier()
probe.stop()  # os._exit skips the worker's own stop: send the last steps' telemetry first (tests read it)
os._exit(0)
