"""The optimizers users bring, and the reference every one of them must match: DDP with the same optimizer.

Each entry of `OPTIMIZERS` builds, for a model (tests/runtime/reference.py's OddNet: odd sizes, a tied
embedding/head, a frozen parameter), what a script would hand to `zerorun.initialize`: one optimizer
(two param groups where the optimizer allows) or a list of them (Muon + AdamW). `ddp_run` trains the
model under torch's DDP with those optimizers; `engine_run` through zerorun's engine; both see the same
batches, so their losses and parameters must agree within the issue's tolerances (`TOLERANCE`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from tests.runtime.reference import Run, batch, engine_master_params, make_model

Factory = Callable[[nn.Module], list[torch.optim.Optimizer]]
STAGE3 = ["zero.wrap=[Linear]", "zero.param_persistence_threshold=20"]  # every kind of stage 3 unit


def _groups(model: nn.Module, **decay: Any) -> list[dict[str, Any]]:
    """Two param groups, as scripts make them: weights decayed, biases and norms not."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if p.ndim >= 2], **decay},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}]


class SignMomentum(torch.optim.Optimizer):
    """A script's own optimizer: sign of a momentum (declared elementwise in `_declared`)."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"].sign(), alpha=-group["lr"])


def _declared(model: nn.Module) -> list[torch.optim.Optimizer]:
    import zerorun

    class Declared(zerorun.Elementwise, SignMomentum):
        pass
    return [Declared(_groups(model), lr=3e-3)]


class PlainSubclass(torch.optim.SGD):
    """A subclass zerorun does not know: it takes the owner way."""


def _muon(model: nn.Module) -> list[torch.optim.Optimizer]:
    from zerorun.runtime.optim.recipe_optimizers import muon_takes

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if muon_takes(n, p)]
    rest = [p for n, p in named if not muon_takes(n, p)]
    return [torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.01), torch.optim.AdamW(rest, lr=3e-3)]


def _lion(model: nn.Module) -> list[torch.optim.Optimizer]:
    import pytest

    lion_pytorch = pytest.importorskip("lion_pytorch")
    return [lion_pytorch.Lion(_groups(model, weight_decay=0.1), lr=1e-3)]


OPTIMIZERS: dict[str, Factory] = {
    "sgd-nesterov": lambda m: [torch.optim.SGD(_groups(m, weight_decay=0.01), lr=0.05, momentum=0.9, nesterov=True)],
    "adamw-amsgrad": lambda m: [torch.optim.AdamW(_groups(m, weight_decay=0.1), lr=3e-3, amsgrad=True)],
    "adam-maximize": lambda m: [torch.optim.Adam(_groups(m), lr=1e-3, maximize=True)],
    "adagrad": lambda m: [torch.optim.Adagrad(_groups(m), lr=3e-2, initial_accumulator_value=0.1)],
    "rmsprop": lambda m: [torch.optim.RMSprop(_groups(m), lr=1e-3, momentum=0.9, centered=True)],
    "adamax": lambda m: [torch.optim.Adamax(_groups(m), lr=3e-3)],
    "nadam": lambda m: [torch.optim.NAdam(_groups(m, weight_decay=0.1), lr=3e-3, decoupled_weight_decay=True)],
    "radam": lambda m: [torch.optim.RAdam(_groups(m), lr=3e-3)],
    "adafactor": lambda m: [torch.optim.Adafactor(_groups(m), lr=1e-2)],
    "muon+adamw": _muon,
    "lion": _lion,
    "declared": _declared,
    "subclass": lambda m: [PlainSubclass(_groups(m), lr=0.05, momentum=0.9)],
    "lamb": lambda m: [__import__("zerorun").Lamb(_groups(m, weight_decay=0.01), lr=3e-3)],
    "adamw": lambda m: [torch.optim.AdamW(_groups(m, weight_decay=0.1), lr=3e-3)],
}
ROUNDS_DIFFERENTLY = {"muon+adamw", "adafactor"}  # matrix steps round differently (Muon: Newton-Schulz in bf16)


def tolerance(name: str) -> tuple[float, float]:
    """(relative loss gap, absolute parameter gap) the issue allows for optimizer `name` in fp32."""
    return (1e-4 if name in ROUNDS_DIFFERENTLY else 1e-5), 3e-4


def sum_then_divide(state: object, bucket):  # DDP checks a return annotation as an object, not a string
    """A DDP comm hook that sums the ranks' gradients, then divides by the world size (DDP's own divides each rank's
    first): the order zerorun's reduction sums in, so the two runs round alike on 3 ranks."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    buffer.div_(dist.get_world_size())
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def ddp_run(rank: int, factory: Factory, steps: int, accum: int, seed: int = 0,
            dtype: torch.dtype = torch.float32, hook: Any = None, device: str = "cpu") -> Run:
    """DDP with the optimizers `factory` makes (fp32; `hook`: a DDP comm hook), the model and batches on `device`; a
    low-precision `dtype` follows zerorun's policy, which DDP cannot express: compute in `dtype`, fp32 gradients
    all-reduced and averaged, fp32 master weights stepped."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    master = make_model(seed).to(device)
    opts = factory(master)
    compute = master if dtype == torch.float32 else _copy(master, dtype)
    model = DDP(compute) if dtype == torch.float32 else compute
    if hook is not None:
        model.register_comm_hook(None, hook)
    trainable = [(m, c) for m, c in zip(master.parameters(), compute.parameters()) if m.requires_grad]
    run, micro = Run(), 0
    for _ in range(steps):
        for a in range(accum):
            loss = model(batch(seed, rank, micro).to(device))
            (loss / accum).backward()
            run.losses.append(loss.item())
            micro += 1
            if dtype != torch.float32:  # micro-batches' gradients accumulate in fp32, as zerorun's do
                for m, c in trainable:
                    m.grad = c.grad.float() if m.grad is None else m.grad + c.grad.float()
                    c.grad = None
        if dtype != torch.float32:
            for m, _ in trainable:
                dist.all_reduce(m.grad)
                m.grad /= dist.get_world_size()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if dtype != torch.float32:
            with torch.no_grad():
                for m, c in trainable:
                    c.copy_(m)
    run.params = {n: p.detach().float().cpu() for n, p in master.named_parameters()}
    return run


def _copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(dtype)


def engine_run(rank: int, factory: Factory, steps: int, accum: int, overrides: list[str], seed: int = 0) -> Run:
    """The same training through zerorun's engine with the optimizers `factory` makes."""
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [f"train.grad_accum_steps={accum}", "zero.bucket_mb=0.0005",
                                                        "zero.allgather_bucket_mb=0.0005", "checkpoint.resume=never",
                                                        *overrides])
    model = make_model(seed)
    opts = factory(model)
    engine = zerorun.initialize(model, opts if len(opts) > 1 else opts[0], recipe)
    run, micro = Run(), 0
    for _ in range(steps * accum):
        loss = engine(batch(seed, rank, micro))
        engine.backward(loss)
        engine.step()
        run.losses.append(loss.item())
        micro += 1
    run.params = engine_master_params(engine)  # the fp32 master at every stage and precision
    engine.destroy()
    return run


def gaps(run: Run, ref: Run) -> tuple[float, float]:
    """(largest relative loss gap, largest absolute parameter gap) between two runs."""
    losses, ref_losses = torch.tensor(run.losses), torch.tensor(ref.losses)
    loss_gap = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
    param_gap = max((value.cpu() - ref.params[n].cpu()).abs().max().item() for n, value in run.params.items())
    return loss_gap, param_gap


def compare(rank: int, world: int, cases: list[tuple[str, int, tuple[str, ...]]], steps: int, accum: int,
            device: str = "cpu") -> list[str]:
    """Run each (optimizer, stage, extra overrides) case through the engine and DDP with the same optimizers (summing
    as zerorun does) on `device`; the cases over the bounds, in words."""
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    refs, problems = {}, []
    for name, stage, extra in cases:
        if name not in refs:
            refs[name] = ddp_run(rank, OPTIMIZERS[name], steps, accum, hook=sum_then_divide, device=device)
        run = engine_run(rank, OPTIMIZERS[name], steps, accum, [f"zero.stage={stage}",
                                                               *(STAGE3 if stage == 3 else []), *extra])
        loss_gap, param_gap = gaps(run, refs[name])
        loss_bound, param_bound = tolerance(name)
        if loss_gap > loss_bound or param_gap > param_bound:
            problems.append(f"{name} stage {stage} {' '.join(extra)} world {world} rank {rank}: losses "
                            f"{loss_gap:.2e} apart (bound {loss_bound:g}), parameters {param_gap:.2e} (bound "
                            f"{param_bound:g})")
    return problems
