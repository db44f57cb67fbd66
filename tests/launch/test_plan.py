"""The launch plan is pure: argv and env per node from a recipe, nodes and machine facts."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.launch.launched import SCRIPTS, write_recipe
from zerorun import config
from zerorun.errors import HostfileError, LaunchError
from zerorun.launch import launcher
from zerorun.launch.hostfile import Node
from zerorun.launch.launcher import LaunchOptions, transport_for
from zerorun.launch.plan import MachineFacts, plan, render, with_env
from zerorun.launch.ssh import ssh_argv

CPU = MachineFacts(cpu_count=8, python="/py/bin/python")
MANY_CORES = MachineFacts(cpu_count=64, python="/py/bin/python")
TWO_LOCAL = [Node("localhost", (0, 1))]


def recipe(**keys: object) -> config.Recipe:
    r = config.from_dict({"script": "/jobs/train.py", "args": ["--lr", "0.1"], **keys}, "/jobs/r.yaml")
    r.source, r.name = "/jobs/r.yaml", "r"
    return r


def test_argv_runs_the_worker_module_under_torchrun_with_a_static_rendezvous():
    p = plan(recipe(), TWO_LOCAL, "job-1", 29555, CPU)
    assert p.nodes[0].argv == (
        "/py/bin/python", "-m", "zerorun.launch.torchrun", "--nnodes", "1", "--node-rank", "0",
        "--nproc-per-node", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
        "--master-port", "29555", "--max-restarts", "0", "--monitor-interval", "0.1",
        "-m", "zerorun.launch.worker", "--", "/jobs/train.py", "--lr", "0.1")
    assert (p.world_size, p.master_addr, p.master_port, p.kill_grace_s) == (2, "127.0.0.1", 29555, 3.0)


def test_torchrun_accepts_the_planned_flags():
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(plan(recipe(), TWO_LOCAL, "job-1", 29555, CPU).nodes[0].argv[3:])
    assert (args.module, args.training_script, args.nproc_per_node, args.rdzv_backend) == \
        (True, "zerorun.launch.worker", "2", "static")
    assert [a for a in args.training_script_args if a != "--"] == ["/jobs/train.py", "--lr", "0.1"]


def test_nodes_get_ranks_in_hostfile_order_and_the_first_node_is_master():
    nodes = [Node("a", (0, 1)), Node("b", (0, 1, 2, 3))]
    p = plan(recipe(), nodes, "job-1", 29500, MANY_CORES)
    assert [(n.host, n.node_rank, n.first_rank, n.nproc) for n in p.nodes] == [("a", 0, 0, 2), ("b", 1, 2, 4)]
    assert p.world_size == 6 and p.master_addr == "a"
    assert [n.argv[n.argv.index("--node-rank") + 1] for n in p.nodes] == ["0", "1"]
    assert all(n.argv[n.argv.index("--nnodes") + 1] == "2" for n in p.nodes)
    assert p.nodes[1].ranks == range(2, 6)


def test_recipe_master_addr_and_port_win():
    p = plan(recipe(master_addr="10.0.0.9"), TWO_LOCAL, "job-1", 1234, CPU)
    assert p.master_addr == "10.0.0.9" and "10.0.0.9" in p.nodes[0].argv


def test_slots_travel_in_the_plan_and_cuda_visible_devices_is_left_to_each_node():
    facts = MachineFacts(cpu_count=8, python="py", inherited_env={"CUDA_VISIBLE_DEVICES": "2,3,5", "CUDA_HOME": "/c"})
    p = plan(recipe(), [Node("localhost", (0, 2)), Node("b", (1, 3))], "j", 1, facts)
    assert [n.slots for n in p.nodes] == [(0, 2), (1, 3)]
    assert all("CUDA_VISIBLE_DEVICES" not in n.env for n in p.nodes)  # the launcher's GPUs are not the node's
    assert p.nodes[1].env["CUDA_HOME"] == "/c"  # other CUDA_* variables still reach remote nodes
    text = render(p)
    assert "node 0: localhost  ranks 0-1  slots 0,2" in text and "node 1: b  ranks 2-3  slots 1,3" in text


def test_dry_run_from_a_host_without_gpus_shows_the_included_slots_per_node(tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from zerorun.cli import app

    monkeypatch.setattr(launcher, "gpu_count", lambda: 0)  # a login node, a CPU laptop
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu-a slots=4\ngpu-b slots=4\n")
    recipe_path = write_recipe(tmp_path, "allreduce.py")
    result = CliRunner().invoke(app, ["launch", str(recipe_path), "--hostfile", str(hosts), "--include",
                                      "gpu-a:0,2@gpu-b:1", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "node 0: gpu-a  ranks 0-1  slots 0,2" in result.output
    assert "node 1: gpu-b  ranks 2  slots 1" in result.output
    assert "CUDA_VISIBLE_DEVICES=" not in result.output  # decided on each node, not here


def test_omp_threads_share_the_cores_between_workers_unless_the_user_set_them():
    assert plan(recipe(), TWO_LOCAL, "j", 1, CPU).nodes[0].env["OMP_NUM_THREADS"] == "4"
    assert plan(recipe(), [Node("localhost", tuple(range(16)))], "j", 1, CPU).nodes[0].env["OMP_NUM_THREADS"] == "1"
    assert plan(recipe(env={"OMP_NUM_THREADS": 7}), TWO_LOCAL, "j", 1, CPU).nodes[0].env["OMP_NUM_THREADS"] == "7"
    inherited = MachineFacts(cpu_count=8, python="py", inherited_env={"OMP_NUM_THREADS": "2"})
    assert "OMP_NUM_THREADS" not in plan(recipe(), TWO_LOCAL, "j", 1, inherited).nodes[0].env


def test_env_carries_the_resolved_recipe_job_id_and_host():
    p = plan(recipe(zero={"stage": 3}), [Node("a", (0,)), Node("b", (0,))], "job-42", 29500, CPU)
    for node in p.nodes:
        assert config.from_dict(json.loads(node.env["ZERORUN_RECIPE"])).zero.stage == 3
        assert node.env["ZERORUN_RECIPE_SOURCE"] == "/jobs/r.yaml"
        assert node.env["ZERORUN_JOB_ID"] == "job-42"
    assert [n.env["ZERORUN_NODE_HOST"] for n in p.nodes] == ["a", "b"]


def test_plan_carries_steps_and_telemetry_and_with_env_adds_the_collector_address_to_every_node():
    given = recipe(train={"steps": 7}, telemetry={"stall_s": 9})
    given.given["train.steps"] = "/jobs/r.yaml:3"  # a total the user gave (config.known_steps)
    p = plan(given, [Node("a", (0,)), Node("b", (0,))], "j", 1, MANY_CORES)
    assert (p.steps, p.telemetry.stall_s) == (7, 9.0)
    launched = with_env(p, {"ZERORUN_TELEMETRY": "10.0.0.1:4000"})
    assert all(n.env["ZERORUN_TELEMETRY"] == "10.0.0.1:4000" for n in launched.nodes)
    assert all("ZERORUN_TELEMETRY" not in n.env for n in p.nodes)  # the original plan is untouched
    assert [n.env["ZERORUN_NODE_HOST"] for n in launched.nodes] == ["a", "b"]


def test_recipe_env_reaches_workers_but_cannot_replace_zerorun_variables():
    env = plan(recipe(env={"NCCL_DEBUG": "INFO", "ZERORUN_JOB_ID": "mine"}), TWO_LOCAL, "job-1", 1, CPU).nodes[0].env
    assert env["NCCL_DEBUG"] == "INFO" and env["ZERORUN_JOB_ID"] == "job-1"


def test_dry_run_shows_each_host_its_env_and_a_command_line_the_shell_reads_back_as_argv():
    p = plan(recipe(args=["--name", "two words"]), [Node("a", (0,)), Node("b", (0, 1))], "job-1", 29500, MANY_CORES)
    text = render(p)
    assert text.startswith("job job-1 (r): 2 nodes, 3 workers, master a:29500")
    assert "node 0: a  ranks 0" in text and "node 1: b  ranks 1-2" in text
    assert "ZERORUN_JOB_ID=job-1" in text
    assert "ZERORUN_RECIPE=<the resolved recipe as JSON" in text  # summarised, not dumped
    assert "telemetry: runs/r/telemetry.jsonl; every node's env also gets ZERORUN_TELEMETRY=" in text
    commands = [line.strip() for line in text.splitlines() if line.startswith("    /py/bin/python")]
    assert [tuple(shlex.split(c)) for c in commands] == [n.argv for n in p.nodes]


# -- make_plan: the impure front (recipe file, hostfile, options) ---------------------------------


@pytest.fixture
def recipe_file(tmp_path: Path) -> Path:
    # 3 local workers on a 2-core machine are refused unless meant (tests/launch/test_capacity.py)
    return write_recipe(tmp_path, "allreduce.py", nproc_per_node=3, launch={"kill_grace_s": 1.0, "oversubscribe": True})


def test_make_plan_without_hostfile_runs_nproc_per_node_workers_locally(recipe_file: Path):
    p = launcher.make_plan(recipe_file, LaunchOptions())
    assert [(n.host, n.nproc) for n in p.nodes] == [("localhost", 3)]
    assert p.nodes[0].argv[-1] == str(SCRIPTS / "allreduce.py")
    assert launcher.make_plan(recipe_file, LaunchOptions(overrides=("nproc_per_node=1",))).world_size == 1


def test_make_plan_takes_hostfile_nodes_capped_by_nproc_per_node_unless_flags_choose_slots(
        recipe_file: Path, tmp_path: Path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=4\nworker-1 slots=4\n")

    def nodes(**options: object) -> list[tuple[str, int]]:
        p = launcher.make_plan(recipe_file, LaunchOptions(hostfile=str(hosts), **options))
        return [(n.host, n.nproc) for n in p.nodes]

    assert nodes() == [("worker-0", 3), ("worker-1", 3)]  # the recipe's nproc_per_node: 3
    assert nodes(include="worker-1:0,2") == [("worker-1", 2)]
    assert nodes(num_gpus=1, num_nodes=1) == [("worker-0", 1)]


def test_nproc_per_node_above_a_hosts_slots_is_an_error_naming_the_recipe_key(recipe_file: Path, tmp_path: Path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\n")
    with pytest.raises(HostfileError, match="nproc_per_node: 3"):
        launcher.make_plan(recipe_file, LaunchOptions(hostfile=str(hosts)))


def test_include_without_a_hostfile_is_an_error(recipe_file: Path):
    with pytest.raises(HostfileError, match="hostfile"):
        launcher.make_plan(recipe_file, LaunchOptions(include="localhost:0"))


def test_remote_hosts_run_over_ssh_and_local_ones_as_processes_unless_transport_is_ssh():
    nodes = [Node("localhost", (0,)), Node("worker-1", (0,))]
    p = plan(recipe(), nodes, "job-1", 29500, CPU)
    assert [type(transport_for(node, p)).__name__ for node in p.nodes] == ["LocalTransport", "SSHTransport"]
    p = plan(recipe(launch={"transport": "ssh"}), nodes, "job-1", 29500, CPU)
    assert [node.over_ssh for node in p.nodes] == [True, True]


def test_ssh_nodes_get_the_propagated_environment_then_env_file_then_recipe_env():
    inherited = {"PATH": "/venv/bin:/usr/bin", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv", "HOME": "/root",
                 "NCCL_DEBUG": "INFO", "CUDA_HOME": "/cuda", "SECRET": "x", "LD_LIBRARY_PATH": "/lib",
                 "ZERORUN_WARM_RANKS": "0"}
    facts = MachineFacts(cpu_count=8, python="/venv/bin/python", inherited_env=inherited,
                         cwd="/jobs", env_file={"NCCL_DEBUG": "WARN", "FROM_FILE": "1", "TOKEN": "file"})
    p = plan(recipe(env={"TOKEN": "recipe"}), [Node("localhost", (0,)), Node("worker-1", (0,))], "job-1", 29500, facts)
    local, remote = p.nodes
    assert "PATH" not in local.env and local.env["FROM_FILE"] == "1"  # a local node inherits everything anyway
    assert {k: remote.env[k] for k in ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME")} == {
        "PATH": "/venv/bin:/usr/bin", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv", "LD_LIBRARY_PATH": "/lib",
        "CUDA_HOME": "/cuda"}
    assert (remote.env["NCCL_DEBUG"], remote.env["TOKEN"], remote.env["FROM_FILE"]) == ("WARN", "recipe", "1")
    assert remote.env["ZERORUN_WARM_RANKS"] == "0"  # the launcher's choice of fresh interpreters holds there too
    assert "SECRET" not in remote.env and "HOME" not in remote.env
    assert (remote.over_ssh, remote.cwd) == (True, "/jobs")
    assert p.master_addr == "localhost"  # node 0 is this machine: the others reach it by its name, not 127.0.0.1
    text = render(p)
    assert "node 1: worker-1  ranks 1  slots 0  over ssh, in /jobs" in text and "    PATH=/venv/bin:/usr/bin" in text


def test_env_file_takes_key_value_lines_with_comments_blanks_export_and_quotes():
    text = "# cluster settings\n\nNCCL_IB_DISABLE=1\nexport HF_HOME='/data/hf'\nEMPTY=\n"
    assert launcher.parse_env_file(text, ".zerorun_env") == {"NCCL_IB_DISABLE": "1", "HF_HOME": "/data/hf", "EMPTY": ""}
    with pytest.raises(LaunchError, match=r"\.zerorun_env:2: expected KEY=VALUE, got 'oops'"):
        launcher.parse_env_file("A=1\noops\n", ".zerorun_env")


def test_env_file_is_read_from_the_working_directory_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".zerorun_env").write_text("WHERE=home\n")
    monkeypatch.setenv("HOME", str(home))
    assert launcher.load_env_file(str(tmp_path)) == {"WHERE": "home"}
    (tmp_path / ".zerorun_env").write_text("WHERE=cwd\n")
    assert launcher.load_env_file(str(tmp_path)) == {"WHERE": "cwd"}


def test_ssh_argv_puts_recipe_options_before_zerorun_defaults_so_they_win():
    ssh = config.SSHConfig(port=2222, user="ada", identity_file="~/.ssh/k", options=["ServerAliveInterval=1"])
    argv = ssh_argv(ssh, "worker-1", "exec true")
    assert argv[:3] == ["ssh", "-T", "-x"] and argv[-3:] == ["--", "worker-1", "exec true"]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "ada"
    assert not argv[argv.index("-i") + 1].startswith("~")
    options = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-o"]
    assert options.index("ServerAliveInterval=1") < options.index("ServerAliveInterval=3")
    assert "BatchMode=yes" in options


def test_master_addr_and_port_options_override_the_recipe(recipe_file: Path):
    p = launcher.make_plan(recipe_file, LaunchOptions(master_addr="10.0.0.5", master_port=29999))
    assert (p.master_addr, p.master_port) == ("10.0.0.5", 29999)


def test_job_ids_are_unique_and_readable():
    ids = {launcher.new_job_id("my run/1") for _ in range(100)}
    assert len(ids) == 100 and all(i.startswith("my_run_1-") for i in ids)


def test_a_host_name_is_never_an_ssh_option():
    from zerorun.errors import LaunchError

    argv = ssh_argv(config.SSHConfig(), "::1", "exec true")
    assert argv[-3:] == ["--", "::1", "exec true"]  # `--` first: whatever the host, ssh reads it as the host
    for bad in ("-V", "-oProxyCommand=touch /tmp/x", "user@host", "host:22", "a b", ""):
        with pytest.raises(LaunchError, match="is not a host name"):
            ssh_argv(config.SSHConfig(), bad, "exec true")


def test_preflight_probes_many_hosts_with_bounded_concurrency(monkeypatch):
    from tests.harness import Concurrency
    from zerorun.launch import preflight
    from zerorun.launch.hostfile import Node
    from zerorun.launch.plan import MachineFacts, plan

    recipe = config.from_dict({"script": "/x/t.py"})
    nodes = [Node(f"node-{i}", (0,)) for i in range(300)]
    launch_plan = plan(recipe, nodes, "j", 1, MachineFacts(2, "py"))
    counter = Concurrency()

    def fake_check(launch_plan, node, script, expected, nvme_paths):  # noqa: ANN001, ANN202 - no ssh started
        with counter:
            return preflight.HostCheck(node.host)

    monkeypatch.setattr(preflight, "check_host", fake_check)
    checks = preflight._host_checks(launch_plan)
    assert [c.host for c in checks] == [n.host for n in nodes]
    assert 1 < counter.most <= preflight.SSH_CONCURRENCY


def test_nvme_offload_directories_are_the_jobs_not_the_run_names():
    from zerorun.launch.hostfile import Node
    from zerorun.launch.plan import MachineFacts, plan

    recipe = config.from_dict({"script": "/x/t.py", "name": "same", "zero": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}})
    first = plan(recipe, [Node("a", (0, 1))], "same-1", 1, MachineFacts(2, "py"))
    second = plan(recipe, [Node("a", (0, 1))], "same-2", 1, MachineFacts(2, "py"))
    assert first.nodes[0].offload_dirs == ("/nvme/same-1/rank-0", "/nvme/same-1/rank-1")
    assert set(first.nodes[0].offload_dirs).isdisjoint(second.nodes[0].offload_dirs)
