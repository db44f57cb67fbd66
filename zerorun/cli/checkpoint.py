"""`zerorun checkpoint info|upgrade|consolidate`: inspect and convert sharded checkpoints.

Kept apart from `cli/app.py` as `cli/bench.py` is; the work happens in `runtime.checkpoint.tools` (and
`compat.hf_export` for a Hugging Face directory), imported when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from zerorun.errors import ZerorunError

checkpoint_app = typer.Typer(help="Inspect, consolidate and upgrade sharded checkpoints.", no_args_is_help=True)


@checkpoint_app.command("info")
def checkpoint_info(
    directory: Annotated[Path, typer.Argument(help="A checkpoint directory (checkpoint.dir).", show_default=False)],
    tag: Annotated[str | None, typer.Option(help="The checkpoint to show (default: the latest).")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Also read every file and check its CRC32.")] = False,
) -> None:
    """Step, world size, stage, precision, learning rates and file sizes of a checkpoint, and the tags
    beside it, after checking its manifest and files (an edited or damaged one is an error)."""
    from rich.console import Console

    from zerorun.runtime.checkpoint import tools as checkpoint

    Console(width=200).print(checkpoint.render(checkpoint.describe(directory, tag, verify)))


@checkpoint_app.command("upgrade")
def checkpoint_upgrade(
    directory: Annotated[Path, typer.Argument(help="A checkpoint directory (checkpoint.dir).", show_default=False)],
    tag: Annotated[str | None, typer.Option(help="The checkpoint to upgrade (default: the latest).")] = None,
) -> None:
    """Add the manifest checksum to a checkpoint of format 1 (zerorun before it had one), after checking
    its structure and every file's CRC32. Check the step and learning rates it shows are the ones you saved."""
    from rich.console import Console

    from zerorun.runtime.checkpoint import tools as checkpoint

    Console(width=200).print(checkpoint.render(checkpoint.upgrade(directory, tag)))


@checkpoint_app.command("consolidate")
def checkpoint_consolidate(
    directory: Annotated[Path, typer.Argument(help="A checkpoint directory (checkpoint.dir).", show_default=False)],
    out: Annotated[Path, typer.Option(help="model.safetensors or model.pt: the full fp32 state dict; with "
                                           "--format hf, the model directory to write.")],
    tag: Annotated[str | None, typer.Option(help="The checkpoint to consolidate (default: the latest).")] = None,
    format: Annotated[str, typer.Option(help="state-dict: one file; hf: a Hugging Face model directory "
                                             "(safetensors, sharded past --max-shard-mb, config.json).")] = "state-dict",
    config: Annotated[Path | None, typer.Option(help="--format hf: the model's config.json (or its directory); "
                                                     "default: the one beside the checkpoint.")] = None,
    max_shard_mb: Annotated[float, typer.Option(help="--format hf: the most MiB per safetensors file.")] = 5120,
) -> None:
    """Write the full fp32 state dict, loadable with the plain model's load_state_dict(strict=True), or a
    Hugging Face model directory that from_pretrained loads."""
    from zerorun.runtime.checkpoint import tools as checkpoint

    if format not in ("state-dict", "hf"):
        raise ZerorunError(f"--format {format}: choose state-dict or hf.")
    state = checkpoint.consolidate(directory, tag)
    if format == "hf":
        from zerorun.compat import hf_export

        files = hf_export.write(state, out, hf_export.find_config(directory, config), int(max_shard_mb * 2**20))
        typer.echo(f"{out}: {len(files)} safetensors file(s), config.json; {len(state)} tensors")
        return
    checkpoint.write_state_dict(state, out)
    typer.echo(f"{out}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} elements")
