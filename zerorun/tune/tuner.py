"""`zerorun tune`: measure candidates on the user's own job, within a time budget, and pick the fastest that fits.

    result = tune("recipe.yaml", TuneOptions(budget_min=10), progress=show)
    result.winner          # the fastest measured trial that fits, or None
    result.trials          # every trial in run order; result.rejected: ruled out before running

The loop: load the recipe and plan the job as `zerorun launch` would (nodes, ranks), set the memory
budget (default: what this machine has), list and prune the candidates (`space`), then until the
search (`search`) has nothing left or the time is up, run the next candidate (`trial`) with early
stopping: a trial whose best step so far falls clearly short of the best trial's throughput is ended
after `DECIDE_STEPS` measured steps, and one that cannot finish before the deadline is ended at once.
When the search is done and time is left, close rivals of the best are run again
(`search.next_confirmation`) and their medians decide; then the recipe and the winner run in turn
(`noise.next_run`), and a gain over the recipe is claimed only where every interleaved pair shows it
(`TuneResult.comparison`): inside the noise, the recipe stays (`TuneResult.chosen`). Failures are
results, never the end of the tuning.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from zerorun import config, estimate
from zerorun.errors import ZerorunError
from zerorun.tune import noise, search, space
from zerorun.tune.load import Load
from zerorun.tune.measure import Status, Trial, TrialRecords
from zerorun.tune.space import Budget, Candidate, Dimensions, Rejection
from zerorun.tune.trial import TrialRunner, TrialSetup

GIB = 2**30
DECIDE_STEPS = 2  # measured steps before a trial may be stopped for being slower
EARLY_STOP_MARGIN = 0.05  # ... than this much below the best: closer calls measure fully (steps vary this much)
STALL_MIN_S = 60.0
RESERVE_S = 5.0  # of the budget, kept for stopping the last trial and writing the results
REPEATS = ("confirm", "recheck", "verify")  # phases that run a measured candidate again


@dataclass(frozen=True)
class TuneOptions:
    budget_min: float = 10.0
    gpu_mem_gib: float | None = None  # per GPU (default: the smallest GPU here)
    cpu_mem_gib: float | None = None  # per node (default: this machine's memory)
    nvme_path: str | None = None
    allow_batch_change: bool = False
    micro_batches: tuple[int, ...] = ()
    bucket_mb: tuple[float, ...] = ()
    stages: tuple[int, ...] = (0, 1, 2, 3)
    offloads: tuple[str, ...] = estimate.OFFLOADS
    model: str | None = None  # module:function, for the estimate before the first trial
    warmup: int = 1
    steps: int = 3
    min_seconds: float = 2.0
    overrides: tuple[str, ...] = ()  # --set, applied to every trial
    launch_options: dict = field(default_factory=dict)  # hostfile, include, exclude, num_nodes, num_gpus


@dataclass
class Session:
    """A tuning's facts before any trial: the job's layout, the budget, the space and what the estimate rules out."""

    recipe_path: str
    options: TuneOptions
    base: Candidate
    budget: Budget
    dims: Dimensions
    settings: estimate.Settings
    shape: estimate.ModelShape | None
    candidates: list[Candidate]
    kept: list[Candidate]
    rejected: list[Rejection]
    runner: TrialRunner
    notes: list[str] = field(default_factory=list)
    batch_honoured: bool = True  # the script runs train.micro_batch_size x grad_accum_steps samples per step

    def check_batch(self, trial: Trial) -> None:
        """If the baseline's steps did not see micro-batch x accumulation samples, the script picks its own
        batch: varying train.micro_batch_size would measure nothing, so it stays the recipe's."""
        seen, dims, base = trial.samples_per_step, self.dims, self.base
        expected = base.micro_batch * base.grad_accum
        if not seen or seen == {expected}:
            return
        self.batch_honoured = False
        self.dims = Dimensions(dims.shardings, (dims.micro_batches[0],), dims.checkpointing, dims.bucket_mb)
        self.notes.append(f"the script's steps saw {', '.join(map(str, sorted(seen)))} samples per rank, not "
                          f"train.micro_batch_size x train.grad_accum_steps = {expected}: it picks its own batch, "
                          "so the micro-batch is not varied.")

    def learn_params(self, trial: Trial, tried: Iterable[Candidate]) -> None:
        """Without --model, the first trial's parameter count lets the estimate prune from then on."""
        if self.shape is not None or not trial.params:
            return
        self.shape = estimate.ModelShape(params=trial.params)
        self.kept, rejections = space.prune(self.candidates, self.shape, self.budget, self.settings,
                                            self.runner.setup.nvme_path)
        tried = set(tried)
        self.rejected = [r for r in rejections if r.candidate not in tried]
        self.notes.append(f"the estimate counts the {trial.params / 1e6:.1f}M parameters the first trial reported; "
                          "give --model module:function to prune before any trial.")

    def judge(self, trial: Trial) -> None:
        judge(trial, self.budget, self.batch_honoured)


def judge(trial: Trial, budget: Budget, batch_honoured: bool = True) -> None:
    """A measured trial over the memory budget does not fit, and one whose steps did not see the candidate's
    batch did not measure the candidate: neither can win."""
    c = trial.candidate
    if not trial.ok:
        return
    if budget.gpu_bytes is not None and trial.peak_gpu and trial.peak_gpu > budget.gpu_bytes:
        trial.status = Status.OVER_BUDGET
        trial.cause = f"peak {space.gib(trial.peak_gpu)} GPU/rank > budget {space.gib(budget.gpu_bytes)}"
    elif trial.peak_rss and trial.peak_rss > budget.cpu_bytes_per_rank:
        trial.status = Status.OVER_BUDGET
        trial.cause = f"peak {space.gib(trial.peak_rss)} RSS/rank > budget {space.gib(budget.cpu_bytes_per_rank)}"
    elif batch_honoured and trial.samples_per_step - {c.micro_batch * c.grad_accum}:
        trial.status = Status.INVALID
        trial.cause = (f"the script ran {', '.join(map(str, sorted(trial.samples_per_step)))} samples per step, "
                       f"not {c.micro_batch} x {c.grad_accum}")


def prepare(recipe_path: str | Path, options: TuneOptions, kind: str = "tune") -> Session:
    """Load and plan the job, list the candidates and prune them; starts nothing. Trials go to
    runs/<name>/<kind>-<time>/."""
    recipe = config.load(recipe_path, overrides=options.overrides)
    budget = _budget(recipe_path, options)
    honours = space.script_honours(recipe.script)
    dims = _dimensions(recipe, options, honours)
    settings = estimate.Settings(recipe.precision.dtype, recipe.zero.bucket_mb, recipe.zero.allgather_bucket_mb,
                                 recipe.zero.prefetch_units, False, recipe.zero.offload_optimizer.buffer_mb,
                                 optimizer=recipe.optimizer.type)
    shape = _shape(recipe, options.model)
    nvme = options.nvme_path or recipe.zero.offload_optimizer.nvme_path or recipe.zero.offload_param.nvme_path
    candidates = space.space(dims)
    kept, rejected = space.prune(candidates, shape, budget, settings, nvme)
    stamp = f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    setup = TrialSetup(str(recipe_path), recipe.name or Path(recipe_path).stem, stamp,
                       options.launch_options, options.overrides, nvme, options.warmup, options.steps,
                       options.min_seconds)
    session = Session(str(recipe_path), options, space.base_candidate(recipe), budget, dims, settings, shape,
                      candidates, kept, rejected, TrialRunner(setup))
    if space.CHECKPOINTING_KEY not in honours:
        session.notes.append(f"{space.CHECKPOINTING_KEY} is not varied: {Path(recipe.script).name} does not declare "
                             f"{space.HONOURS_NAME} = [\"{space.CHECKPOINTING_KEY}\"] (docs/tune.md).")
    return session


@dataclass
class TuneResult:
    recipe: str
    base: Candidate
    budget: Budget
    dims: Dimensions
    budget_s: float
    tune_dir: str
    trials: list[Trial] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    current: Trial | None = None  # the trial running now (for the live view)
    interrupted: bool = False  # Ctrl-C

    @property
    def winner(self) -> Trial | None:
        return search.best(self.trials)

    @property
    def baseline(self) -> Trial | None:
        return next((t for t in self.trials if t.candidate == self.base), None)

    @property
    def comparison(self) -> noise.Comparison | None:
        """The winner against the recipe in interleaved runs; None where there is no such comparison to make
        (the winner is the recipe, or the recipe did not measure within the budget)."""
        win, base = self.winner, self.baseline
        if win is None or base is None or win is base or not base.ok:
            return None
        return noise.compare(base, win)

    @property
    def chosen(self) -> Trial | None:
        """What the tuned recipe takes: the winner where its gain over the recipe is supported by interleaved
        runs, or where the recipe itself did not measure within the budget; else the recipe as it is (a gain
        inside the noise, or one that was never compared side by side, changes nothing)."""
        comparison = self.comparison
        if comparison is not None and not comparison.supported:
            return self.baseline
        return self.winner

    @property
    def loads(self) -> list[Load]:
        return [load for trial in self.trials for load in trial.loads]


Progress = Callable[[TuneResult], None]


def tune(recipe_path: str | Path, options: TuneOptions, progress: Progress = lambda result: None) -> TuneResult:
    """Run the tuning; returns whatever was measured when the search ended, the budget ran out or Ctrl-C came."""
    started = time.monotonic()
    deadline = started + options.budget_min * 60
    session = prepare(recipe_path, options)
    result = TuneResult(str(recipe_path), session.base, session.budget, session.dims, options.budget_min * 60,
                        str(session.runner.setup.tune_dir), rejected=session.rejected, notes=session.notes)
    trials: dict[Candidate, Trial] = {}
    try:
        while (picked := _next(session, trials, _time_to_verify(result.trials, deadline))) is not None:
            candidate, phase = picked
            if not _time_for_another(result.trials, deadline, options):
                if phase not in REPEATS:
                    session.notes.append(f"the time budget ended in the search's {phase} phase (next: "
                                         f"{candidate.label()}); raise --budget-min to measure more.")
                break
            trial = _run_one(session.runner, result, candidate, phase, deadline, options, progress)
            if candidate in trials:  # a repeat: folded into the candidate's row
                session.judge(trial)
                trials[candidate].fold(trial)
                session.judge(trials[candidate])
            else:
                trials[candidate] = trial
                result.trials.append(trial)
                if candidate == session.base:
                    session.check_batch(trial)
                session.judge(trial)
                session.learn_params(trial, trials)
            result.rejected, result.dims = session.rejected, session.dims
            result.elapsed_s = time.monotonic() - started
            progress(result)
    except KeyboardInterrupt:
        result.interrupted = True
        session.notes.append("interrupted (Ctrl-C): the results are those measured until then.")
    result.current = None
    result.elapsed_s = time.monotonic() - started
    return result


def _next(session: Session, trials: dict[Candidate, Trial], verify_now: bool = False
          ) -> tuple[Candidate, str] | None:
    """The best so far again when the machine may have drifted since; else the search's next
    candidate; once it has none, a rival of the best to run again; then the recipe and the best in turn.
    `verify_now` (the time left is what the interleaved runs need): the recipe and the best in turn first."""
    if verify_now and (verify := _verification(session, trials)) is not None:
        return verify, "verify"
    picked = search.next_candidate(session.base, session.dims, trials, [r.candidate for r in session.rejected])
    if picked is not None:
        recheck = search.next_recheck(trials.values(), sum(1 + len(t.repeats) for t in trials.values()))
        return (recheck, "recheck") if recheck is not None else picked
    again = search.next_confirmation(trials.values())
    if again is not None:
        return again, "confirm"
    verify = _verification(session, trials)
    return (verify, "verify") if verify is not None else None


def _verification(session: Session, trials: dict[Candidate, Trial]) -> Candidate | None:
    """The next run of the recipe and the best in turn (`noise.next_run`), or None when none is wanted."""
    base, top = trials.get(session.base), search.best(trials.values())
    if base is None or top is None:
        return None
    return noise.next_run(base, top, max(n for t in trials.values() for n in (t.index or 0, *t.repeats)))


def _run_one(runner: TrialRunner, result: TuneResult, candidate: Candidate, phase: str, deadline: float,
             options: TuneOptions, progress: Progress) -> Trial:
    best = result.winner if phase not in REPEATS else None  # a repeat is measured fully

    def stop(records: TrialRecords) -> tuple[Status, str] | None:
        left = deadline - RESERVE_S - time.monotonic()
        if left <= 0:
            return Status.OUT_OF_TIME, "the time budget ran out"
        step_s = records.step_seconds(options.warmup)
        missing = max(0, options.steps - records.measured_steps(options.warmup))
        if step_s and missing * step_s > left:
            return Status.OUT_OF_TIME, f"needed ~{missing * step_s:.0f} s more, {left:.0f} s left"
        if best is None or records.measured_steps(options.warmup) < DECIDE_STEPS:
            return None
        fastest, level = records.best_step(options.warmup), search.latest(best)  # the best's latest run: today's load
        if fastest is not None and fastest < (1 - EARLY_STOP_MARGIN) * level:
            return Status.SLOWER, (f"its best step {fastest:,.0f} {records.unit} < {1 - EARLY_STOP_MARGIN:g} x "
                                   f"t{best.index:02d}'s {level:,.0f}")
        return None

    def show(trial: Trial, records: TrialRecords) -> None:
        result.current = trial
        result.elapsed_s = time.monotonic() - (deadline - result.budget_s)
        progress(result)

    index = 1 + len(result.trials) + sum(len(t.repeats) for t in result.trials)
    trial = runner.run(candidate, index, phase, stop, show, _stall_limit(result.trials))
    result.current = None
    return trial


def _stall_limit(trials: list[Trial]) -> float | None:
    """How long a trial may go without a step: generous against the slowest start and step seen so far
    (a hung trial must not eat the budget); before any trial, the setup's default."""
    startups = [t.startup_s for t in trials if t.startup_s]
    steps = [t.step_s for t in trials if t.step_s]
    if not startups:
        return None
    return max(STALL_MIN_S, 3 * max(startups), 10 * max(steps, default=0.0))


def _time_to_verify(trials: list[Trial], deadline: float) -> bool:
    """Whether the time left is about what the interleaved runs of the recipe and the best need (a run per
    remaining pair member, at the trials' median length, plus one): the search then yields to them."""
    walls = [t.wall_s / (1 + len(t.repeats)) for t in trials if t.wall_s]
    if not walls:
        return False
    left = deadline - RESERVE_S - time.monotonic()
    return left <= (2 * noise.PAIRS + 1) * statistics.median(walls)


def _time_for_another(trials: list[Trial], deadline: float, options: TuneOptions) -> bool:
    """Whether a trial started now can measure before the deadline, judging by the trials so far."""
    left = deadline - RESERVE_S - time.monotonic()
    startups = [t.startup_s for t in trials if t.startup_s]
    steps = [t.step_s for t in trials if t.step_s]
    needed = (statistics.median(startups) if startups else 0.0) + \
        (options.warmup + options.steps) * (min(steps) if steps else 0.0)
    return left > needed


def _shape(recipe: config.Recipe, model: str | None) -> estimate.ModelShape | None:
    if model is None:
        return None
    zero = recipe.zero
    return estimate.shape_of(estimate.build_on_meta(model), zero.wrap, zero.param_persistence_threshold,
                             zero.bucket_mb)


def _dimensions(recipe: config.Recipe, options: TuneOptions, honours: tuple[str, ...]) -> Dimensions:
    bad_stages = [s for s in options.stages if s not in range(4)]
    bad_offloads = [o for o in options.offloads if o not in estimate.OFFLOADS]
    if bad_stages or bad_offloads or not options.stages or "none" not in options.offloads:
        raise ZerorunError("--stages takes values of 0-3 and --offloads of none, cpu, nvme (none included), "
                           f"got stages {list(options.stages)} and offloads {list(options.offloads)}.")
    train = recipe.train
    ckpt = (False, True) if space.CHECKPOINTING_KEY in honours else (train.activation_checkpointing,)
    return Dimensions(space.shardings(options.stages, options.offloads),
                      space.micro_batches(train.micro_batch_size, train.grad_accum_steps, options.allow_batch_change,
                                          options.micro_batches),
                      ckpt, space.bucket_sizes(recipe.zero.bucket_mb, options.bucket_mb))


def _budget(recipe_path: str | Path, options: TuneOptions) -> Budget:
    """The memory budget and the job's layout, from its plan (as `zerorun launch` would make it)."""
    from zerorun.launch import launcher

    plan = launcher.make_plan(recipe_path, launcher.LaunchOptions(**options.launch_options,
                                                                  overrides=options.overrides))
    per_node = max(node.nproc for node in plan.nodes)
    nodes = sum(node.node_count for node in plan.nodes)
    cpu = (options.cpu_mem_gib * GIB) if options.cpu_mem_gib else psutil.virtual_memory().total
    gpu = options.gpu_mem_gib * GIB if options.gpu_mem_gib else _gpu_memory()
    for flag, value in (("--cpu-mem", options.cpu_mem_gib), ("--gpu-mem", options.gpu_mem_gib)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ZerorunError(f"{flag}: expected GiB > 0, got {value}.")
    return Budget(per_node, nodes, float(cpu), gpu)


def _gpu_memory() -> float | None:
    """The smallest local GPU's memory; None without CUDA (a CPU-only job)."""
    from zerorun.launch.devices import gpu_count

    if not gpu_count():
        return None
    import torch

    return float(min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))
