"""Hostfiles and node selection behave like DeepSpeed's, and every user mistake names where it is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerorun.errors import HostfileError, ZerorunError
from zerorun.launch.hostfile import Node, load, local_node, parse_hostfile, parse_hostfile_text, select_nodes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "hostfiles"
FOUR_BY_FOUR = {"worker-0": 4, "worker-1": 4, "worker-2": 4, "worker-3": 4}
ALL = (0, 1, 2, 3)


def write(tmp_path: Path, text: str, name: str = "hosts.txt") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def selected(hosts: dict[str, int] = FOUR_BY_FOUR, **flags: object) -> dict[str, tuple[int, ...]]:
    """select_nodes as a host -> slots dict, which keeps expectations short (dicts keep order)."""
    return {node.host: node.slots for node in select_nodes(hosts, **flags)}  # type: ignore[arg-type]


# --- parsing ---------------------------------------------------------------------------------


def test_parse_keeps_file_order_as_node_order() -> None:
    hosts = parse_hostfile_text("worker-2 slots=1\nworker-0 slots=8\nworker-1 slots=2\n")
    assert list(hosts.items()) == [("worker-2", 1), ("worker-0", 8), ("worker-1", 2)]


def test_parse_skips_comments_blank_lines_and_indentation() -> None:
    text = """
    # a whole-line comment
        worker-1 slots=2

    localhost slots=1   # a trailing comment
    123.23.12.10 slots=2#no space before the comment
    #worker-1 slots=3
    \t
    """
    assert parse_hostfile_text(text) == {"worker-1": 2, "localhost": 1, "123.23.12.10": 2}


def test_parse_accepts_tabs_and_crlf_line_endings() -> None:
    assert parse_hostfile_text("a\tslots=2\r\nb \t slots=3\r\n") == {"a": 2, "b": 3}


def test_parse_ignores_tokens_after_slots_like_deepspeed() -> None:
    text = "worker-0 slots=4 max_slots=8\nworker-1 slots=2 anything else\n"
    assert parse_hostfile_text(text) == {"worker-0": 4, "worker-1": 2}


def test_parse_hostfile_reads_a_file_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffworker-0 slots=2\n".encode())
    assert parse_hostfile(path) == {"worker-0": 2}


def test_parse_hostfile_accepts_str_and_pathlike(tmp_path: Path) -> None:
    path = write(tmp_path, "localhost slots=3\n")
    assert parse_hostfile(str(path)) == parse_hostfile(path) == {"localhost": 3}


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("worker-0 slots=4\nworker-1 slots=x\n", 2, "must be a whole number, got 'slots=x'"),
        ("worker-0 slots=4\n\nworker-1\n", 3, "host 'worker-1' has no slot count"),
        ("slots=4\n", 1, "the host name is missing"),
        ("this is bad slots=1\n", 1, "expected 'slots=N' after the host name, got 'is'"),
        ("worker-1 slots = 4\n", 1, "expected 'slots=N' after the host name, got 'slots'"),
        ("worker-1 slots=-1\n", 1, "must be a whole number, got 'slots=-1'"),
        ("worker-1 slots=4x\n", 1, "must be a whole number, got 'slots=4x'"),
        ("worker-1 slots=\n", 1, "must be a whole number, got 'slots='"),
        ("# header\nworker-1 slots=0\n", 2, "host 'worker-1' has slots=0"),
        ("worker-1 slots=2\nworker-2 slots=1\nworker-1 slots=1\n", 3, "'worker-1' is listed twice (first on line 1)"),
    ],
)
def test_bad_line_error_names_file_line_and_problem(tmp_path: Path, text: str, line: int, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(HostfileError) as err:
        parse_hostfile(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: ")
    assert fragment in message


def test_malformed_line_error_shows_the_expected_format() -> None:
    with pytest.raises(HostfileError, match=r"<hostfile>:1: .*expected 'HOSTNAME slots=N'"):
        parse_hostfile_text("worker-1\n")


def test_source_names_the_file_in_text_parse_errors() -> None:
    with pytest.raises(HostfileError, match=r"^cluster\.txt:2: "):
        parse_hostfile_text("a slots=1\nb slots=y\n", source="cluster.txt")


@pytest.mark.parametrize("text", ["", "\n\n", "# only\n  # comments\n"])
def test_file_without_entries_is_an_error_naming_the_file(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(HostfileError) as err:
        parse_hostfile(path)
    assert str(err.value).startswith(f"{path}: no hosts found")


def test_missing_file_error_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "hosts"
    with pytest.raises(HostfileError, match=re.escape(f"hostfile not found: {path}")):
        parse_hostfile(path)


def test_directory_or_binary_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match=re.escape(f"cannot read hostfile {tmp_path}")):
        parse_hostfile(tmp_path)
    binary = tmp_path / "hosts.bin"
    binary.write_bytes(b"\xff\xfe\x00worker")
    with pytest.raises(HostfileError, match=re.escape(f"{binary}: not a text file")):
        parse_hostfile(binary)


def test_hostfile_errors_are_user_errors_not_tracebacks() -> None:
    assert issubclass(HostfileError, ZerorunError)


# --- nodes -----------------------------------------------------------------------------------


def test_node_nproc_is_its_slot_count() -> None:
    assert Node("worker-0", (0, 2)).nproc == 2


def test_local_node_runs_nproc_slots_on_localhost() -> None:
    assert local_node(3) == Node("localhost", (0, 1, 2))
    with pytest.raises(HostfileError, match="at least 1 process, got 0"):
        local_node(0)


def test_no_filters_select_every_slot_of_every_host_in_order() -> None:
    nodes = select_nodes({"b": 2, "a": 1})
    assert nodes == [Node("b", (0, 1)), Node("a", (0,))]
    assert [node.nproc for node in nodes] == [2, 1]


def test_empty_host_list_is_an_error() -> None:
    with pytest.raises(HostfileError, match="host list is empty"):
        select_nodes({})


# --- DeepSpeed's documented examples ---------------------------------------------------------


def test_deepspeed_docs_include_two_gpus_of_one_host() -> None:
    assert selected(include="worker-2:0,1") == {"worker-2": (0, 1)}


def test_deepspeed_docs_exclude_slots_on_two_hosts() -> None:
    assert selected(exclude="worker-2:0@worker-3:0,1") == {
        "worker-0": ALL, "worker-1": ALL, "worker-2": (1, 2, 3), "worker-3": (2, 3)
    }


def test_deepspeed_docs_include_whole_hosts() -> None:
    assert selected(include="worker-2@worker-3") == {"worker-2": ALL, "worker-3": ALL}


def test_deepspeed_help_include_whole_host_and_some_slots() -> None:
    assert selected(include="worker-0@worker-1:0,2") == {"worker-0": ALL, "worker-1": (0, 2)}


def test_deepspeed_help_exclude_one_slot() -> None:
    assert selected(exclude="worker-1:0") == {"worker-0": ALL, "worker-1": (1, 2, 3), "worker-2": ALL, "worker-3": ALL}


def test_deepspeed_docs_single_node_include_on_localhost() -> None:
    assert selected({"localhost": 4}, include="localhost:0,1") == {"localhost": (0, 1)}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"exclude": "worker-0:1"}, {"worker-0": (0, 2, 3)}),
        ({"exclude": "worker-0:1,2"}, {"worker-0": (0, 3)}),
        ({"include": "worker-0:1"}, {"worker-0": (1,)}),
        ({"include": "worker-0:1,1"}, {"worker-0": (1,)}),
        ({"include": "worker-0:1@worker-0:0,1"}, {"worker-0": (0, 1)}),
        ({"include": "worker-0"}, {"worker-0": ALL}),
    ],
)
def test_deepspeed_unit_cases_on_one_node(flags: dict[str, str], expected: dict[str, tuple[int, ...]]) -> None:
    assert selected({"worker-0": 4}, **flags) == expected


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"include": "worker-1:0,3"}, {"worker-1": (0, 3)}),
        ({"exclude": "worker-1"}, {"worker-0": ALL}),
        ({"exclude": "worker-0:0,1@worker-1:3"}, {"worker-0": (2, 3), "worker-1": (0, 1, 2)}),
    ],
)
def test_deepspeed_unit_cases_on_two_nodes(flags: dict[str, str], expected: dict[str, tuple[int, ...]]) -> None:
    assert selected({"worker-0": 4, "worker-1": 4}, **flags) == expected


# --- include / exclude -----------------------------------------------------------------------


def test_result_follows_hostfile_order_not_filter_order() -> None:
    assert list(selected(include="worker-3@worker-0@worker-2")) == ["worker-0", "worker-2", "worker-3"]
    assert selected(include="worker-1:3,0,2") == {"worker-1": (0, 2, 3)}


def test_host_with_every_slot_excluded_disappears() -> None:
    assert selected(exclude="worker-1:0,1,2,3@worker-2") == {"worker-0": ALL, "worker-3": ALL}


@pytest.mark.parametrize("exclude", ["worker-0", "worker-0:0,1,2,3", "worker-0:0,1@worker-0:2,3"])
def test_excluding_everything_is_an_error(exclude: str) -> None:
    with pytest.raises(HostfileError, match=re.escape(f"no slots left to run on after --exclude={exclude}")):
        select_nodes({"worker-0": 4}, exclude=exclude)


def test_repeated_slots_and_hosts_in_a_filter_are_merged() -> None:
    assert selected(exclude="worker-0:1,1")["worker-0"] == (0, 2, 3)
    assert selected(include="worker-0:1@worker-0") == {"worker-0": ALL}
    assert selected(exclude="worker-0:1@worker-0@worker-1@worker-2") == {"worker-3": ALL}


def test_empty_filter_string_means_no_filter() -> None:
    assert selected(include="", exclude="") == selected()
    assert selected(include="", exclude="worker-0") == selected(exclude="worker-0")


def test_include_and_exclude_together_is_an_error_naming_both() -> None:
    with pytest.raises(HostfileError, match=r"--include=worker-0 and --exclude=worker-1 cannot be combined"):
        select_nodes(FOUR_BY_FOUR, include="worker-0", exclude="worker-1")


@pytest.mark.parametrize("flag", ["include", "exclude"])
@pytest.mark.parametrize("spec", ["jeff", "worker-0@jeff:1", "jeff:0"])
def test_unknown_host_error_names_flag_host_and_valid_hosts(flag: str, spec: str) -> None:
    with pytest.raises(HostfileError) as err:
        select_nodes(FOUR_BY_FOUR, **{flag: spec})
    assert str(err.value) == (
        f"--{flag}={spec}: unknown host 'jeff'; hosts in the hostfile: worker-0, worker-1, worker-2, worker-3"
    )


@pytest.mark.parametrize("flag", ["include", "exclude"])
@pytest.mark.parametrize("spec", ["worker-1:4", "worker-1:99", "worker-1:0,4"])
def test_out_of_range_slot_error_names_flag_slot_and_valid_slots(flag: str, spec: str) -> None:
    bad = spec.rsplit(",", 1)[-1].rsplit(":", 1)[-1]
    with pytest.raises(HostfileError) as err:
        select_nodes(FOUR_BY_FOUR, **{flag: spec})
    expected = f"--{flag}={spec}: slot {bad} is out of range for 'worker-1'; valid slots on 'worker-1': 0-3"
    assert str(err.value) == expected


def test_single_slot_host_reports_its_one_valid_slot() -> None:
    with pytest.raises(HostfileError, match="valid slots on 'solo': 0$"):
        select_nodes({"solo": 1}, include="solo:1")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("worker-0:a", "slot 'a' on 'worker-0' is not a slot index"),
        ("worker-0:-1", "slot '-1' on 'worker-0' is not a slot index"),
        ("worker-0:", "slot '' on 'worker-0' is not a slot index"),
        ("worker-0:0,,1", "slot '' on 'worker-0' is not a slot index"),
        ("worker-0@@worker-1", "empty entry between '@' separators"),
        ("@worker-0", "empty entry between '@' separators"),
        ("worker-1@worker-0:1@5", "unknown host '5'"),
    ],
)
def test_malformed_filter_is_an_error_naming_the_flag_and_spec(spec: str, fragment: str) -> None:
    with pytest.raises(HostfileError) as err:
        select_nodes(FOUR_BY_FOUR, exclude=spec)
    assert str(err.value).startswith(f"--exclude={spec}: {fragment}")


def test_ipv6_hosts_can_be_named_in_filters() -> None:
    hosts = {"::1": 2, "fe80::2": 2}
    assert selected(hosts, include="::1") == {"::1": (0, 1)}
    assert selected(hosts, include="fe80::2:1") == {"fe80::2": (1,)}


@given(
    counts=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=5),
    picks=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), min_size=1, max_size=12),
)
def test_include_and_exclude_of_the_same_spec_split_the_slots_exactly(
    counts: list[int], picks: list[tuple[int, int]]
) -> None:
    hosts = {f"h{i}": count for i, count in enumerate(counts)}
    chosen = {(f"h{i}", slot) for i, slot in picks if i < len(counts) and slot < counts[i]}
    if not chosen:
        return
    spec = "@".join(f"{host}:{slot}" for host, slot in sorted(chosen))
    kept = {(n.host, s) for n in select_nodes(hosts, include=spec) for s in n.slots}
    assert kept == chosen
    everything = {(host, slot) for host, count in hosts.items() for slot in range(count)}
    if chosen != everything:
        dropped = {(n.host, s) for n in select_nodes(hosts, exclude=spec) for s in n.slots}
        assert dropped == everything - chosen


# --- num_nodes / num_gpus --------------------------------------------------------------------


def test_num_nodes_takes_the_first_hosts() -> None:
    assert list(selected(num_nodes=2)) == ["worker-0", "worker-1"]
    assert list(selected(num_nodes=4)) == list(FOUR_BY_FOUR)


def test_num_nodes_applies_after_exclude_and_include() -> None:
    assert list(selected(exclude="worker-0", num_nodes=1)) == ["worker-1"]
    assert list(selected(include="worker-3@worker-1", num_nodes=1)) == ["worker-1"]


def test_num_nodes_above_available_hosts_is_an_error_naming_them() -> None:
    with pytest.raises(HostfileError) as err:
        select_nodes(FOUR_BY_FOUR, exclude="worker-0@worker-1", num_nodes=3)
    assert str(err.value) == (
        "--num-nodes=3: only 2 host(s) available after --exclude=worker-0@worker-1: worker-2, worker-3"
    )


def test_num_gpus_takes_the_first_slots_of_every_host() -> None:
    assert selected({"a": 4, "b": 2}, num_gpus=2) == {"a": (0, 1), "b": (0, 1)}
    assert selected({"a": 4, "b": 2}, num_gpus=1) == {"a": (0,), "b": (0,)}


def test_num_gpus_takes_the_first_remaining_slots_after_a_filter() -> None:
    assert selected(include="worker-1:1,3@worker-2", num_gpus=1) == {"worker-1": (1,), "worker-2": (0,)}
    assert selected(exclude="worker-0:0", num_gpus=2) == {
        "worker-0": (1, 2), "worker-1": (0, 1), "worker-2": (0, 1), "worker-3": (0, 1)
    }


def test_include_then_num_nodes_then_num_gpus_compose_in_that_order() -> None:
    assert selected(include="worker-3@worker-2:1,2,3", num_nodes=1, num_gpus=2) == {"worker-2": (1, 2)}


def test_num_gpus_above_a_hosts_slots_is_an_error_naming_the_smallest_host() -> None:
    with pytest.raises(HostfileError) as err:
        select_nodes({"a": 4, "b": 2, "c": 2}, num_gpus=3)
    assert str(err.value) == "--num-gpus=3: host 'b' has only 2 slot(s) (0,1); use --num-gpus=2 or fewer"


def test_num_gpus_error_mentions_the_filter_that_shrank_the_host() -> None:
    with pytest.raises(HostfileError, match=r"host 'worker-1' has only 1 slot\(s\) after --include=worker-1:2 \(2\)"):
        select_nodes(FOUR_BY_FOUR, include="worker-1:2", num_gpus=2)


@pytest.mark.parametrize("flag", ["num_nodes", "num_gpus"])
@pytest.mark.parametrize("value", [0, -1, True])
def test_counts_below_one_are_errors_naming_the_flag(flag: str, value: object) -> None:
    cli_flag = "--" + flag.replace("_", "-")
    with pytest.raises(HostfileError, match=re.escape(f"{cli_flag}={value!r}: must be a whole number of at least 1")):
        select_nodes(FOUR_BY_FOUR, **{flag: value})  # type: ignore[arg-type]


# --- load ------------------------------------------------------------------------------------


def test_load_parses_then_selects(tmp_path: Path) -> None:
    path = write(tmp_path, "# cluster\nw0 slots=4\nw1 slots=4  # second\nw2 slots=2\n")
    assert load(path, exclude="w0", num_gpus=2) == [Node("w1", (0, 1)), Node("w2", (0, 1))]
    assert load(path) == [Node("w0", ALL), Node("w1", ALL), Node("w2", (0, 1))]


def test_load_reports_a_missing_file_before_any_flag(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="hostfile not found"):
        load(tmp_path / "absent", include="jeff")


# --- example hostfiles -----------------------------------------------------------------------

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.txt"))
FLAG_EXAMPLE = re.compile(r'--(include|exclude)="([^"]+)"|--(num-nodes|num-gpus)=(\d+)')


def test_the_documented_example_hostfiles_exist() -> None:
    assert {path.name for path in EXAMPLE_FILES} >= {"one-node.txt", "two-nodes.txt", "slots.txt"}


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda path: path.name)
def test_example_hostfile_parses_and_explains_the_format(path: Path) -> None:
    assert parse_hostfile(path)
    assert "DeepSpeed" in path.read_text()


def test_example_hostfiles_have_the_advertised_shapes() -> None:
    assert parse_hostfile(EXAMPLES / "one-node.txt") == {"localhost": 2}
    assert parse_hostfile(EXAMPLES / "two-nodes.txt") == {"worker-0": 4, "worker-1": 4}
    assert len(set(parse_hostfile(EXAMPLES / "slots.txt").values())) > 1


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda path: path.name)
def test_flag_examples_in_example_hostfile_comments_are_valid(path: Path) -> None:
    examples = FLAG_EXAMPLE.findall(path.read_text())
    assert examples, f"{path.name} shows no --include/--exclude/--num-* example"
    hosts = parse_hostfile(path)
    for spec_flag, spec, count_flag, count in examples:
        flags = {spec_flag: spec} if spec_flag else {count_flag.replace("-", "_"): int(count)}
        assert select_nodes(hosts, **flags), flags  # type: ignore[arg-type]


def test_module_imports_without_torch() -> None:
    # the launcher reads hostfiles before (and on machines without) a torch install
    code = "import sys, zerorun.launch.hostfile; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("line, problem", [
    ("localhost: slots=2", "'localhost:' is not a host name"),
    ("-V slots=1", "'-V' is not a host name"),
    ("-oProxyCommand=x slots=1", "is not a host name"),
    ("user@node slots=1", "is not a host name"),
    ("node-1- slots=1", "is not a host name"),
])
def test_a_host_name_that_is_not_one_is_refused_naming_the_line_and_the_grammar(line: str, problem: str) -> None:
    with pytest.raises(HostfileError) as err:
        parse_hostfile_text(f"worker-0 slots=1\n{line}\n", "hosts")
    assert str(err.value).startswith("hosts:2: ") and problem in str(err.value)
    assert "letters, digits" in str(err.value) and "HOSTNAME slots=N" in str(err.value)


def test_a_trailing_colon_gets_the_line_as_it_should_be_written() -> None:
    with pytest.raises(HostfileError, match=r"\(DeepSpeed hostfile format\); did you mean 'localhost slots=2'\?$"):
        parse_hostfile_text("localhost: slots=2\n", "hosts")


def test_host_names_and_addresses_that_are_valid_stay_valid() -> None:
    text = "worker-0 slots=1\nnode_1.cluster.local slots=2\n10.0.0.7 slots=1\n::1 slots=1\nfe80::1%eth0 slots=1\n"
    assert list(parse_hostfile_text(text)) == ["worker-0", "node_1.cluster.local", "10.0.0.7", "::1", "fe80::1%eth0"]
