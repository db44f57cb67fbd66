"""The `zerorun` command: parse the flags, call one function, render its result or its error.

Every subcommand is a plain `@app.command()` function here (`tune` and `submit` in `cli/tune.py` and
`cli/submit.py`, the `bench` and
`checkpoint` groups in `cli/bench.py` and `cli/checkpoint.py`); the work happens in the modules they call. A `ZerorunError` from any of them (a bad recipe, hostfile or flag) is printed as one line,
`zerorun: error: <message>`, with exit status 2 and no traceback (see `_ZerorunGroup`).
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

import zerorun
from zerorun.cli import suggest
from zerorun.cli.bench import bench_app
from zerorun.cli.checkpoint import checkpoint_app
from zerorun.cli.counts import count
from zerorun.cli.submit import submit
from zerorun.cli.tune import tune
from zerorun.errors import ZerorunError

try:  # typer >= 0.24 vendors click privately; older releases use click itself
    from typer._click import exceptions as click_api
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_api  # type: ignore[no-redef]


class _ZerorunGroup(TyperGroup):
    """Turns a ZerorunError from any subcommand into one line on stderr and exit status 2, and gives
    every unknown flag the nearest real one (`cli/suggest.py`)."""

    # typer hands its own Context subclass; the base classes name click's (vendored privately by typer).
    def invoke(self, ctx: typer.Context) -> object:  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except ZerorunError as exc:
            typer.echo(f"zerorun: error: {exc}", err=True)
            raise typer.Exit(2) from None
        except click_api.NoSuchOption as exc:  # a subcommand's (of any depth: they run inside this call)
            raise _with_nearest(exc) from None

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]  # as invoke
        try:
            return super().parse_args(ctx, args)
        except click_api.NoSuchOption as exc:  # `zerorun --verison`
            raise _with_nearest(exc) from None


def _with_nearest(exc: click_api.NoSuchOption) -> click_api.NoSuchOption:
    """The same usage error, its message naming the nearest flag of the command it was given to."""
    command = exc.ctx.command if exc.ctx is not None else None
    flags = [opt for param in (command.params if command is not None else [])
             for opt in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())) if opt.startswith("-")]
    flags.append("--help")
    path = exc.ctx.command_path if exc.ctx is not None else "zerorun"
    exc.message = suggest.message(exc.option_name, flags, with_recipe_keys="--set" in flags, command=path)
    exc.possibilities = None
    return exc


app = typer.Typer(
    cls=_ZerorunGroup,
    name="zerorun",
    help="A training launcher and ZeRO runtime for PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"zerorun {zerorun.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """A training launcher and ZeRO runtime for PyTorch."""


class Launcher(str, enum.Enum):
    """`--launcher` choices (the recipe's `launch.transport`, less `auto`, which is the default)."""

    local = "local"
    ssh = "ssh"
    slurm = "slurm"


class _LaunchCommand(TyperCommand):
    """`zerorun launch script.py ARGS`: as with DeepSpeed's launcher, everything after the script is its own."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]  # as invoke
        from zerorun.compat.cmdline import split_script_args

        value_options = {name for param in self.params if not getattr(param, "is_flag", True)
                         for name in getattr(param, "opts", [])}
        head, ctx.meta["script_args"] = split_script_args(args, value_options)
        return super().parse_args(ctx, head)


@app.command(cls=_LaunchCommand)
def launch(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="The recipe YAML file, or a .py script followed by its arguments "
                                                "(DeepSpeed's command line; its --deepspeed_config is the recipe).",
                                           show_default=False)],
    hostfile: Annotated[str | None, typer.Option("--hostfile", "-H",
                                                 help="DeepSpeed-style hostfile (overrides the recipe's).")] = None,
    include: Annotated[str | None, typer.Option("--include", "-i",
                                                help="Hosts/slots to use, e.g. 'worker-0@worker-1:0,2'.")] = None,
    exclude: Annotated[str | None, typer.Option("--exclude", "-e",
                                                help="Hosts/slots to leave out, same syntax as --include.")] = None,
    num_nodes: Annotated[int | None, typer.Option("--num-nodes", "--num_nodes", help="Use the first N hosts.")] = None,
    num_gpus: Annotated[int | None, typer.Option("--num-gpus", "--num_gpus",
                                                 help="Use the first N slots of every host.")] = None,
    nnodes: Annotated[int | None, typer.Option(
        "--nnodes", help="Every node runs this same command, no SSH: the job's node count (else PET_NNODES). "
                         "Node 0's launcher is the job's; the others join it.")] = None,
    node_rank: Annotated[int | None, typer.Option(
        "--node-rank", help="With --nnodes: this node's rank, 0 for the node the others join (else "
                            "PET_NODE_RANK, or an Indexed Job's JOB_COMPLETION_INDEX).")] = None,
    master_addr: Annotated[str | None, typer.Option("--master-addr", "--master_addr",
                                                    help="Rendezvous address (default: the first node).")] = None,
    master_port: Annotated[int | None, typer.Option("--master-port", "--master_port",
                                                    help="Rendezvous port (default: a free port).")] = None,
    no_local_rank: Annotated[bool, typer.Option("--no_local_rank", "--no-local-rank",
                                                help="A .py launch: do not pass --local_rank=N to the script "
                                                     "(DeepSpeed's flag).")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                      help="Override a recipe key, e.g. --set zero.stage=3.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print every node's command and environment; start nothing.")] = False,
    launcher_: Annotated[Launcher | None, typer.Option(
        "--launcher", case_sensitive=False,
        help="How nodes start (the recipe's launch.transport): local processes (and ssh to other hostfile "
             "hosts), ssh to every host, or one srun step inside a Slurm allocation (the default there).")] = None,
    max_restarts: Annotated[int | None, typer.Option(
        min=0, help="Restart after a failure up to N times, from the latest checkpoint (the recipe's "
                    "launch.max_restarts).")] = None,
) -> None:
    """Run a recipe's training script on every selected node and worker."""
    import dataclasses
    import os

    from zerorun.compat import cmdline
    from zerorun.launch import launcher, node_role, peer_launch

    options = launcher.LaunchOptions(hostfile=hostfile, include=include, exclude=exclude, num_nodes=num_nodes,
                                     num_gpus=num_gpus, master_addr=master_addr, master_port=master_port,
                                     overrides=tuple(set_ or ()),
                                     launcher=launcher_.value if launcher_ else None, max_restarts=max_restarts)
    if recipe.suffix == ".py":
        recipe = cmdline.script_recipe(recipe, ctx.meta["script_args"], local_rank_arg=not no_local_rank)
        typer.echo(f"zerorun: the command line as a recipe: {recipe}", err=True)
    role = node_role.node_role(node_role.RoleFlags(nnodes, node_rank, master_addr, master_port), os.environ)
    if role is not None:  # every node its own launcher
        job = peer_launch.prepare(recipe, options, role)
        batch = cmdline.batch_overrides(recipe, options.overrides, job.world_size)
        if batch:
            job = peer_launch.prepare(recipe, dataclasses.replace(options, overrides=(*batch, *options.overrides)), role)
        if dry_run:
            typer.echo(peer_launch.render(job))
            return
        raise typer.Exit(peer_launch.run(job))
    launch_plan = launcher.make_plan(recipe, options)
    # DeepSpeed's train_batch_size splits by the world size, known only now that the nodes are chosen
    batch = cmdline.batch_overrides(recipe, options.overrides, launch_plan.world_size)
    if batch:
        launch_plan = launcher.make_plan(recipe, dataclasses.replace(options, overrides=(*batch, *options.overrides)))
    if dry_run:
        typer.echo(launcher.render(launch_plan))
        return
    raise typer.Exit(launcher.run(launch_plan))


@app.command()
def convert(
    ds_config: Annotated[Path, typer.Argument(help="A DeepSpeed config JSON (ds_config.json).", show_default=False)],
    out: Annotated[Path | None, typer.Option(help="Write the recipe here (default: print it).")] = None,
    script: Annotated[str, typer.Option(help="The training script the recipe runs.")] = "train.py",
    world_size: Annotated[int | None, typer.Option(help="Workers in all: needed to split a train_batch_size "
                                                        "without both micro-batch and accumulation.")] = None,
) -> None:
    """Write the recipe a DeepSpeed config stands for, each key commented with where it came from."""
    from zerorun.compat import convert as converter
    from zerorun.config import ds_config as ds

    text = converter.convert(ds_config, out, script, world_size)
    translation = ds.read(ds_config, world_size)
    ds.report(translation, str(ds_config))
    ds.report_auto(translation, str(ds_config), filled_by_script=True)  # the recipe sets launch.deepspeed_compat
    if out is None:
        typer.echo(text, nl=False)
        return
    out.write_text(text)
    typer.echo(f"zerorun: wrote {out}", err=True)


@app.command()
def env(
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    build: Annotated[bool, typer.Option("--build", help="First build zerorun's kernels (retrying failed builds); "
                                                        "exit status 1 if one fails.")] = False,
) -> None:
    """Report versions, devices, compilers and kernels: paste it into a bug report."""
    from zerorun import envreport

    failed = envreport.build_kernels(progress=lambda line: typer.echo(line, err=True)) if build else []
    report = envreport.collect()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        envreport.print_table(report)
    if failed:
        raise typer.Exit(1)


app.add_typer(bench_app, name="bench")


@app.command()
def report(
    run: Annotated[Path, typer.Argument(help="A run directory (runs/<name>) or its telemetry.jsonl.",
                                        show_default=False)],
    job: Annotated[str | None, typer.Option(help="The job id to show (default: the file's last job).")] = None,
    plots: Annotated[bool, typer.Option(help="Write PNG plots (loss, throughput, memory, time split, offload) "
                                             "to runs/<name>/plots/<job id>/.")] = True,
) -> None:
    """Show a job's telemetry summary again, and plot it, from runs/<name>/telemetry.jsonl."""
    from zerorun import tables
    from zerorun.telemetry import report as telemetry_report

    tables.console().print(telemetry_report.render(telemetry_report.load(run, job)))
    profiles = telemetry_report.profiles(run, job)
    if profiles:
        typer.echo(profiles)
    if plots:
        typer.echo(telemetry_report.plot(run, job))


@app.command()
def estimate(
    recipe: Annotated[Path | None, typer.Argument(help="A recipe YAML: its zero.* and precision keys apply.",
                                                  show_default=False)] = None,
    model: Annotated[str | None, typer.Option(help="Model factory module:function, built on the meta device "
                                                   "(e.g. zerorun.bench.gpt:GPT).")] = None,
    params: Annotated[int | None, typer.Option(parser=count, metavar="COUNT", help="Trainable parameters, "
                                               "instead of --model (e.g. 7B, 1.5e9, 350M).")] = None,
    largest_layer: Annotated[int | None, typer.Option(parser=count, metavar="COUNT", help="Parameters of the "
                                                      "largest stage-3 unit (a block), e.g. 200M.")] = None,
    nodes: Annotated[int | None, typer.Option(min=1, help="Nodes (default: 1).")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(min=1, help="GPUs (workers) per node (default: the recipe's "
                                                                  "nproc_per_node, else 8).")] = None,
    gpu_mem: Annotated[float | None, typer.Option(help="Memory of one GPU, GiB.")] = None,
    cpu_mem: Annotated[float | None, typer.Option(help="CPU memory of one node, GiB.")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, bf16 or fp16 (default: the recipe's, "
                                                       "else fp32).")] = None,
    micro_batch: Annotated[int | None, typer.Option(help="Samples per GPU per forward (activations).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Sequence length (activations).")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size (activations; the block size without "
                                                    "--largest-layer).")] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer layers (activations).")] = None,
    checkpointing: Annotated[bool, typer.Option("--checkpointing", help="Activation checkpointing per layer.")] = False,
    built_on: Annotated[str, typer.Option(help="Where the script builds its model before zerorun.initialize: device "
                                               "(whole, in fp32, on the GPU), host, meta (zerorun.sharded_init), or "
                                               "auto (meta at stage 3, device below): the GPU's peak at setup.")
                        ] = "auto",
    paper: Annotated[bool, typer.Option("--paper", help="Add the ZeRO paper's model-state figure (2-byte "
                                                        "gradients) per configuration.")] = False,
    optimizer: Annotated[str | None, typer.Option(help="The optimizer whose state to count: adamw, adam, sgd, lion, "
                                                       "adagrad, rmsprop, adafactor, lamb, muon (default: the "
                                                       "recipe's optimizer.type, else adamw).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
) -> None:
    """Plan memory: bytes per GPU, CPU and NVMe for every ZeRO stage and offload, and the fastest that fits."""
    from zerorun import config, tables
    from zerorun import estimate as planner

    loaded = config.load(recipe, check_script=False) if recipe is not None else config.Recipe(script="")
    zero, dtype = loaded.zero, precision or loaded.precision.dtype
    if (model is None) == (params is None):
        raise ZerorunError("estimate: give exactly one of --model module:function or --params N.")
    if model is not None:
        shape = planner.shape_of(planner.build_on_meta(model), zero.wrap, zero.param_persistence_threshold,
                                 zero.bucket_mb)
    else:
        shape = planner.shape_from_size(params, largest_layer, hidden)
    shape_args = (micro_batch, seq_len, hidden, layers)
    activations = planner.Activations(*shape_args) if all(a is not None for a in shape_args) else None
    settings = planner.Settings(dtype, zero.bucket_mb, zero.allgather_bucket_mb, zero.prefetch_units, checkpointing,
                                async_checkpoints=loaded.checkpoint.async_save,
                                hpz_partition_size=zero.hpz_partition_size, quantized_weights=zero.quantized_weights is not False,
                                overlap_optimizer=zero.overlap_optimizer, built_on=built_on,
                                host_share=zero.offload_optimizer_ratio, optimizer=optimizer or loaded.optimizer.type)
    per_node = gpus_per_node or loaded.nproc_per_node or 8
    origin = "--gpus-per-node" if gpus_per_node else "the recipe's nproc_per_node" if loaded.nproc_per_node else \
        "the default; set --gpus-per-node"
    cluster = planner.Cluster(nodes or 1, per_node, gpu_mem, cpu_mem)
    result = planner.estimate(shape, cluster, settings, activations)
    if not as_json:
        typer.echo(f"world size {(nodes or 1) * per_node}: {nodes or 1} node(s) x {per_node} workers ({origin})",
                   err=True)
    if as_json:
        typer.echo(json.dumps(planner.as_json(result), indent=2))
        return
    out = tables.console()
    out.print(planner.render(result, paper, out.width))
    for line in planner.summary(result):
        typer.echo(line)


app.command()(tune)  # zerorun/cli/tune.py
app.command()(submit)  # zerorun/cli/submit.py
app.add_typer(checkpoint_app, name="checkpoint")  # zerorun/cli/checkpoint.py


def main() -> None:
    app()

