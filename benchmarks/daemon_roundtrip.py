"""Side-by-side benchmark of the daemon's control and data planes against their limits.

Runs in one go, each measurement next to its peer, and prints medians and ratios:
- control plane: lookup of a 64-key chain, reserve+commit of 1 and 16 blocks, against a
  bare pyzmq ROUTER/DEALER echo of the same request size (in its own process, like the
  daemon);
- arena plane: reserve+write+commit and acquire+read+release of 256 KiB and 2 MiB blocks,
  against numpy memcpy of the same bytes;
- frame plane: put/get through frames, against raw pyzmq bulk send of the same frames.

    python benchmarks/daemon_roundtrip.py [--repeats N] [--batch N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from kvstore import Client, Identity
from kvstore import protocol as p
from kvstore.bench.harness import EchoPeer, paired  # the echo peer kvstore bench uses

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch-mib", type=int, default=32,
                        help="MiB moved per data-plane call")
    parser.add_argument("--rtt-inner", type=int, default=200)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvbench-"))
    endpoint = f"ipc://{work}/kvstore.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
         "--dram-capacity", "1GiB", "--ssd-capacity", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE)
    peer = EchoPeer().start()
    assert daemon.stdout
    while b"serving on" not in daemon.stdout.readline():
        pass

    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.SNDHWM, 0)
    raw.setsockopt(zmq.RCVHWM, 0)
    raw.connect(peer.endpoint)

    def echo(frames: list[bytes]) -> Callable[[], object]:
        def go() -> object:
            raw.send_multipart(frames, copy=False)
            return raw.recv_multipart()  # into bytes, as the client's get returns
        return go

    rows: list[tuple[str, float, float, str]] = []
    try:
        with Client(endpoint, tenant="bench") as client:
            small = Identity(model="bench", model_revision="r", tenant="bench",
                             kv_dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                             block_tokens=16)
            ns = client.namespace(small)
            chain = ns.keys(range(16 * 64))
            ns.put(chain, [bytes(ns.block_bytes)] * 64)
            look = p.encoder.encode(p.Lookup(1, ns.id, chain))
            t_lookup, t_echo = paired(lambda: ns.lookup(chain), echo([look]), args.repeats,
                                      args.rtt_inner)
            rows.append(("lookup 64 keys (us)", t_lookup * 1e6, t_echo * 1e6, "echo"))

            counter = iter(range(10**9))
            for n in (1, 16):
                # keys hashed ahead: the client's hashing is not the round trip
                fresh = iter([ns.keys(range(i * 16 * n, (i + 1) * 16 * n))
                              for i in range(1, 2 + (args.repeats + 1) * args.rtt_inner // 4)])

                def reserve_commit(fresh: object = fresh) -> None:
                    r = ns.reserve(next(fresh))  # type: ignore[call-overload]
                    r.commit()
                req = p.encoder.encode(p.Reserve(1, ns.id, chain[:n]))
                t_rc, t_e = paired(reserve_commit, echo([req]), args.repeats,
                                   args.rtt_inner // 4)
                rows.append((f"reserve+commit {n} (us)", t_rc * 1e6, 2 * t_e * 1e6,
                             "2x echo"))

            # The peer copies into a rotating region as large as the arena's share, so
            # neither side gets its destination from the cache.
            region = np.ones(512 << 20, dtype=np.uint8)
            for label, heads in (("256KiB", 4), ("2MiB", 32)):
                ident = Identity(model=f"bench-{label}", model_revision="r", tenant="bench",
                                 kv_dtype="float16", num_layers=16, num_kv_heads=heads,
                                 head_dim=128, block_tokens=8)
                bns = client.namespace(ident)
                size = bns.block_bytes
                n = (args.batch_mib << 20) // size
                total = n * size
                src = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(n)]
                dst = [np.empty(size, dtype=np.uint8) for _ in range(n)]
                cursor = [0]

                def tokens(i: int, n: int = n) -> range:
                    return range(i * n * 8, (i + 1) * n * 8)

                def memcpy() -> None:
                    at = cursor[0]
                    for s in src:
                        if at + size > len(region):
                            at = 0
                        np.copyto(region[at:at + size], s)
                        at += size
                    cursor[0] = at

                def arena_put() -> None:
                    keys = bns.keys(tokens(next(counter)))
                    with bns.reserve(keys) as r:
                        for buf, s in zip(r.buffers, src):
                            np.copyto(np.frombuffer(buf, dtype=np.uint8), s)
                        r.commit()

                keys = bns.keys(tokens(next(counter)))
                bns.put(keys, [s.tobytes() for s in src])

                def arena_get() -> None:
                    with bns.acquire(keys) as held:
                        for buf, d in zip(held.buffers, dst):
                            np.copyto(d, np.frombuffer(buf, dtype=np.uint8))

                t_put, t_mem = paired(arena_put, memcpy, args.repeats)
                t_get, t_mem2 = paired(arena_get, memcpy, args.repeats)
                gbs = lambda t: total / t / 1e9  # noqa: E731
                rows.append((f"arena write {label} (GB/s)", gbs(t_put), gbs(t_mem), "memcpy"))
                rows.append((f"arena read {label} (GB/s)", gbs(t_get), gbs(t_mem2), "memcpy"))

                payload = [s.tobytes() for s in src]

                def frame_put() -> None:
                    bns.put(bns.keys(tokens(next(counter))), payload)

                def frame_get() -> None:
                    bns.get(keys)

                t_fput, t_sink = paired(frame_put, echo([b"sink", *payload]), args.repeats)
                t_fget, t_source = paired(frame_get, echo([f"source {n} {size}".encode()]),
                                          args.repeats)
                rows.append((f"frame put {label} (GB/s)", gbs(t_fput), gbs(t_sink), "raw zmq"))
                rows.append((f"frame get {label} (GB/s)", gbs(t_fget), gbs(t_source),
                             "raw zmq"))
                bns.drop()
                client.stats()
    finally:
        raw.close()
        ctx.term()
        daemon.terminate()
        daemon.wait()
        peer.stop()
        daemon.stdout.close()

    print(f"kvstore daemon vs peers: medians of {args.repeats} runs, {args.batch_mib} MiB "
          f"per data-plane call")
    print(f"{'measure':30} {'kvstore':>10} {'peer':>10} {'peer is':>10} {'ratio':>7}")
    for name, ours, peer_value, peer_name in rows:
        ratio = ours / peer_value
        print(f"{name:30} {ours:10.2f} {peer_value:10.2f} {peer_name:>10} {ratio:7.2f}")
    print("latency rows: ratio = kvstore time / peer time (target <= 2.0 against echo)")
    print("bandwidth rows: ratio = kvstore GB/s / peer GB/s (target >= 0.70 against memcpy)")


if __name__ == "__main__":
    main()
