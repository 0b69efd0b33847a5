"""A soak of the restart harness: seeds of kills and clean stops under a mixed load.

The harness of ``tests/reliability/restarts.py``, once per seed: ``--clients`` worker
processes of three tenants on two block sizes (16 and 32 KiB) against a daemon
(``--debug-invariants``, DRAM and SSD tiers of a few tens of MiB, write-back or
write-through by seed, tenant weights and a DRAM quota by seed, Redis in the given
write policy with ``--redis``), ``--rounds`` rounds each ended by a SIGKILL or a clean
stop and a restart on the same workdir, every restart checked.  Prints each seed's
figures (rounds, faults, operations, blocks verified, what a clean stop brought back)
and exits 1 if any seed found a problem.  Not a CI test; the CI-sized run is
tests/reliability/test_restarts_s56.py.

    python benchmarks/restart_soak.py [--seeds 1 2 3] [--rounds 6] [--clients 4]
                                      [--ssd 16MiB] [--redis write-back|write-through]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "reliability"))

from restarts import RestartConfig, Restarts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--dram", default="32MiB")
    ap.add_argument("--ssd", default="16MiB")
    ap.add_argument("--redis", choices=["write-back", "write-through"], default="")
    ap.add_argument("--dir", type=Path, default=None, help="workdir (default: a temp dir)")
    args = ap.parse_args()

    failed = 0
    for seed in args.seeds:
        workdir = (args.dir or Path(tempfile.mkdtemp(prefix="kvstore-restarts-"))) / str(seed)
        config = RestartConfig(seed=seed, rounds=args.rounds, clients=args.clients,
                               dram=args.dram, ssd=args.ssd, redis=args.redis)
        started = time.monotonic()
        harness = Restarts(workdir, config, say=print)
        try:
            report = harness.run()
        finally:
            if args.dir is None:
                shutil.rmtree(workdir.parent, ignore_errors=True)
        print(f"seed {seed}: ssd {harness.policy}, ssd slabs {harness.ssd_slab}, tenant "
              f"weights {harness.weighted}, redis {args.redis or 'none'}: "
              f"{time.monotonic() - started:.0f}s")
        print("\n".join(report.lines()))
        for problem in report.problems[:20]:
            print(f"  PROBLEM {problem}")
        failed += bool(report.problems)
    print(f"restarts: {len(args.seeds) - failed} of {len(args.seeds)} seeds passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
