"""How long one tenant's small remote read waits while another tenant's big reads run.

Starts its own redis-server and two daemons on it (no SSD tier): a writer, which puts
tenant A's chains of ``--big-mib`` MiB and tenant B's one-block chains (write-through to
Redis), and a reader, which holds none of them, so every read there is a fetch from the
remote store.  On the reader, ``--heavy`` threads of tenant A acquire their big chains
over and over (evicted after each, so the next reads them again); meanwhile tenant B
acquires one fresh one-block chain at a time and times each.  Printed: B's latency
(median, p90, max) alone, then beside A's reads, and their ratio.

    python benchmarks/remote_fairness.py [--big-mib N] [--heavy N] [--samples N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstore import Client, Identity
from kvstore.errors import NotFoundError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon_proc import DaemonProcess  # type: ignore[import-not-found]  # noqa: E402
from redis_servers import RedisServer  # type: ignore[import-not-found]  # noqa: E402


def identity(tenant: str) -> Identity:  # 1 MiB blocks
    return Identity(model="bench-remote-fair", model_revision="r", tenant=tenant,
                    kv_dtype="float16", num_layers=16, num_kv_heads=8, head_dim=128,
                    block_tokens=16)


def light_reads(endpoint: str, keys: list[bytes]) -> list[float]:
    """B's one-block acquires, each of a block only the remote store holds, in seconds."""
    out = []
    with Client(endpoint, tenant="b") as c:
        ns = c.namespace(identity("b"))
        for key in keys:
            began = time.perf_counter()
            ns.acquire([key]).release()
            out.append(time.perf_counter() - began)
            time.sleep(0.01)
    return out


def heavy_reads(endpoint: str, keys: list[bytes], stop: threading.Event,
                counts: list[int]) -> None:
    with Client(endpoint, tenant="a") as c:
        ns = c.namespace(identity("a"))
        while not stop.is_set():
            try:
                ns.acquire(keys).release()
            except NotFoundError:  # (a read the remote store missed: counted as none)
                continue
            ns.evict(keys)
            counts.append(len(keys))


def figures(samples: list[float]) -> str:
    ms = sorted(s * 1e3 for s in samples)
    return (f"median {statistics.median(ms):7.1f} ms  p90 {ms[int(len(ms) * 0.9)]:7.1f} ms"
            f"  max {ms[-1]:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-mib", type=int, default=64)
    parser.add_argument("--heavy", type=int, default=3)
    parser.add_argument("--samples", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        redis_server = RedisServer(work / "redis")
        redis_server.start()
        dram = f"{max(256, args.big_mib * (args.heavy + 1) + 64)}MiB"
        writer = DaemonProcess(work / "writer", dram_capacity=dram, debug_invariants=False,
                               extra=["--remote", redis_server.url]).start()
        reader = DaemonProcess(work / "reader", dram_capacity=dram, debug_invariants=False,
                               extra=["--remote", redis_server.url]).start()
        try:
            with Client(writer.endpoint, tenant="a") as ca, \
                    Client(writer.endpoint, tenant="b") as cb:
                na, nb = ca.namespace(identity("a")), cb.namespace(identity("b"))
                size = na.block_bytes
                big = [na.keys(range(h * 10**6, h * 10**6 + 16 * (args.big_mib << 20) // size))
                       for h in range(args.heavy)]
                small = [nb.keys(range(i * 1000, i * 1000 + 16))
                         for i in range(2 * args.samples)]
                value = b"\5" * size
                for chain in big:
                    na.put(chain, [value] * len(chain))
                for chain in small:
                    nb.put(chain[:1], [value])
                deadline = time.monotonic() + 30
                want = sum(map(len, big)) + len(small)
                while ca.stats()["remote"]["writes"] < want and time.monotonic() < deadline:
                    time.sleep(0.1)
                for chain in big:
                    na.evict(chain)
            first = [chain[0] for chain in small]
            alone = light_reads(reader.endpoint, first[:args.samples])
            stop, counts = threading.Event(), []
            threads = [threading.Thread(target=heavy_reads,
                                        args=(reader.endpoint, chain, stop, counts))
                       for chain in big]
            for t in threads:
                t.start()
            time.sleep(1.0)
            beside = light_reads(reader.endpoint, first[args.samples:])
            stop.set()
            for t in threads:
                t.join()
            print(f"B's 1-block remote read ({size >> 10} KiB), alone:       {figures(alone)}")
            print(f"beside {args.heavy} x A's {args.big_mib} MiB reads:       "
                  f"{figures(beside)}")
            print(f"ratio of medians {statistics.median(beside) / statistics.median(alone):.1f}"
                  f"; A read {sum(counts) * size >> 20} MiB meanwhile")
        finally:
            reader.stop()
            writer.stop()
            redis_server.stop()


if __name__ == "__main__":
    main()
