"""``kvstore bench``: the side-by-side suite, for anyone who installed kvstore.

Each section measures a plane of the daemon next to the limit of what it is built on,
in one run, samples interleaved, and reports medians and their ratio:

- ``control``: lookup of a 64-key chain, reserve+commit of 1 and 16 blocks, and
  pipelined lookups, against a bare pyzmq ROUTER/DEALER echo in its own process;
- ``arena``: writing and reading 16 blocks of 256 KiB and 2 MiB through the shared
  arena, against memcpy;
- ``frames``: put and get of the same blocks in message frames, against raw pyzmq;
- ``sweeps``: lookup latency against chain length (1..4096) and lookups per second
  against concurrent clients (1..64), each beside the echo's;
- ``ssd``: write-back and promotion through a daemon with an SSD tier, against raw
  O_DIRECT pwrite/pread on the same filesystem (a daemon of its own);
- ``remote``: put and get through a daemon with a Redis remote tier, against redis-py
  SET/GET on the same server (``--redis URL``, or a redis-server it starts);
- ``replay``: a trace (``--trace FILE``) replayed through daemons of several
  capacities: the hit rate against its eviction policy simulated in-process, and an
  infinite cache.

The first four run against ``--endpoint`` or a daemon it starts in a temporary
directory (removed afterwards); ssd, remote and replay always start daemons of their
own, as they need a tier layout of their own.  ``--against lmcache`` measures LMCache's
multiprocess server through LMCache's own client with the same definitions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

SECTIONS = ("control", "arena", "frames", "sweeps", "ssd", "remote", "replay")
DEFAULT_SECTIONS = ("control", "arena", "frames")
ON_DAEMON = ("control", "arena", "frames", "sweeps")  # on --endpoint or one it starts
# progress steps per section
STEPS = {"control": 5, "arena": 2, "frames": 2, "sweeps": 2, "ssd": 2, "remote": 2,
         "replay": 1}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``kvstore`` command's subparsers."""
    bench: argparse.ArgumentParser = sub.add_parser(
        "bench", help="measure the daemon side by side with its limits",
        description="Measure the daemon side by side with the limits it is built on (a "
                    "bare pyzmq echo, memcpy, raw pyzmq frames, raw O_DIRECT, redis-py) "
                    "and print medians and ratios.")
    bench.add_argument("sections", nargs="*", metavar="SECTION",
                       help=f"any of {', '.join(SECTIONS)}, or all (default: "
                            f"{' '.join(DEFAULT_SECTIONS)}, with sweeps for --plot and "
                            "replay for --trace)")
    bench.add_argument("--endpoint", help="measure this running daemon (default: start one "
                       "in a temporary directory)")
    bench.add_argument("--tenant", default="bench", help="the tenant to measure as")
    bench.add_argument("--token", help="a tenant token, where the daemon checks them")
    bench.add_argument("--quick", action="store_true", help="a short run (fewer samples)")
    bench.add_argument("--repeat", type=int, metavar="N",
                       help="samples per measurement (default: 3 quick, 15 otherwise)")
    bench.add_argument("--json", action="store_true",
                       help="print the JSON document (see kvstore.bench.report)")
    bench.add_argument("--plot", type=Path, metavar="DIR",
                       help="write PNG charts into DIR (needs the 'plot' extra)")
    bench.add_argument("--dir", type=Path, help="where its files go (ssd: the filesystem "
                       "measured; default: the system's temporary directory)")
    bench.add_argument("--redis", metavar="URL",
                       help="remote section: this Redis server (default: start a "
                            "redis-server if one is installed)")
    bench.add_argument("--trace", type=Path, metavar="FILE",
                       help="replay section: a JSON-lines trace of prefix-block ids")
    bench.add_argument("--block-tokens", type=int, metavar="N",
                       help="replay section: the trace's tokens per block (default: 512, "
                            "or the size its lengths and ids fit)")
    bench.add_argument("--against", choices=["lmcache"], action="append", default=[],
                       help="also measure LMCache's multiprocess server with the same "
                            "definitions (a 64-key lookup; 16 blocks of 256 KiB and 2 MiB "
                            "stored and loaded)")
    bench.add_argument("--lmcache-python", type=Path, metavar="PATH",
                       help="--against lmcache: the Python of an environment where "
                            "LMCache is installed (default: this one)")
    bench.add_argument("--timeout", type=float, default=30.0,
                       help="seconds to wait for a reply")
    bench.set_defaults(func=run, bench_parser=bench)
    return bench


def _sections(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The sections to run, in the suite's order; a clear error for an unknown one."""
    asked = list(args.sections)
    unknown = [s for s in asked if s not in (*SECTIONS, "all")]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(SECTIONS)} or all")
    if "all" in asked:
        chosen = set(SECTIONS)
    elif asked:
        chosen = set(asked)
    else:
        chosen = set(DEFAULT_SECTIONS)
        if args.plot is not None:
            chosen.add("sweeps")
        if args.trace is not None:
            chosen.add("replay")
    return [s for s in SECTIONS if s in chosen]


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser,
           sections: list[str]) -> None:
    """Refuse bad arguments before anything starts."""
    if args.repeat is not None and args.repeat < 1:
        parser.error(f"--repeat must be at least 1, not {args.repeat}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):  # (nan is not <= 0)
        parser.error("--timeout must be a finite number of seconds above 0")
    if args.trace is not None and not args.trace.is_file():
        parser.error(f"--trace: no such file: {args.trace}")
    if args.block_tokens is not None and args.block_tokens < 1:
        parser.error(f"--block-tokens must be at least 1, not {args.block_tokens}")
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir: no such directory: {args.dir}")
    if args.lmcache_python is not None and not os.access(args.lmcache_python, os.X_OK):
        parser.error(f"--lmcache-python: not an executable: {args.lmcache_python}")
    if args.lmcache_python is not None and "lmcache" not in args.against:
        parser.error("--lmcache-python goes with --against lmcache")
    if args.endpoint is not None and not args.endpoint.startswith(("ipc://", "tcp://")):
        parser.error(f"--endpoint must be ipc://PATH or tcp://HOST:PORT, not "
                     f"{args.endpoint!r}")
    if args.redis is not None and not args.redis.startswith(("redis://", "rediss://")):
        parser.error(f"--redis must be a redis:// URL, not {args.redis!r}")
    if args.plot is not None:
        if args.plot.exists() and not args.plot.is_dir():
            parser.error(f"--plot: {args.plot} exists and is not a directory")
        from kvstore.bench.plots import missing_library

        why = missing_library()
        if why:
            parser.error(f"--plot: {why}")
        # made now: one that cannot be was a traceback once every section had run
        try:
            args.plot.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--plot: cannot make the directory {args.plot}: {exc.strerror}")
        if not os.access(args.plot, os.W_OK | os.X_OK):
            parser.error(f"--plot: {args.plot} is not a directory this user may write in")


def run(args: argparse.Namespace) -> int:
    """Run the sections asked for; print the table or the JSON document."""
    parser: argparse.ArgumentParser = args.bench_parser
    sections = _sections(args, parser)
    _check(args, parser, sections)
    repeat = args.repeat or (3 if args.quick else 15)

    from kvstore.bench.harness import Progress, Results

    results = Results()
    lmcache = "lmcache" in args.against
    total = sum(STEPS[s] for s in sections) + lmcache
    if args.endpoint is None and (lmcache or set(sections) & set(ON_DAEMON)):
        total += 1  # starting the daemon
    progress = Progress(total)
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir))
    try:
        _run_sections(args, sections, repeat, work, results, progress)
    finally:
        progress.finish()
        shutil.rmtree(work, ignore_errors=True)
    plots: list[str] = []
    code = 0
    if args.plot is not None:
        from kvstore.bench.plots import write_plots

        try:
            plots = [str(p) for p in write_plots(results, args.plot)]
        except OSError as exc:  # (the figures are still printed below)
            print(f"kvstore bench: --plot: cannot write the charts in {args.plot}: "
                  f"{exc.strerror}", file=sys.stderr)
            code = 1
    from kvstore.bench.report import document, table

    if args.json:
        doc = document(results, daemon=args.endpoint or "started", quick=args.quick,
                       repeat=repeat, sections=sections, plots=plots)
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(table(results))
        for path in plots:
            print(f"wrote {path}")
    return code


def _run_sections(args: argparse.Namespace, sections: list[str], repeat: int, work: Path,
                  results: Any, progress: Any) -> None:
    from kvstore.bench import planes
    from kvstore.bench.harness import Daemon, EchoPeer, Settings

    on_daemon = [s for s in sections if s in ON_DAEMON]
    lmcache = "lmcache" in args.against
    if on_daemon or lmcache:
        daemon = None
        echo = EchoPeer().start()
        try:
            endpoint = args.endpoint
            if endpoint is None:
                progress.step("starting a daemon")
                daemon = Daemon(work / "daemon", dram="256MiB" if args.quick else "1GiB")
                endpoint = daemon.start().endpoint
                progress.advance()
            s = Settings(endpoint=endpoint, echo=echo.endpoint, workdir=work, repeat=repeat,
                         quick=args.quick, tenant=args.tenant, token=args.token,
                         timeout=args.timeout)
            for name in on_daemon:
                getattr(planes, name)(s, results, progress)
            if lmcache:
                from kvstore.bench.lmcache_peer import against_lmcache

                python = str(args.lmcache_python) if args.lmcache_python else None
                against_lmcache(s, python, results, progress)
        finally:
            echo.stop()
            if daemon is not None:
                daemon.stop()
    if "ssd" in sections:
        from kvstore.bench.disk import ssd

        ssd(work, repeat, args.quick, results, progress)
    if "remote" in sections:
        from kvstore.bench.remote_store import remote

        remote(work, repeat, args.quick, args.redis, results, progress)
    if "replay" in sections:
        if args.trace is None:
            results.skipped["replay"] = "no --trace FILE given"
            progress.note("replay: skipped, no --trace FILE given")
        else:
            from kvstore.bench.replay import replay_section

            replay_section(work, args.trace, args.quick, results, progress,
                           block_tokens=args.block_tokens)
