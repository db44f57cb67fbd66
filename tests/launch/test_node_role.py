"""Which node a launcher is when every node runs its own: flags first, else the cluster's environment; pure."""

from __future__ import annotations

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.node_role import RoleFlags, node_role
from zerorun.launch.secret import SECRET_ENV, take_secret, telemetry_token


def test_flags_give_the_role_and_node_0_listens_on_the_port_after_the_rendezvous():
    role = node_role(RoleFlags(nnodes=4, node_rank=2, master_addr="n0", master_port=29600, nproc_per_node=8), {})
    assert (role.nnodes, role.node_rank, role.master_addr, role.master_port, role.nproc_per_node) == \
        (4, 2, "n0", 29600, 8)
    assert role.link_port == 29601 and not role.is_first


def test_kubeflow_and_indexed_job_environments_give_the_same_role():
    kubeflow = {"PET_NNODES": "3", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-0.job", "PET_MASTER_PORT": "29400",
                "PET_NPROC_PER_NODE": "8"}
    indexed = {"PET_NNODES": "3", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "job-0.job", "MASTER_PORT": "29400",
               "PET_NPROC_PER_NODE": "8"}
    roles = [node_role(RoleFlags(), env) for env in (kubeflow, indexed)]
    assert all((r.nnodes, r.node_rank, r.master_addr, r.master_port, r.nproc_per_node) == (3, 1, "job-0.job", 29400, 8)
               for r in roles), roles
    assert roles[1].origins["node_rank"] == "JOB_COMPLETION_INDEX=1"


def test_flags_win_over_the_environment_and_auto_workers_are_left_to_the_recipe():
    env = {"PET_NNODES": "8", "PET_NODE_RANK": "5", "MASTER_ADDR": "a", "PET_NPROC_PER_NODE": "auto"}
    role = node_role(RoleFlags(nnodes=2, node_rank=0, master_addr="b"), env)
    assert (role.nnodes, role.node_rank, role.master_addr, role.master_port, role.nproc_per_node) == \
        (2, 0, "b", 29500, None)


def test_without_nnodes_it_is_an_ordinary_launch_whatever_else_the_environment_holds():
    assert node_role(RoleFlags(), {"MASTER_ADDR": "x", "JOB_COMPLETION_INDEX": "0", "MASTER_PORT": "1"}) is None


@pytest.mark.parametrize("flags, env, message", [
    (RoleFlags(nnodes=2, master_addr="a"), {}, "which node is this one? Give --node-rank"),
    (RoleFlags(nnodes=2, node_rank=2, master_addr="a"), {}, "--node-rank 2 is not below --nnodes 2"),
    (RoleFlags(), {"PET_NNODES": "2", "JOB_COMPLETION_INDEX": "3", "MASTER_ADDR": "a"},
     "JOB_COMPLETION_INDEX=3 is not below PET_NNODES=2"),
    (RoleFlags(nnodes=2, node_rank=1), {}, "where is node 0? Give --master-addr HOST"),
    (RoleFlags(), {"PET_NNODES": "1:4"}, "PET_NNODES=1:4: expected a whole number (an elastic range"),
    (RoleFlags(nnodes=0), {}, "--nnodes 0: expected at least 1"),
    (RoleFlags(nnodes=2, node_rank=0, master_addr="a"), {"MASTER_PORT": "65535"}, "MASTER_PORT=65535: expected a port"),
    (RoleFlags(nnodes=2, node_rank=0, master_addr="-oProxy"), {}, "--master-addr '-oProxy': expected a host name"),
    (RoleFlags(node_rank=1), {}, "--node-rank 1 needs the number of nodes"),
    (RoleFlags(nnodes=2, node_rank=0, master_addr="a"), {"PET_NPROC_PER_NODE": "x"}, "PET_NPROC_PER_NODE=x: expected"),
])
def test_bad_or_missing_values_are_refused_naming_the_flag_or_variable(flags, env, message):
    with pytest.raises(LaunchError, match=message.replace("?", r"\?").replace("(", r"\(")):
        node_role(flags, env)


def test_the_secret_leaves_the_environment_and_the_telemetry_token_is_derived_from_it():
    env = {SECRET_ENV: "s" * 40, "OTHER": "1"}
    secret = take_secret(env)
    assert secret == "s" * 40 and env == {"OTHER": "1"}
    assert telemetry_token(secret) == telemetry_token("s" * 40) != secret
    with pytest.raises(LaunchError, match=f"{SECRET_ENV} is not set"):
        take_secret({})
    with pytest.raises(LaunchError, match="too short"):
        take_secret({SECRET_ENV: "short"})
