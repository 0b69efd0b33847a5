"""The frame plane's peers: a bare pyzmq ROUTER in its own process (as the daemon is) that
takes bulk frames and drops them (``sink``: raw pyzmq, the goal's limit), takes them and
copies them into a shared mapping before it answers (``store``: the least a put must do
before its ack, for its blocks are then readable from the arena), or sends N blocks of
shared memory (``source N SIZE``: distinct blocks, as a get's are, not one block N times
from the cache).

Its C allocator keeps freed receive buffers as the daemon's does
(``kvstore.transport.keep_receive_buffers``): a peer that faulted each message's pages in
anew would do more than the daemon for the same frames, and flatter it.
"""

from __future__ import annotations

from kvstore.bench.harness import PeerProcess

FRAME_PEER = r"""
import mmap, os, sys, zmq
from kvstore.transport import keep_receive_buffers
keep_receive_buffers()
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.SNDHWM, 0); sock.setsockopt(zmq.RCVHWM, 0)
sock.bind(sys.argv[1])
size = int(sys.argv[2])
fd = os.memfd_create("kvstore-bench-store")  # the arena's kind of memory, its pages touched
os.ftruncate(fd, size)
region = memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
cursor = 0

def serve_one():
    # read and answer as the daemon's transport does (each frame's more flag), and let go
    # of the frames on return, as the daemon does once it has answered
    global cursor
    frames = [sock.recv(copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    head = frames[1].bytes
    if head == b"sink":               # bulk put: take the frames, answer small
        sock.send_multipart([frames[0], b"ok"])
    elif head == b"store":            # bulk put: copy the frames into shared memory first
        for f in frames[2:]:
            n = len(f)
            if cursor + n > size:
                cursor = 0
            region[cursor:cursor + n] = f.buffer
            cursor += n
        sock.send_multipart([frames[0], b"ok"])
    elif head.startswith(b"source"):  # bulk get: answer with N blocks of SIZE, each its
        n, each = map(int, head.split()[1:])  # own bytes in shared memory, as a get's are
        blocks = [region[i * each:(i + 1) * each] for i in range(n)]
        sock.send_multipart([frames[0], b"ok", *blocks], copy=False)

print("ready", flush=True)
while True:
    serve_one()
"""


class FramePeer(PeerProcess):
    """The frame plane's peer process; ``region_bytes`` of shared memory for ``store``
    (as large as the daemon's arena share, so neither copies from cache to cache)."""

    def __init__(self, region_bytes: int) -> None:
        super().__init__(FRAME_PEER, "frames.sock", "frame", str(region_bytes))
        self.region_bytes = region_bytes
