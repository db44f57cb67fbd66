"""A small awkward model and the DDP + torch.optim.AdamW reference every ZeRO mode must match.

The model has parameters of odd sizes (uneven shards on 2 and 3 ranks), an embedding tied to
the output projection, a frozen parameter, and a buffer. Data differ per rank and per step and
are a pure function of (seed, rank, step), so the engine and the reference see the same batches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.rank_threads import seeded

VOCAB, DIM, HIDDEN, SEQ, BATCH = 37, 13, 29, 9, 3


class OddNet(nn.Module):
    """`plain`: no frozen parameter, no tie, no buffer (the DeepSpeed-style script's model, tests/compat)."""

    def __init__(self, plain: bool = False) -> None:
        super().__init__()
        self.plain = plain
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        if not plain:
            self.frozen = nn.Parameter(torch.randn(DIM), requires_grad=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if not plain:
            self.head.weight = self.embed.weight  # tied
            self.register_buffer("position_scale", torch.linspace(0.5, 1.5, SEQ).unsqueeze(-1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if not self.plain:
            x = x * self.position_scale.to(self.embed.weight.dtype)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        if not self.plain:
            x = x + self.frozen
        logits = self.head(x).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0, plain: bool = False) -> OddNet:
    with seeded(seed):
        return OddNet(plain)


def batch(seed: int, rank: int, micro_step: int, size: int = BATCH) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + micro_step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=gen)


@dataclass
class Run:
    """What a training run produced on one rank."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    param_sums: list[float] = field(default_factory=list)  # before each step: unchanged across a skipped step
    eval_losses: list[float] = field(default_factory=list)


def _eval(model, rank: int, micro: int) -> float:
    """An inference pass between steps: eval mode, no autograd."""
    model.eval()
    with torch.no_grad():
        loss = model(batch(99, rank, micro)).item()
    model.train()
    return loss


OPT = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def tied_gpt(seed: int = 0, checkpoint: str = "none") -> nn.Module:
    """A small GPT with a tied embedding/output matrix and optional activation checkpointing."""
    from zerorun.bench.gpt import GPT, GPTConfig

    with seeded(seed):
        return GPT(GPTConfig(layers=3, d_model=24, heads=2, vocab=VOCAB, seq_len=SEQ - 1, tie_weights=True,
                             checkpoint=checkpoint))


COMPILE_MODES = ("none", "whole", "block")


def inductor_in_turn(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """torch.compile's default backend (inductor, its configuration unchanged), whose graphs the ranks of one
    multi-rank call compile in turn rather than at once.

    Every rank compiles the same graphs at the same moment, so each missed inductor's cache and built every
    kernel itself. In turn, the first rank builds a graph and the others load it from the cache, as ranks do
    once a job's cache is warm. Each graph's build (`compile_fx`'s inner compile, forward and backward alike)
    holds a file lock; no collective runs inside a build, so a rank that waits only waits for a peer's compile.
    (One lock file for every call: the compile tests are one file, run by one pytest worker.)"""
    import fcntl
    import functools
    import os
    import tempfile

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return compile_fx(gm, example_inputs)
    path = os.path.join(tempfile.gettempdir(), "zerorun-tests-inductor.lock")

    @functools.wraps(compile_fx_inner)
    def in_turn(*args: object, **kwargs: object) -> object:
        with open(path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return compile_fx_inner(*args, **kwargs)
    return compile_fx(gm, example_inputs, inner_compile=in_turn)


def compiled(model: nn.Module, mode: str) -> nn.Module:
    """`model` compiled the two ways scripts do: `torch.compile(model)` (whole), or each of its `blocks`
    in place (`block.compile()`, block), by inductor (`inductor_in_turn`)."""
    assert mode in COMPILE_MODES, f"unknown compile mode {mode!r}"
    if mode == "whole":
        return torch.compile(model, backend=inductor_in_turn)
    if mode == "block":
        for block in model.blocks:
            block.compile(backend=inductor_in_turn)
    return model


# Deliberate errors a precision comparison must catch (tests of the tests, test_engine_precision.py)
MISTAKES = ("no-world-division", "no-unscale", "skip-step-5")


def ddp_reference(rank: int, steps: int, accum: int, clip: float | None = None, seed: int = 0,
                  dtype: torch.dtype = torch.float32, loss_scale: float = 1.0, model_fn=make_model,
                  eval_every: int = 0, mistake: str | None = None, device: str = "cpu",
                  fused: bool | None = None, bf16_reduce: bool = False, compile: str = "none") -> Run:
    """DDP + torch AdamW.

    fp32: real DDP. A low-precision `dtype` follows zerorun's policy, which DDP cannot express
    (DDP reduces bf16 gradients in bf16): compute in `dtype`, gradients accumulated and
    all-reduced in fp32 (explicitly), fp32 master weights stepped by torch's fused AdamW (the
    arithmetic zerorun's kernel implements: torch's default for-loop AdamW rounds differently in
    the last fp32 bit, and a compute copy rounded to bf16/fp16 turns such a bit into a whole
    low-precision ulp, see test_engine_precision.py); fp16 scales the loss by the static
    `loss_scale`. `mistake` (one of MISTAKES) makes the reference deliberately wrong. On a CUDA
    `device`, the model and the batches live there (the default AdamW is then torch's foreach one);
    `fused=True` takes torch's fused AdamW in fp32 too. `bf16_reduce` (fp32 only): DDP all-reduces
    each micro-step's gradients in bf16 (`bf16_allreduce_hook`), and they accumulate in fp32.
    `compile` (one of COMPILE_MODES): torch.compile the replicas as a script would (`compiled`).
    """
    import torch.distributed as dist

    assert mistake is None or mistake in MISTAKES, f"unknown mistake {mistake!r}"
    master = model_fn(seed).to(device)
    compute = copy.deepcopy(master).to(dtype)  # the replicas that run forward/backward
    model = DDP(compute) if dtype == torch.float32 else compute
    if compile == "block":  # in place, under DDP
        compiled(compute, compile)
    elif compile == "whole":  # torch.compile(DDP(model)), as torch's DDP docs do
        model = compiled(model, compile)
    if bf16_reduce:
        assert dtype == torch.float32, "bf16_reduce is a DDP comm hook: fp32 models only"
        model.register_comm_hook(None, bf16_allreduce_hook)
    opt = torch.optim.AdamW(master.parameters(), **OPT, fused=True if dtype != torch.float32 else fused)
    run = Run()
    trainable = [(m, c) for m, c in zip(master.parameters(), compute.parameters()) if m.requires_grad]
    micro = 0
    for _ in range(steps):
        for m, _c in trainable:
            m.grad = torch.zeros_like(m)
        for _a in range(accum):
            loss = model(batch(seed, rank, micro).to(device))
            (loss * (loss_scale / accum)).backward()
            for m, c in trainable:
                m.grad += c.grad.float()
                c.grad = None
            run.losses.append(loss.item())
            micro += 1
        if dtype != torch.float32:
            divisor = (1 if mistake == "no-world-division" else dist.get_world_size()) * \
                (1 if mistake == "no-unscale" else loss_scale)
            for m, _c in trainable:
                dist.all_reduce(m.grad)
                m.grad /= divisor
        # without clipping, an infinite max_norm only measures the norm
        run.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), clip or float("inf"))))
        if not (mistake == "skip-step-5" and len(run.grad_norms) == 5):
            opt.step()
        with torch.no_grad():
            for m, c in trainable:
                c.copy_(m)
        if eval_every and len(run.grad_norms) % eval_every == 0:
            run.eval_losses.append(_eval(model, rank, micro))
    # frozen parameters are not stepped: they live in the compute dtype, as in the engine
    run.params = {n: (m if m.requires_grad else c).detach().float().cpu().clone()
                  for (n, m), c in zip(master.named_parameters(), compute.parameters())}
    return run


def bf16_allreduce_hook(state: object, bucket):  # DDP checks a return annotation as an object, not a string
    """torch's `default_hooks.bf16_compress_hook` (cast to bf16, divide by the world size, all-reduce, back
    to the bucket's dtype), which DDP accepts only on NCCL: the same arithmetic on gloo."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    dist.all_reduce(compressed)
    buffer.copy_(compressed)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def engine_run(rank: int, steps: int, accum: int, recipe_overrides: list[str], clip: float | None = None,
               seed: int = 0, inject_inf_at: tuple[int, ...] = (), model_fn=make_model,
               eval_every: int = 0) -> tuple[Run, object]:
    """Train the same model through zerorun's engine; `inject_inf_at` poisons rank 0's gradient on those micro-steps."""
    import zerorun
    from zerorun import config

    # tiny buckets: many units per module and per bucket, so every path between units is taken
    overrides = [f"train.grad_accum_steps={accum}", "zero.bucket_mb=0.0005", "zero.allgather_bucket_mb=0.0005",
                 *recipe_overrides]
    if clip is not None:
        overrides.append(f"train.clip_grad_norm={clip}")
    recipe = config.loads("script: train.py\n", "test.yaml", overrides)
    model = model_fn(seed)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    engine = zerorun.initialize(model, opt, recipe)
    run = Run()
    micro = 0
    for _ in range(steps):
        with engine.gathered():
            run.param_sums.append(sum(float(p.detach().double().sum()) for p in engine.module.parameters()))
        for _a in range(accum):
            loss = engine(batch(seed, rank, micro))
            if micro in inject_inf_at and rank == 0:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            run.losses.append(loss.item())
            micro += 1
        run.grad_norms.append(engine.grad_norm)
        if eval_every and len(run.grad_norms) % eval_every == 0:
            run.eval_losses.append(_eval(engine, rank, micro))
    if engine.stage == 3:  # stage 3: the parameters as gathered on every rank
        with engine.gathered():
            run.params = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    else:  # the fp32 master, not its low-precision copy (in fp32 without offload, the parameters themselves)
        run.params = engine_master_params(engine)
    return run, engine


def engine_master_params(engine) -> dict[str, torch.Tensor]:
    """The fp32 master weights of stages 0-2 as full parameters, by name (engine.state_dict() in fp32)."""
    from zerorun.runtime.store import master_state_dict

    state = master_state_dict(engine.module, engine.store, engine.comm, every_rank=True)
    return {n: state[n] for n, _ in engine.module.named_parameters()}
