"""What peers flooding the event stream's replay socket cost the daemon's other clients.

A real daemon with an event stream and a replay socket (no credentials: anyone who
reaches it asks) is filled with ``--puts`` one-block puts (a batch each, about), then
``--peers`` peers each ask ``--asks`` times for a replay from ``--first`` and read the
whole answer, while a client pings the daemon every 2 ms.  Prints, for each run, the
daemon's CPU per replay request (its process CPU time, not the wall clock) and the
ping round trips (median, 99th percentile, most); then the medians over the runs.
Run it from another version's checkout (or with ``PYTHONPATH=DIR``) to compare.

    python benchmarks/replay_flood.py [--runs N] [--puts N] [--peers N] [--asks N] [--first N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from daemon_proc import DaemonProcess, free_port  # noqa: E402
from kvtest import make_identity  # noqa: E402

from kvstore import Client  # noqa: E402

END = b"\xff" * 8


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(workdir: Path, args: argparse.Namespace) -> tuple[float, list[float]]:
    replay = f"tcp://127.0.0.1:{free_port()}"
    d = DaemonProcess(workdir, debug_invariants=False, env={
        "KVSTORE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
        "KVSTORE_EVENTS_REPLAY_ENDPOINT": replay, "KVSTORE_EVENTS_INTERVAL_MS": "0"}).start()
    ctx = zmq.Context()
    try:
        assert d.proc is not None
        c = Client(d.endpoint, tenant="acme")
        ns = c.namespace(make_identity())
        for _ in range(args.puts):
            ns.put([os.urandom(16)], [b"\0" * ns.block_bytes])
        while c.stats()["events"]["events"] < args.puts + 1:
            time.sleep(0.05)

        def flood() -> None:
            s = ctx.socket(zmq.DEALER)
            s.connect(replay)
            for _ in range(args.asks):
                s.send_multipart([b"", args.first.to_bytes(8, "big")])
                while s.recv_multipart()[1] != END:
                    pass
            s.close(linger=0)

        pings: list[float] = []
        before = process_cpu(d.proc.pid)
        threads = [threading.Thread(target=flood) for _ in range(args.peers)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            start = time.perf_counter()
            c.ping()
            pings.append(time.perf_counter() - start)
            time.sleep(0.002)
        cpu = process_cpu(d.proc.pid) - before
        c.close()
        return cpu / (args.peers * args.asks), sorted(pings)
    finally:
        ctx.term()
        d.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--puts", type=int, default=3000)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--asks", type=int, default=20)
    parser.add_argument("--first", type=int, default=0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            cpu, pings = one_run(Path(tmp) / f"run{run}", args)
            row = (cpu * 1e3, statistics.median(pings) * 1e3,
                   pings[int(len(pings) * 0.99)] * 1e3, pings[-1] * 1e3)
            rows.append(row)
            print("run %d: daemon CPU %.3f ms a replay request; ping median %.2f ms, "
                  "p99 %.1f ms, most %.1f ms (%d pings)" % (run, *row, len(pings)),
                  flush=True)
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    print("medians: daemon CPU %.3f ms a request; ping median %.2f ms, p99 %.1f ms, "
          "most %.1f ms" % tuple(med))


if __name__ == "__main__":
    main()
