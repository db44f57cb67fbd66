"""A socket benchmark for one direction of a link: what a TCP stream delivers, measured at the receiver.

The receiver listens on the destination node, the sender (on the source node) streams 1 MiB
writes for a while; the receiver counts the bytes from its first read to its last, so connection
set-up is not counted and the figure is what arrived, not what was queued.
"""

from __future__ import annotations

import subprocess
import sys

PORT = 5201

_RECEIVER = """
import socket, sys, time
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(sys.argv[1]))); server.listen(1)
print("listening", flush=True)
conn, _ = server.accept()
buf = bytearray(1 << 20); view = memoryview(buf)
got = conn.recv_into(view); first = time.perf_counter(); total = 0; last = first
while True:
    n = conn.recv_into(view)
    if not n:
        break
    total += n; last = time.perf_counter()
print(total * 8 / max(last - first, 1e-9) / 1e9, flush=True)
"""

_SENDER = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
chunk = bytes(1 << 20); end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    conn.sendall(chunk)
conn.close()
"""


class ProbeFailed(RuntimeError):
    pass


def measure(sender_prefix: list[str], receiver_prefix: list[str], receiver_address: str, seconds: float) -> float:
    """Gbit/s delivered from the sender's node to `receiver_address` (commands run through the prefixes)."""
    receiver = subprocess.Popen([*receiver_prefix, sys.executable, "-c", _RECEIVER, str(PORT)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "listening":
            raise ProbeFailed(f"the receiver did not start: {receiver.stderr.read()}")
        sent = subprocess.run([*sender_prefix, sys.executable, "-c", _SENDER, receiver_address, str(PORT),
                               str(seconds)], capture_output=True, text=True, timeout=seconds + 30)
        if sent.returncode != 0:
            raise ProbeFailed(f"the sender failed: {sent.stderr.strip()}")
        out, err = receiver.communicate(timeout=30)
        if receiver.returncode != 0:
            raise ProbeFailed(f"the receiver failed: {err.strip()}")
        return float(out.strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
