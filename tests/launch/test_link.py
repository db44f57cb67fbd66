"""The link between a node's launcher and node 0's: proven both ways, frames both ways, and node 0 refusing a node
that would not run the same job (in-process, on loopback; the real launches are in tests/cluster)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from zerorun.errors import LaunchError
from zerorun.launch import link
from zerorun.launch.joined import Expected, Roster
from zerorun.launch.launcher import free_port
from zerorun.launch.link import HEADER, Frames, Hello, Kind, Link, LinkError
from zerorun.launch.node_role import NodeRole

SECRET = "a" * 64
VERSIONS = {"python": "3.11", "torch": "2.13.0", "zerorun": "0.9"}


def proven_pair(node0_secret: str, member_secret: str) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides of the proof over a socketpair; what each side raised."""
    a, b = socket.socketpair()
    errors: list[BaseException | None] = [None, None]

    def side(index: int, call) -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors[index] = exc
        finally:
            (a, b)[index].close()  # as the real sides do when their proof fails

    threads = [threading.Thread(target=side, args=(0, lambda: link.admit(a, node0_secret))),
               threading.Thread(target=side, args=(1, lambda: link.join(b, member_secret, "n0:1")))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return errors[0], errors[1]


def test_both_sides_prove_the_secret_and_a_wrong_one_is_refused_by_whichever_side_checks_it():
    assert proven_pair(SECRET, SECRET) == (None, None)
    refused, member = proven_pair(SECRET, "b" * 64)
    assert "did not prove the job's secret" in str(refused)
    assert "Is ZERORUN_JOB_SECRET the same on every node?" in str(member)


def test_a_node_0_that_does_not_know_the_secret_is_not_obeyed():
    a, b = socket.socketpair()
    impostor = threading.Thread(target=lambda: (a.sendall(b"zerorun-link/1 c0ffee\n"), a.recv(256),
                                                a.sendall(b"0" * 64 + b"\n")))
    impostor.start()
    with pytest.raises(LinkError, match="did not prove the job's secret: not this job's node 0"):
        link.join(b, SECRET, "n0:1")
    impostor.join()


def test_frames_pass_whole_however_the_bytes_arrive_and_garbage_closes_the_link():
    frames = Frames()
    data = HEADER.pack(Kind.OUT.value, 6) + b"line1\n" + HEADER.pack(Kind.EXIT.value, 1) + b"3"
    got = [frame for i in range(len(data)) for frame in frames.feed(data[i:i + 1])]
    assert got == [(Kind.OUT, b"line1\n"), (Kind.EXIT, b"3")]
    with pytest.raises(LinkError, match="not a zerorun link frame"):
        Frames().feed(HEADER.pack(b"?", 1) + b"x")
    with pytest.raises(LinkError, match="not a zerorun link frame"):
        Frames().feed(HEADER.pack(Kind.OUT.value, link.MAX_PAYLOAD + 1))
    a, b = socket.socketpair()
    receiver = Link(b, "peer")
    a.sendall(HEADER.pack(b"?", 0))
    assert receiver.receive(5.0) == [] and receiver.closed


said: list[str] = []  # what node 0 said (its refusals)


@pytest.fixture
def roster():
    port = free_port()
    role = NodeRole(nnodes=3, node_rank=0, master_addr="127.0.0.1", master_port=port - 1, nproc_per_node=None,
                    origins={})
    built = Roster(role, SECRET, Expected(3, "digest", VERSIONS, "node0"), said.append)
    said.clear()
    built.start()
    yield built
    built.end(0)


def joining(roster: Roster, **fields: object) -> Link:
    """A node's launcher joining `roster` with a hello of `fields` (else a good one for node 1)."""
    sock = socket.create_connection(("127.0.0.1", roster.role.link_port), timeout=5)
    link.join(sock, SECRET, "node 0")
    joined = Link(sock, "node 0")
    hello = {"node_rank": 1, "nnodes": 3, "host": "node1", "nproc": 2, "recipe": "digest", "versions": VERSIONS}
    joined.send(Kind.HELLO, Hello(**{**hello, **fields}).encode())  # type: ignore[arg-type]
    return joined


def answer(joined: Link) -> tuple[Kind, bytes]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for kind, payload in joined.receive(0.2):
            if kind is not Kind.BEAT:
                return kind, payload
    raise AssertionError("node 0 said nothing")


@pytest.mark.parametrize("fields, reason", [
    ({"recipe": "other"}, "its recipe differs from node 0's"),
    ({"nnodes": 2}, "it was started for 2 nodes, node 0 for 3: give every node the same --nnodes"),
    ({"node_rank": 3}, "node rank 3 is not one of 1..2"),
    ({"versions": {**VERSIONS, "torch": "2.12.0"}}, "other versions than node 0's: torch 2.12.0 (node 0: 2.13.0)"),
    ({"host": "node0"}, "another node has the host name node0"),
])
def test_node_0_refuses_a_node_that_would_not_run_the_same_job_and_says_why(roster, fields, reason):
    kind, payload = answer(joining(roster, **fields))
    assert kind is Kind.REFUSE and reason in payload.decode()
    assert any(reason in line for line in said), said


def test_nodes_join_by_rank_a_second_launcher_of_a_rank_is_refused_and_the_end_reaches_every_node(roster):
    first, second = joining(roster), joining(roster, node_rank=2, host="node2")
    members = roster.wait([1, 2], timeout_s=10)
    assert {rank: m.hello.host for rank, m in members.items()} == {1: "node1", 2: "node2"}
    kind, payload = answer(joining(roster, host="elsewhere"))
    assert kind is Kind.REFUSE and "node rank 1 has joined already, from node1" in payload.decode()
    with pytest.raises(LaunchError, match=r"nodes? 1 did not join node 0 .* within 0.5 s"):
        first.close()
        time.sleep(0.5)
        roster.wait([1], timeout_s=0.5)
    roster.end(7)
    assert answer(second) == (Kind.END, b"7")
