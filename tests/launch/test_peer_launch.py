"""Every node its own launcher, without starting anything: each node plans its command exactly as node 0 plans it,
and what cannot work is refused before anything starts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.launch.launched import write_recipe
from zerorun import config
from zerorun.errors import LaunchError
from zerorun.launch import member, peer_launch
from zerorun.launch.launcher import LaunchOptions
from zerorun.launch.link import Attempt
from zerorun.launch.node_role import RoleFlags, node_role
from zerorun.telemetry import ADDRESS_ENV, TOKEN_ENV


def role(rank: int):
    return node_role(RoleFlags(nnodes=3, node_rank=rank, master_addr="n0", master_port=29600), {})


@pytest.fixture
def recipe_path(tmp_path):
    return write_recipe(tmp_path, "train_tiny.py", nproc_per_node=2, train={"micro_batch_size": 4},
                        launch={"oversubscribe": True})


def test_each_node_plans_its_own_command_as_node_0_plans_it_a_shrunken_batch_included(recipe_path):
    job = peer_launch.prepare(recipe_path, LaunchOptions(), role(0))
    nodes = {0: ("n0", 2), 1: ("n1", 2), 2: ("n2", 2)}
    planned = peer_launch._planned(job, nodes)
    recipe = config.load(recipe_path, overrides=["master_addr=n0", "master_port=29600"])  # as each node loads it
    assert planned.inputs is not None
    facts = planned.inputs.facts  # the nodes' machines alike (their own facts may differ: OMP_NUM_THREADS)
    for node in planned.nodes:
        attempt = Attempt(planned.job_id, node.node_rank, [(n.host, n.nproc) for n in planned.nodes],
                          planned.master_port, 4, 1, "n0:4000")
        own = member.command_for(recipe, attempt, facts, "token")
        assert (own.argv, own.first_rank, own.host, own.over_ssh) == (node.argv, node.first_rank, node.host, False)
        assert {k: v for k, v in own.env.items() if k not in (ADDRESS_ENV, TOKEN_ENV)} == node.env
        assert (own.env[ADDRESS_ENV], own.env[TOKEN_ENV]) == ("n0:4000", "token")
    shrunk = Attempt("j-r1", 1, [("n0", 2), ("n2", 2)], 29600, 4, 3, None)
    own = member.command_for(recipe, shrunk, facts, "token")
    assert own.argv[own.argv.index("--nnodes") + 1] == "2" and own.argv[own.argv.index("--node-rank") + 1] == "1"
    assert json.loads(own.env[config.RECIPE_ENV])["train"]["grad_accum_steps"] == 3 and ADDRESS_ENV not in own.env


def test_a_recipe_that_differs_gets_another_digest_and_paths_to_it_do_not(recipe_path, tmp_path):
    job = peer_launch.prepare(recipe_path, LaunchOptions(), role(1))
    other = peer_launch.prepare(recipe_path, LaunchOptions(overrides=("train.steps=7",)), role(1))
    moved = dataclasses.replace(job.recipe, script="/elsewhere/" + job.recipe.script.rsplit("/", 1)[1])
    assert peer_launch.recipe_digest(moved) == peer_launch.recipe_digest(job.recipe) != \
        peer_launch.recipe_digest(other.recipe)
    assert peer_launch.render(job).startswith("node 1 of 3 (")


@pytest.mark.parametrize("options, message", [
    (LaunchOptions(hostfile="hosts", num_nodes=2), "--hostfile, --num-nodes: --nnodes 3 runs a launcher on every node"),
    (LaunchOptions(launcher="ssh"), "--launcher: --nnodes 3 runs a launcher on every node"),
])
def test_hostfile_flags_and_launchers_are_refused_with_nnodes(recipe_path, options, message):
    with pytest.raises(LaunchError, match=message):
        peer_launch.prepare(recipe_path, options, role(0))
