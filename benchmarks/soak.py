"""A soak of the chaos harness: clients under load, clients and the daemon SIGKILLed.

The harness of ``tests/reliability/chaos.py`` for ``--minutes`` (default 10): ``--clients``
worker processes do mixed lookup / put / reserve+commit / reserve+abort / acquire+release /
get / evict against a daemon (``--debug-invariants``, small DRAM over an SSD tier in
write-through mode, 2 s leases); a random client is SIGKILLed every few seconds and
replaced, and the daemon is SIGKILLed and restarted on the same workdir about once a
minute.  At the end it prints operations done, faults injected, blocks verified and the
p50/p99 latency of each verb, and exits 1 if any block read back wrong, a durable block
was lost, a lease outlived its deadline, something stayed held or an invariant broke.
Not a CI test; the CI-sized run is tests/reliability/test_reliability_chaos.py.

    python benchmarks/soak.py [--minutes 10] [--clients 8] [--daemon-kill-every 60]
                              [--lease 2] [--seed N] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "reliability"))

from chaos import Chaos, ChaosConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--daemon-kill-every", type=float, default=60.0, metavar="SECONDS")
    ap.add_argument("--client-kill-every", type=float, nargs=2, default=(1.0, 3.0),
                    metavar=("MIN", "MAX"))
    ap.add_argument("--lease", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--dir", type=Path, default=None, help="workdir (default: a temp dir)")
    args = ap.parse_args()

    seconds = args.minutes * 60
    config = ChaosConfig(
        clients=args.clients, seconds=seconds,
        daemon_kills=max(1, int(seconds / args.daemon_kill_every)),
        client_kill_every=tuple(args.client_kill_every), lease=args.lease, seed=args.seed)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="kvstore-soak-"))
    print(f"soak: {args.minutes:g} min, {config.clients} clients, {config.daemon_kills} "
          f"daemon kills, lease {config.lease:g}s, workdir {workdir}", flush=True)
    started = time.monotonic()
    try:
        report = Chaos(workdir, config,
                       say=lambda line: print(line.replace("chaos:", "soak:", 1), flush=True)).run()
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n".join(line.replace("chaos:", "soak:", 1) for line in report.lines()))
    problems = report.problems()
    print(f"soak: {'FAILED' if problems else 'passed'} in {time.monotonic() - started:.0f}s")
    for problem in problems:
        print(f"soak:   {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
