"""The model family and the memory/disk prediction behind `zerorun bench scale` (pure arithmetic).

The family grows the standard benchmark GPT (`bench.shape.BENCHMARK`) one rung at a time: rung r
is 256 r wider and 2 r layers deeper, with 64-wide attention heads, so
width and depth grow together the way published GPT families do, and parameters grow ~1.4-1.9x
per rung (r0 97.7M, r1 193M, r2 336M, r3 535M, r4 801M, r5 1.14B, r6 1.57B, r7 2.09B, r8 2.71B).

The prediction is `zerorun estimate`'s model (`estimate.placed_states`, `working_buffers`,
`offload_buffers`, `activation_bytes`) on a machine whose "device" is the host: every byte the
estimate puts on the GPU or the CPU is host RAM here, and its NVMe bytes are files. Each rank adds
the process's own baseline (Python, torch, the gloo group).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerorun import estimate as est
from zerorun.bench.shape import BENCHMARK
from zerorun.runtime.offload.placement import Place

MIB = 2**20
GIB = 2**30
BASELINE_RSS = 400 * MIB  # one idle rank: Python + torch + a gloo group, with a margin

SYSTEMS = ("ddp", "zero3-cpu", "zero3-nvme")
DESCRIPTIONS = {
    "ddp": "DDP + torch AdamW(fused=True)",
    "zero3-cpu": "zerorun stage 3, optimizer + params on CPU",
    "zero3-nvme": "zerorun stage 3, optimizer + params on NVMe",
}
# recipe overrides per zerorun system (DDP is the plain torch baseline)
OVERRIDES = {
    "zero3-cpu": ["zero.stage=3", "zero.offload_optimizer.device=cpu", "zero.offload_param.device=cpu"],
    "zero3-nvme": ["zero.stage=3", "zero.offload_optimizer.device=nvme", "zero.offload_param.device=nvme"],
}


@dataclass(frozen=True)
class Family:
    """GPT shapes: rung r has base_d_model + d_step r width, base_layers + layer_step r layers, heads = d / head_dim."""

    base_layers: int = BENCHMARK.layers  # rung 0 is the standard benchmark GPT
    base_d_model: int = BENCHMARK.d_model
    d_step: int = 256
    layer_step: int = 2
    head_dim: int = BENCHMARK.d_model // BENCHMARK.heads
    vocab: int = BENCHMARK.vocab
    seq_len: int = BENCHMARK.seq_len

    def shape(self, rung: int) -> tuple[int, int, int]:
        """(layers, d_model, heads) of `rung`."""
        d_model = self.base_d_model + self.d_step * rung
        return self.base_layers + self.layer_step * rung, d_model, d_model // self.head_dim


def gpt_params(layers: int, d_model: int, vocab: int, seq_len: int) -> tuple[int, int, int]:
    """(total, one block, outside the blocks) parameters of `bench.gpt.GPT` (untied head)."""
    block = 12 * d_model * d_model + 13 * d_model  # qkv, proj, fc, out with biases; two LayerNorms
    root = 2 * vocab * d_model + seq_len * d_model + 2 * d_model  # token + position embeddings, head, ln_f
    return layers * block + root, block, root


@dataclass(frozen=True)
class Budget:
    """What the runs may use: host RAM for all ranks together, and files at the NVMe path."""

    ram_bytes: int
    disk_bytes: int
    world: int = 2
    micro_batch: int = 2
    checkpointing: bool = True


@dataclass
class Prediction:
    """Bytes one system needs for one rung: host RAM per rank and files for all ranks."""

    system: str
    rung: int
    layers: int
    d_model: int
    params: int
    ram_per_rank: int
    disk_total: int
    fits: bool


def predict(system: str, family: Family, rung: int, budget: Budget) -> Prediction:
    """Host RAM per rank and disk in total for `system` training `family`'s `rung` (fp32 AdamW)."""
    assert system in SYSTEMS, f"unknown system {system}"
    layers, d_model, _ = family.shape(rung)
    params, block, root = gpt_params(layers, d_model, family.vocab, family.seq_len)
    n = budget.world
    shape = est.ModelShape(params=params, largest_unit=block, root=root)
    settings = est.Settings(precision="fp32", checkpointing=budget.checkpointing and system != "ddp")
    acts = est.Activations(budget.micro_batch, family.seq_len, d_model, layers)
    logits = 3 * budget.micro_batch * family.seq_len * family.vocab * 4  # logits, their fp32 copy, the gradient
    working = est.activation_bytes(acts, "fp32", settings.checkpointing) + logits + BASELINE_RSS
    if system == "ddp":
        # 16 B/param of model states, plus DDP's own gradient buckets (4 B/param)
        ram, disk = sum(est.model_states(shape, n, 0, "fp32").values()) + 4 * params, 0
    else:
        offload = system.removeprefix("zero3-")
        placed = est.placed_states(shape, n, 3, "fp32", offload, offload)
        ram = (sum(placed[Place.DEVICE].values()) + sum(placed[Place.HOST].values()) + est.working_buffers(shape, 3, settings)
               + est.offload_buffers(settings, offload, gpu=False))
        if offload == "nvme":  # the parameter file: two bounce buffers of a unit's shard, the store's bounce
            ram += 2 * 4 * block / n + 3 * settings.offload_buffer_mb * MIB  # tile and two queued writes
        disk = round(sum(placed[Place.NVME].values()) * n)
    ram_per_rank = round(ram + working)
    fits = ram_per_rank * n <= budget.ram_bytes and disk <= budget.disk_bytes
    return Prediction(system, rung, layers, d_model, params, ram_per_rank, disk, fits)


def largest_fitting(system: str, family: Family, budget: Budget, max_rung: int,
                    max_params: int | None = None) -> Prediction | None:
    """The largest rung up to `max_rung` (and `max_params`) predicted to fit `budget`; None if not even rung 0."""
    best = None
    for rung in range(max_rung + 1):
        p = predict(system, family, rung, budget)
        if max_params is not None and p.params > max_params:
            break
        if p.fits:
            best = p
    return best


def next_to_try(tried: dict[int, bool], predicted: int) -> int | None:
    """The next rung to run: the predicted one, then down after a failure; None once one succeeded or none is left.

    `tried` maps rung -> succeeded. The search verifies the prediction and, where it was too
    optimistic, walks down until a rung trains (it never climbs above the prediction: every rung
    above it was predicted not to fit, and trying one would risk the machine's memory).
    """
    if any(tried.values()):
        return None
    rung = predicted if predicted not in tried else min(tried) - 1
    return rung if rung >= 0 else None
