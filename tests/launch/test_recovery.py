"""The restart policy, pure: what follows a failed attempt, and why (no processes)."""

from __future__ import annotations

import pytest

from zerorun.launch.hostfile import Node
from zerorun.launch.recovery import Batch, Failure, Policy, decide
from zerorun.launch.supervisor import Ending

TWO = (Node("a", (0, 1)), Node("b", (0, 1)))
BATCH = Batch(micro_batch_size=4, grad_accum_steps=1)  # global batch 4 x 1 x 4 ranks = 16


def rank_failed(rank: int = 3, step: int | None = 12, host: str = "b") -> Failure:
    return Failure(Ending.RANK_FAILED, f"rank {rank} on {host} failed (exit code 1)", 1, host, rank, step)


def lost(host: str = "b", step: int | None = 12) -> Failure:
    return Failure(Ending.NODE_LOST, f"lost contact with {host}: no heartbeat for 10 s", 1, host, None, step)


def test_no_restart_by_default_nor_after_a_signal_or_success():
    assert not decide(Policy(), [rank_failed()], TWO, BATCH).restart
    stopped = decide(Policy(max_restarts=3), [Failure(Ending.SIGNAL, "stopped by SIGINT", 130)], TWO, BATCH)
    assert not stopped.restart and stopped.reason == "the job was stopped"


def test_a_failure_restarts_on_the_same_nodes_until_the_restarts_are_used_up():
    policy = Policy(max_restarts=2)
    first = decide(policy, [rank_failed(step=5)], TWO, BATCH)
    assert first.restart and first.nodes == TWO and first.batch == BATCH
    assert first.reason == "restart 1 of 2 on the same nodes"
    assert decide(policy, [rank_failed(step=5), rank_failed(step=9)], TWO, BATCH).restart
    used_up = decide(policy, [rank_failed(step=5), rank_failed(step=9), rank_failed(step=14)], TWO, BATCH)
    assert not used_up.restart
    assert used_up.reason == "not restarting (after 2 restarts): rank 3 on b failed (exit code 1)"


def test_a_failure_that_repeats_at_the_same_step_on_the_same_rank_stops_and_is_named():
    decision = decide(Policy(max_restarts=5), [rank_failed(step=12), rank_failed(step=12)], TWO, BATCH)
    assert not decision.restart
    assert decision.reason.startswith("rank 3 on b failed again after step 12, as in the attempt before: not "
                                      "restarting a failure that repeats (rank 3 on b failed (exit code 1))")
    assert decide(Policy(max_restarts=5), [rank_failed(step=12), rank_failed(rank=2, step=12)], TWO, BATCH).restart
    assert decide(Policy(max_restarts=5), [rank_failed(step=None), rank_failed(step=None)], TWO, BATCH).restart


def test_shrink_drops_a_lost_node_and_keeps_the_global_batch_through_accumulation():
    decision = decide(Policy(max_restarts=1, on_node_failure="shrink"), [lost("b")], TWO, BATCH)
    assert decision.restart and decision.nodes == (TWO[0],) and decision.dropped == ("b",)
    assert decision.batch == Batch(4, 2) and decision.batch.global_size(2) == BATCH.global_size(4)
    assert decision.reason == ("restart 1 of 1 without b: 2 -> 1 nodes, 4 -> 2 ranks; global batch 16 kept: "
                               "train.micro_batch_size 4, train.grad_accum_steps 1 -> 2")


def test_retry_keeps_a_lost_node_and_a_rank_failure_never_shrinks():
    assert decide(Policy(max_restarts=1), [lost("b")], TWO, BATCH).nodes == TWO
    assert decide(Policy(max_restarts=1, on_node_failure="shrink"), [rank_failed()], TWO, BATCH).nodes == TWO


def test_shrink_stops_below_min_nodes_or_when_the_global_batch_cannot_be_kept():
    policy = Policy(max_restarts=1, on_node_failure="shrink", min_nodes=2)
    below = decide(policy, [lost("b")], TWO, BATCH)
    assert not below.restart and "fewer than launch.min_nodes (2)" in below.reason
    three = (Node("a", (0,)), Node("b", (0,)), Node("c", (0,)))
    odd = decide(Policy(max_restarts=1, on_node_failure="shrink"), [lost("c")], three, Batch(1, 1))
    assert not odd.restart
    assert odd.reason.startswith("the global batch of 3 samples (micro-batch 1 x accumulation 1 x 3 ranks) cannot "
                                 "be kept on 2 ranks")


def test_hosts_that_fail_a_restarts_preflight_are_dropped_only_under_shrink():
    shrink = decide(Policy(max_restarts=1, on_node_failure="shrink"), [rank_failed(host="a")], TWO, BATCH,
                    unreachable=["b"])
    assert shrink.restart and shrink.nodes == (TWO[0],)
    retry = decide(Policy(max_restarts=1), [rank_failed(host="a")], TWO, BATCH, unreachable=["b"])
    assert not retry.restart and "cannot be reached and launch.on_node_failure is retry" in retry.reason


def test_the_launcher_says_where_the_next_attempt_resumes(tmp_path):
    from zerorun import config
    from zerorun.launch.launcher import resume_point

    recipe = config.from_dict({"script": "t.py", "checkpoint": {"dir": str(tmp_path)}})
    assert resume_point(recipe, rank_failed(step=7)) == ("no checkpoint to resume from: the job starts again from "
                                                        "step 0 with the same seed; telemetry last saw step 7")
    (tmp_path / "latest").write_text("step-4\n")
    assert resume_point(recipe, rank_failed(step=7)) == (f"resuming from checkpoint step-4 in {tmp_path}; telemetry "
                                                        "last saw step 7; steps 5-7 run again")
    # telemetry lags the workers (and a SIGKILLed rank's last records never come): a step behind the
    # checkpoint is said to be what telemetry saw, never turned into a backwards range "steps 5-2"
    assert resume_point(recipe, rank_failed(step=2)) == (f"resuming from checkpoint step-4 in {tmp_path}; telemetry "
                                                        "last saw step 2, so it cannot say how far past step 4 the "
                                                        "job got")
    # steps faster than the telemetry interval: the failure can come before the first report
    assert resume_point(recipe, rank_failed(step=None)) == (f"resuming from checkpoint step-4 in {tmp_path}; "
                                                           "telemetry saw no step, so it cannot say how far past "
                                                           "step 4 the job got")


def test_restart_settings_that_cannot_work_as_asked_are_warned_about_before_the_start():
    from zerorun.launch.recovery import policy_warnings

    assert policy_warnings(0, "retry", None, "auto") == []
    assert policy_warnings(2, "retry", "ckpt", "auto") == []
    [no_dir] = policy_warnings(2, "retry", None, "auto")
    assert "no checkpoint.dir: every restart starts again from step 0" in no_dir
    [never] = policy_warnings(1, "retry", "ckpt", "never")
    assert "checkpoint.resume is never" in never
    [inert] = policy_warnings(0, "shrink", "ckpt", "auto")
    assert "launch.max_restarts is 0: a failure ends the job" in inert


def test_every_steps_without_a_checkpoint_dir_is_refused_naming_the_key():
    from zerorun import config
    from zerorun.errors import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint.every_steps: 5 saves nothing without checkpoint.dir"):
        config.from_dict({"script": "t.py", "checkpoint": {"every_steps": 5}})
