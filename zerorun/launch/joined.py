"""Node 0's side when every node runs its own launcher: the nodes that joined, and a transport for each.

    roster = Roster(role, secret, expected, say)      # listens on the port after the rendezvous'
    roster.start()
    members = roster.wait([1, 2, 3], timeout_s)       # every other node's launcher has joined
    transport = JoinedTransport(members[1], job_id, kill_grace_s)   # the supervisor drives it as any node

A joining launcher proves the job's secret (`link.admit`) and says who it is (`link.Hello`); node 0
admits it when it runs the same job the same way (node count, recipe, versions) and its node rank
and host are its own, else refuses it with the reason (`Kind.REFUSE`) and says so too. The listener
stays open for the job's whole life: a node lost between attempts (a pod replaced) joins again
under its node rank, and the next attempt waits for it.

One thread (`_Hub`) serves every link: it reads the frames and hands each to the attempt's transport
of that node (its output lines into the pipes the supervisor reads, its exit status), sends every
link a heartbeat each second, and cuts a link silent for `HEARTBEAT_TIMEOUT_S`. A link that closes
or goes silent while its node runs is a lost node (`JoinedTransport.lost_link`), reported as over
SSH: "lost contact with HOST".
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from zerorun.errors import LaunchError
from zerorun.launch.link import Attempt, Hello, Kind, Link, LinkError, admit
from zerorun.launch.node import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S
from zerorun.launch.node_output import Intake
from zerorun.launch.node_role import NodeRole
from zerorun.launch.plan import NodeCommand
from zerorun.launch.processes import KILL_WAIT_S
from zerorun.launch.transport import SILENT_S, Transport

MAX_JOINING = 64  # connections proving themselves at once; more wait in the kernel's backlog
LINK_CLOSED = 255  # what poll() says of a node whose link closed (ssh's status for a lost connection)
_EXIT_WAIT_S = 5.0
_PROGRESS_S = 30.0  # while waiting for nodes to join: how often to say which
_END_WAIT_S = 2.0  # at the job's end: how long the nodes have to close their links once told


@dataclass(frozen=True)
class Expected:
    """What a joining node must match: node 0's own."""

    nnodes: int
    recipe: str  # digest
    versions: Mapping[str, str]
    host: str  # node 0's host name


@dataclass
class Member:
    """A node's launcher that joined: its hello and link, and the transport of the attempt it runs (if any)."""

    hello: Hello
    link: Link
    sink: JoinedTransport | None = None


@dataclass
class _Refusal:
    peer: str
    reason: str
    at: float = field(default_factory=time.monotonic)


class Roster:
    """Node 0's listener and the nodes that joined it, by node rank."""

    def __init__(self, role: NodeRole, secret: str, expected: Expected, say: Callable[[str], None]) -> None:
        self.role = role
        self.expected = expected
        self._secret = secret
        self._say = say
        self._members: dict[int, Member] = {}
        self._dropped: dict[int, str] = {}  # node rank -> why it may not join again
        self._lock = threading.Condition()
        self._joining = threading.BoundedSemaphore(MAX_JOINING)
        self._listener: socket.socket | None = None
        self._hub = _Hub(self)
        self._closed = False

    def start(self) -> None:
        """Listen on the link port (every interface: the secret is what keeps others out)."""
        try:
            self._listener = socket.create_server(("", self.role.link_port), backlog=256, reuse_port=False)
        except OSError as exc:
            raise LaunchError(f"node 0 cannot listen on port {self.role.link_port} (the port after "
                              f"{self.role.origins.get('master_port', f'the rendezvous port {self.role.master_port}')}"
                              f"), where the other nodes' launchers join: {exc.strerror or exc}. Pick another "
                              "rendezvous port with --master-port (or MASTER_PORT) on every node.") from None
        threading.Thread(target=self._accept, name="zerorun-join", daemon=True).start()
        self._hub.start()

    @property
    def address(self) -> str:
        return f"{self.role.master_addr}:{self.role.link_port}"

    # -- joining -----------------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            self._joining.acquire()
            threading.Thread(target=self._admit, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True).start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            admit(sock, self._secret)
            link = Link(sock, peer)
            hello = _read_hello(link)
            problem = self._problem(hello)
            if problem:
                self._refused(peer, f"node {hello.node_rank} ({hello.host}): {problem}")
                link.send(Kind.REFUSE, problem.encode())
                link.finish()
                return
            member = Member(hello, link)
            with self._lock:
                self._members[hello.node_rank] = member
                self._lock.notify_all()
            self._hub.add(member)
        except LinkError as exc:
            sock.close()
            self._refused(peer, str(exc))
        finally:
            self._joining.release()

    def _problem(self, hello: Hello) -> str:
        """Why this node may not join ('' when it may)."""
        expected = self.expected
        if hello.nnodes != expected.nnodes:
            return f"it was started for {hello.nnodes} nodes, node 0 for {expected.nnodes}: give every node the same --nnodes"
        if not 0 < hello.node_rank < expected.nnodes:
            return f"node rank {hello.node_rank} is not one of 1..{expected.nnodes - 1} (node 0 is {expected.host})"
        if hello.node_rank in self._dropped:
            return self._dropped[hello.node_rank]
        if hello.recipe != expected.recipe:
            return "its recipe differs from node 0's: give every node the same recipe file and --set overrides"
        versions = [f"{name} {hello.versions.get(name)} (node 0: {version})" for name, version in expected.versions.items()
                    if hello.versions.get(name) != version]
        if versions:
            return "other versions than node 0's: " + ", ".join(versions)
        with self._lock:
            live = {rank: m for rank, m in self._members.items() if not m.link.closed}
        if hello.node_rank in live:
            return f"node rank {hello.node_rank} has joined already, from {live[hello.node_rank].hello.host}"
        taken = {m.hello.host for rank, m in live.items() if rank != hello.node_rank} | {expected.host}
        if hello.host in taken:
            return (f"another node has the host name {hello.host}: each node needs its own (it names the node's "
                    "[host:rank] lines and its processes)")
        return ""

    def _refused(self, peer: str, reason: str) -> None:
        self._say(f"refused a launcher at {peer}: {reason}")

    def drop(self, node_rank: int, why: str) -> None:
        """Node `node_rank` is out of the job (a shrunken restart): it may not join again."""
        self._dropped[node_rank] = why

    def wait(self, ranks: Sequence[int], timeout_s: float) -> dict[int, Member]:
        """Every node of `ranks` joined with a live link, within `timeout_s`; LaunchError naming the missing ones."""
        deadline = time.monotonic() + timeout_s
        said = time.monotonic()
        with self._lock:
            while True:
                missing = [r for r in ranks if r not in self._members or self._members[r].link.closed]
                if not missing:
                    return {r: self._members[r] for r in ranks}
                now = time.monotonic()
                if now > deadline:
                    raise LaunchError(f"{_nodes(missing)} did not join node 0 at {self.address} within "
                                      f"{timeout_s:g} s (launch.join_timeout_s): is each started with the same "
                                      f"recipe, --nnodes {self.role.nnodes}, its own --node-rank, and "
                                      f"--master-addr {self.role.master_addr} --master-port {self.role.master_port}?")
                if now - said >= _PROGRESS_S:
                    said = now
                    self._say(f"waiting for {_nodes(missing)} to join at {self.address} "
                              f"({deadline - now:.0f} s left)")
                self._lock.wait(timeout=1.0)

    def host_of(self, node_rank: int) -> str:
        return self.expected.host if node_rank == 0 else self._members[node_rank].hello.host

    def rank_of(self, host: str) -> int:
        if host == self.expected.host:
            return 0
        return next(rank for rank, member in self._members.items() if member.hello.host == host)

    def end(self, exit_code: int) -> None:
        """The job is over: tell every node still joined its exit status, then stop listening."""
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            members = list(self._members.values())
        for member in members:
            member.link.send(Kind.END, str(exit_code).encode())
        with self._lock:  # closing first, with their beats unread, would reset the links before they read it
            self._lock.wait_for(lambda: all(m.link.closed for m in members), timeout=_END_WAIT_S)
        self._hub.stop()

    def closed(self, member: Member) -> None:
        """The hub let go of `member`'s link (it closed, or went silent)."""
        with self._lock:
            self._lock.notify_all()
        sink = member.sink
        if sink is not None:
            sink.link_closed()


def _nodes(ranks: Sequence[int]) -> str:
    return f"node{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _read_hello(link: Link) -> Hello:
    deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S
    while time.monotonic() < deadline and not link.closed:
        for kind, payload in link.receive(0.5):
            if kind is Kind.HELLO:
                return Hello.decode(payload)
    raise LinkError("it proved the secret but did not say which node it is")


class _Hub:
    """One thread for every link: frames to the roster, heartbeats out, silent links cut."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self._selector = selectors.DefaultSelector()
        self._intake: Intake[Member] = Intake()
        self._members: list[Member] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="zerorun-links", daemon=True)

    def start(self) -> None:
        self._selector.register(self._intake.socket, selectors.EVENT_READ, data=None)
        self._thread.start()

    def add(self, member: Member) -> None:
        self._intake.put(member)

    def stop(self) -> None:
        self._stopping = True
        self._intake.wake()
        self._thread.join(timeout=2.0)

    def _serve(self) -> None:
        next_beat = time.monotonic()
        while not self._stopping:
            for key, _ in self._selector.select(timeout=max(0.0, next_beat - time.monotonic())):
                if key.data is None:
                    self._take_added()
                else:
                    self._read(key.data)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                self._beat()
        for member in list(self._members):
            self._release(member)
        self._selector.close()
        self._intake.close()

    def _take_added(self) -> None:
        for member in self._intake.take():
            self._members.append(member)
            self._selector.register(member.link.sock, selectors.EVENT_READ, data=member)

    def _read(self, member: Member) -> None:
        for kind, payload in member.link.read_ready():
            sink = member.sink
            if sink is not None:
                sink.received(kind, payload)
        if member.link.closed:
            self._release(member)

    def _beat(self) -> None:
        for member in list(self._members):
            if member.link.silent_s() > HEARTBEAT_TIMEOUT_S or not member.link.send(Kind.BEAT):
                self._release(member)

    def _release(self, member: Member) -> None:
        self._members.remove(member)
        self._selector.unregister(member.link.sock)
        member.link.release()
        self.roster.closed(member)


class JoinedTransport(Transport):
    """One attempt on a node whose launcher joined: the supervisor's view of it, as of any node."""

    heartbeats = True

    def __init__(self, member: Member, job_id: str, kill_grace_s: float, attempt: Callable[[NodeCommand], Attempt]):
        super().__init__(member.hello.host, job_id)
        self.member = member
        self.kill_grace_s = kill_grace_s
        self._attempt = attempt  # the node's command -> what the node is told to run
        self._code: int | None = None
        self._lost = False
        self._started = False
        self._hurry = threading.Event()
        self._writers: dict[Kind, int] = {}
        self._write_lock = threading.Lock()

    def start(self, node: NodeCommand) -> tuple[IO[bytes], IO[bytes]]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._writers = {Kind.OUT: out_w, Kind.ERR: err_w}
        self.member.sink = self
        self._started = True
        self.last_heard = time.monotonic()
        if not self.member.link.send(Kind.ATTEMPT, self._attempt(node).encode()):
            self.link_closed()
        return os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")

    def received(self, kind: Kind, payload: bytes) -> None:
        """A frame of this node (the hub's thread)."""
        if kind in (Kind.OUT, Kind.ERR):
            self._write(kind, payload)
        elif kind is Kind.EXIT:
            text = payload.decode("ascii", "replace")
            self._ended(int(text) if text.lstrip("-").isdigit() else 1)

    def link_closed(self) -> None:
        if self._code is None:
            self._lost = True
            self._ended(LINK_CLOSED)

    def _ended(self, code: int) -> None:
        self._code = code
        with self._write_lock:
            for fd in self._writers.values():
                os.close(fd)
            self._writers = {}
        if self.member.sink is self:
            self.member.sink = None

    def _write(self, kind: Kind, data: bytes) -> None:
        with self._write_lock:
            fd = self._writers.get(kind)
            view = memoryview(data)
            while fd is not None and view:
                try:
                    view = view[os.write(fd, view):]
                except OSError:  # the supervisor stopped reading
                    return

    def poll(self) -> int | None:
        return self._code

    def stop(self, grace_s: float) -> int:
        """Ask the node to stop and wait for its exit; cut the link of a node gone silent or hanging."""
        if not self._started or self._code is not None:
            return 0
        self.member.link.send(Kind.STOP)
        deadline = time.monotonic() + grace_s + KILL_WAIT_S + _EXIT_WAIT_S
        hurried = False
        while self._code is None:
            if self.silent_s() > SILENT_S or time.monotonic() > deadline or self.member.link.closed:
                self.member.link.close()  # it ends its node by itself once node 0 is gone
                self.link_closed()
                break
            if self._hurry.is_set() and not hurried:
                hurried = True
                self.member.link.send(Kind.KILL)
            time.sleep(0.05)
        return 1

    def hurry(self) -> None:
        self._hurry.set()

    def request_stop(self) -> None:
        if self._started and self._code is None:
            self.member.link.send(Kind.STOP)

    def lost_link(self, silent_s: float) -> str | None:
        if self._lost:
            return f"lost contact with {self.host}: its launcher's connection to node 0 closed"
        return super().lost_link(silent_s) if self._started else None
