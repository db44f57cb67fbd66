"""`zerorun submit`: a Slurm batch job, or Kubernetes manifests (`--to kubernetes`), and following it.

Kept apart from `cli/app.py` as `cli/tune.py` is; the work happens in `zerorun.launch.submit` (Slurm) and
`zerorun.launch.k8s_submit` (Kubernetes), imported when run.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

from zerorun.errors import ZerorunError


class Scheduler(str, enum.Enum):
    """`zerorun submit --to` choices."""

    slurm = "slurm"
    kubernetes = "kubernetes"


class KubeKind(str, enum.Enum):
    """`zerorun submit --to kubernetes --kind` choices (zerorun.launch.kubernetes.Kind)."""

    job = "job"
    jobset = "jobset"
    trainjob = "trainjob"


def submit(
    recipe: Annotated[Path, typer.Argument(help="The recipe YAML file.", show_default=False)],
    to: Annotated[Scheduler, typer.Option("--to", case_sensitive=False,
                                          help="Where the job runs: a Slurm batch job, or Kubernetes pods (manifests "
                                               "written to runs/<name>/k8s/).")] = Scheduler.slurm,
    nodes: Annotated[int, typer.Option(help="Nodes to allocate (one torchrun on each).")] = 1,
    gpus_per_node: Annotated[int | None, typer.Option(help="GPUs per node (also the workers per node, "
                                                           "unless the recipe sets nproc_per_node).")] = None,
    partition: Annotated[str | None, typer.Option(help="Slurm partition.")] = None,
    time: Annotated[str | None, typer.Option(help="Time limit, in Slurm's syntax (e.g. 4:00:00).")] = None,
    account: Annotated[str | None, typer.Option(help="Account to charge.")] = None,
    sbatch_arg: Annotated[list[str] | None, typer.Option(
        "--sbatch-arg", metavar="ARG", help="One more #SBATCH line, e.g. --sbatch-arg=--mem=0 (repeatable).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                      help="Override a recipe key, e.g. --set zero.stage=3.")] = None,
    no_follow: Annotated[bool, typer.Option("--no-follow", help="Print the job id and return at once.")] = False,
    image: Annotated[str | None, typer.Option(help="Kubernetes: the container image (torch, zerorun, the script "
                                                   "and the recipe).")] = None,
    kind: Annotated[KubeKind, typer.Option(case_sensitive=False, help="Kubernetes: an Indexed Job and a headless "
                                                                      "Service, a JobSet, or a Kubeflow TrainJob.")]
    = KubeKind.job,
    volume: Annotated[list[str] | None, typer.Option(metavar="CLAIM:PATH", help="Kubernetes: mount a "
                                                     "PersistentVolumeClaim in every pod (repeatable).")] = None,
    secret: Annotated[str | None, typer.Option(help="Kubernetes: the Secret holding the job's secret (key "
                                                    "`secret`); default: --apply creates <name>-secret.")] = None,
    namespace: Annotated[str | None, typer.Option(help="Kubernetes: the namespace.")] = None,
    apply: Annotated[bool, typer.Option("--apply", help="Kubernetes: apply the manifests with kubectl and follow "
                                                        "node 0's log.")] = False,
) -> None:
    """Submit a recipe as a Slurm batch job (script kept in runs/<name>/) and follow it to its end, or write
    Kubernetes manifests for it (--to kubernetes) and apply them."""
    from zerorun.launch import submit as batch

    given = {"--partition": partition, "--time": time, "--account": account, "--sbatch-arg": sbatch_arg,
             "--image": image, "--volume": volume, "--secret": secret, "--namespace": namespace, "--apply": apply,
             "--kind": kind is not KubeKind.job}
    for_kubernetes = {"--image", "--volume", "--secret", "--namespace", "--apply", "--kind"}
    wrong = [flag for flag, value in given.items() if value and (flag in for_kubernetes) != (to is Scheduler.kubernetes)]
    if wrong:
        raise ZerorunError(f"{', '.join(wrong)}: not an option of --to {to.value}.")
    if to is Scheduler.kubernetes:
        _submit_kubernetes(recipe, nodes, gpus_per_node, image, kind, volume, secret, namespace, set_, apply,
                           no_follow)
        return

    options = batch.SubmitOptions(nodes=nodes, gpus_per_node=gpus_per_node, partition=partition, time=time,
                                  account=account, sbatch_args=tuple(sbatch_arg or ()), overrides=tuple(set_ or ()))
    job = batch.submit(recipe, options)
    typer.echo(f"zerorun: submitted Slurm job {job.job_id}; script {job.script}; output {job.output}", err=True)
    if no_follow:
        typer.echo(job.job_id)
        return
    raise typer.Exit(batch.follow(job, ask=_confirm))


def _submit_kubernetes(recipe: Path, nodes: int, gpus_per_node: int | None, image: str | None, kind: KubeKind,
                       volume: list[str] | None, secret: str | None, namespace: str | None, set_: list[str] | None,
                       apply: bool, no_follow: bool) -> None:
    from zerorun.launch import k8s_submit
    from zerorun.launch.kubernetes import Kind

    options = k8s_submit.KubeOptions(nodes=nodes, image=image, gpus_per_node=gpus_per_node, kind=Kind(kind.value),
                                     volumes=tuple(volume or ()), secret=secret, namespace=namespace,
                                     overrides=tuple(set_ or ()))
    written = k8s_submit.write(recipe, options)
    typer.echo(f"zerorun: wrote {written.path}", err=True)
    if not apply:
        typer.echo(f"zerorun: to run it: {k8s_submit.apply_hint(written)}", err=True)
        return
    k8s_submit.apply(written)
    typer.echo(f"zerorun: applied {written.path}", err=True)
    if not no_follow:
        raise typer.Exit(k8s_submit.follow(written))


def _confirm(question: str) -> bool:
    """Ask on the terminal; no answer (stdin closed) means no."""
    try:
        return typer.confirm(question, default=False, err=True)
    except (typer.Abort, EOFError):
        return False
