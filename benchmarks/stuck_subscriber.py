"""What a subscriber that never reads costs the others on the KV event stream.

A real ``EventPublisher`` sends batches of ``--bytes`` bytes, ``--gap-ms`` apart, to two
subscribers in another process: one reads everything as it comes, one subscribes and
never reads (a one-message queue, a 4 KiB socket buffer).  Prints, for each run, the
batches sent, what the publisher counted (``lossy_batches``: refused by a full queue,
sent to the others; ``dropped``: sent to nobody) and the batches each subscriber got;
then the medians.  Run it against another version with ``PYTHONPATH=DIR`` (a source
tree: ``git archive <commit> | tar -x -C DIR``) to compare.

    python benchmarks/stuck_subscriber.py [--runs N] [--batches N] [--queue N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore.config import EventsConfig
from kvstore.events import EventPublisher
from kvstore.store import BlockStore

SUBSCRIBERS = r"""
import sys, zmq
ctx = zmq.Context()
def sub(stuck):
    s = ctx.socket(zmq.SUB)
    if stuck:
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(sys.argv[1])
    return s
healthy, stuck = sub(False), sub(True)
print("ready", flush=True)
got = 0
while healthy.poll(3000):               # until the publisher has stopped a while
    frames = healthy.recv_multipart()
    got += int.from_bytes(frames[1], "big") >= 0
held = 0
while stuck.poll(300):                  # what the stuck one's queue and buffers held
    stuck.recv_multipart()
    held += 1
print(got, held, flush=True)
"""


def run(work: Path, batches: int, size: int, gap: float, queue: int) -> dict[str, int]:
    endpoint = f"ipc://{work}/pub.sock"
    store = BlockStore(1 << 20, 1 << 20)
    pub = EventPublisher(EventsConfig(endpoint=endpoint, queue_batches=queue), store)
    loop = asyncio.new_event_loop()
    pub.open(loop)
    subs = subprocess.Popen([sys.executable, "-c", SUBSCRIBERS, endpoint],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert subs.stdout is not None
        subs.stdout.readline()
        deadline = time.monotonic() + 10
        while not pub.listened():  # (both subscribe to b"": one subscription to read)
            assert time.monotonic() < deadline, "no subscription arrived"
            time.sleep(0.01)
        time.sleep(0.5)  # the second subscriber's too
        payload = b"\x90" * size
        for _ in range(batches):
            pub.send(payload, 1, True)
            time.sleep(gap)
        got, held = (int(x) for x in subs.stdout.readline().split())
        stats = pub.stats()
        return {"sent": batches, "lossy_batches": stats.get("lossy_batches", 0),
                "dropped": stats["dropped"], "healthy_got": got, "stuck_got": held}
    finally:
        subs.kill()
        subs.wait()
        pub.close()
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=20000)
    parser.add_argument("--gap-ms", type=float, default=0.5)
    parser.add_argument("--queue", type=int, default=4, help="queue_batches")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            row = run(Path(tmp), args.batches, args.bytes, args.gap_ms / 1e3, args.queue)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            rows.append(row)
    print("median " + " ".join(f"{k}={statistics.median(r[k] for r in rows):g}"
                               for k in rows[0]))


if __name__ == "__main__":
    main()
