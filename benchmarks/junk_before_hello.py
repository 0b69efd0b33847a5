"""Junk before hello: a good client's ping latency and the daemon's memory while many
peers that never say hello flood the daemon, next to the same client on an idle daemon.

The misbehaving peers (``--peers``, spread over ``--workers`` processes, on the same ipc
endpoint) run bounded loops for ``--seconds``: one in ``--big-every`` sends frames of
``--big-mib`` MiB, the others small junk of three frames; none ever reads a reply.
Prints the good client's ping p50 and p99 idle, under the flood and after it, the p99
ratio (flood / idle), and the daemon's resident memory idle, at its peak under the flood
and after it.  With ``--credentials`` the daemon has a token secret, so its ipc endpoint
is gated (a ZeroMQ handshake that needs a ticket from the side socket): the junk never
gets in, and the good client connects with a token.  With ``--tcp`` the flood and the
good client use a ``tcp://`` endpoint of the daemon instead (with ``--credentials``, one
gated by the token in the ZeroMQ handshake: no side socket over tcp).

    python benchmarks/junk_before_hello.py [--peers 1000] [--seconds 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvstore import Client
from kvstore.auth import issue_token, read_secret

FLOODER = r"""
import os, sys, time, zmq
endpoint, seconds = sys.argv[1], float(sys.argv[3])
peers, big_every, big_mib = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
pause = float(sys.argv[6])
ctx = zmq.Context()
socks = []
for i in range(peers):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 4)
    s.connect(endpoint)
    socks.append(s)
big = os.urandom(1 << 20) * big_mib
small = [os.urandom(200), os.urandom(64), os.urandom(64)]
print("ready", flush=True)
sent = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for i, s in enumerate(socks):
        try:
            s.send_multipart([b"\x92\xa4junk", big] if i % big_every == 0 else small,
                             zmq.NOBLOCK, copy=False)
            sent += 1
        except zmq.Again:
            pass
    time.sleep(pause)  # a bounded loop, not a spin: the host has few cores
print(sent, flush=True)
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ping_times(client: Client, count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        client.ping()
        out.append(time.perf_counter() - start)
    return out


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--big-every", type=int, default=50)
    parser.add_argument("--big-mib", type=int, default=8)
    parser.add_argument("--pause-ms", type=float, default=20.0,
                        help="each flooder's pause between rounds over its peers")
    parser.add_argument("--nice", type=int, default=19,
                        help="the flooders' niceness: on a host of few cores, flooders "
                             "at the daemon's priority measure the CPU scheduler")
    parser.add_argument("--pings", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--credentials", action="store_true",
                        help="give the daemon a token secret (a gated ipc endpoint)")
    parser.add_argument("--tcp", action="store_true",
                        help="flood and ping over a tcp endpoint (gated by the token with "
                             "--credentials)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvbench-"))
    ipc = f"ipc://{work}/kvstore.sock"
    extra, token = [], None
    endpoint = ipc
    if args.tcp:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        extra = ["--extra-endpoint", endpoint]
    if args.credentials:
        secret = work / "secret"
        secret.write_text("ab" * 32)
        (work / "auth.toml").write_text(f'[auth]\nsecret_file = "{secret}"\n')
        extra += ["--config", str(work / "auth.toml")]
        token = issue_token(read_secret(secret), "acme", 3600)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", ipc,
         "--dram-capacity", "64MiB", "--ssd-capacity", "0", "--log-level", "error", *extra],
        stdout=subprocess.PIPE)
    assert daemon.stdout is not None
    while b"serving on" not in daemon.stdout.readline():
        pass
    rows = []
    try:
        with Client(endpoint, tenant="acme", token=token, map_arena=False) as client:
            for _ in range(args.rounds):
                idle = ping_times(client, args.pings)
                rss_idle = rss_mib(daemon.pid)
                per = args.peers // args.workers
                flooders = [subprocess.Popen(
                    ["nice", "-n", str(args.nice), sys.executable, "-c", FLOODER, endpoint, str(per), str(args.seconds),
                     str(args.big_every), str(args.big_mib), str(args.pause_ms / 1e3)],
                    stdout=subprocess.PIPE, text=True) for _ in range(args.workers)]
                for f in flooders:
                    assert f.stdout is not None and f.stdout.readline().strip() == "ready"
                cpu_before = cpu_seconds(daemon.pid)
                started = time.monotonic()
                peak = [rss_idle]
                done = threading.Event()

                def watch() -> None:
                    while not done.wait(0.05):
                        peak[0] = max(peak[0], rss_mib(daemon.pid))

                watcher = threading.Thread(target=watch)
                watcher.start()
                flood: list[float] = []
                while all(f.poll() is None for f in flooders):
                    flood += ping_times(client, 50)
                sent = 0
                for f in flooders:
                    out, _ = f.communicate(timeout=60)
                    sent += int(out.split()[-1])
                done.set()
                watcher.join()
                cpu_share = (cpu_seconds(daemon.pid) - cpu_before) / (time.monotonic() - started)
                time.sleep(2.0)
                after = ping_times(client, args.pings)
                rows.append((pct(idle, 0.5), pct(idle, 0.99), pct(flood, 0.5),
                             pct(flood, 0.99), pct(after, 0.99), rss_idle, peak[0],
                             rss_mib(daemon.pid), sent, len(flood), cpu_share))
                r = rows[-1]
                print(f"idle p50 {r[0]:.3f} ms p99 {r[1]:.3f} ms | flood p50 {r[2]:.3f} ms "
                      f"p99 {r[3]:.3f} ms ({r[9]} pings) | after p99 {r[4]:.3f} ms | "
                      f"p99 flood/idle {r[3] / r[1]:.2f}x | rss idle {r[5]:.0f} MiB, "
                      f"peak {r[6]:.0f} MiB, after {r[7]:.0f} MiB | junk messages sent {r[8]}, "
                      f"daemon cpu under the flood {r[10]:.0%}",
                      flush=True)
            client.ping()
        med = [statistics.median(r[i] for r in rows) for i in range(8)]
        print(f"median of {len(rows)} rounds, {args.peers} peers: idle p99 {med[1]:.3f} ms, "
              f"flood p99 {med[3]:.3f} ms, ratio {med[3] / med[1]:.2f}x; daemon rss idle "
              f"{med[5]:.0f} MiB, peak {med[6]:.0f} MiB (+{med[6] - med[5]:.0f}), after "
              f"{med[7]:.0f} MiB")
    finally:
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
