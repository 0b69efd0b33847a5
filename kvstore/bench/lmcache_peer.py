"""``--against lmcache``: kvstore and LMCache's multiprocess server side by side, with
the same definitions: a 64-key (64-chunk) lookup that hits; storing 16 blocks (chunks)
of 256 KiB and of 2 MiB, ack-to-visible; and loading them back into the caller's memory.

kvstore's side runs here against the daemon measured (reserve, write, commit through
the arena; acquire, copy out, release).  LMCache's runs in a subprocess, by the Python
of an environment where it is installed (``--lmcache-python``, else this one), through
LMCache's own client classes: ``kvstore/bench/lmcache_driver.py`` starts ``lmcache
server`` on loopback and prints its figures.  Where LMCache cannot be imported, the
section says so and the run goes on.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.bench.harness import Progress, Results, Row, Settings
from kvstore.bench.planes import LOOKUP_KEYS, SIZES, SizedBlocks, small_identity
from kvstore.client import Client

DRIVER = Path(__file__).with_name("lmcache_driver.py")
PROBE = ("import lmcache.v1.multiprocess.server, "
         "lmcache.cli.commands.bench.server_bench.client")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:  # held open together, so the ports differ
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def lmcache_missing(python: str) -> str | None:
    """Why ``python`` cannot run LMCache's multiprocess server, or None if it can."""
    try:
        probe = subprocess.run([python, "-I", "-c", PROBE], capture_output=True, text=True,
                               timeout=180, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} did not run ({exc})"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"LMCache's multiprocess server is not installed for {python} ({last})"
    return None


def _kvstore_side(s: Settings) -> dict[str, float]:
    """kvstore's figures of the same definitions, against the daemon measured."""
    out: dict[str, float] = {}
    with Client(s.endpoint, tenant=s.tenant, token=s.token, timeout=s.timeout) as client:
        ns = client.namespace(small_identity("lmcache", s.tenant))
        try:
            chain = ns.keys(range(16 * LOOKUP_KEYS))
            ns.put(chain, [bytes(ns.block_bytes)] * LOOKUP_KEYS)
            samples = []
            for _ in range(s.repeat + 1):
                started = time.perf_counter()
                for _ in range(s.inner):
                    if ns.lookup(chain).blocks != LOOKUP_KEYS:
                        raise AssertionError("the daemon lost the lookup's chain")
                samples.append((time.perf_counter() - started) / s.inner)
            out["lookup_64_us"] = statistics.median(samples[1:]) * 1e6
        finally:
            ns.drop()
        for label in SIZES:
            sized = SizedBlocks(client, label, s)
            sized.ahead.clear()  # hash each chain on the clock: LMCache's store hashes too
            try:
                puts, gets = [], []
                for _ in range(s.repeat + 1):
                    started = time.perf_counter()
                    sized.arena_put()
                    puts.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    sized.arena_get()
                    gets.append(time.perf_counter() - started)
                out[f"store_{label}_gbs"] = sized.gbs(statistics.median(puts[1:]))
                out[f"load_{label}_gbs"] = sized.gbs(statistics.median(gets[1:]))
            finally:
                sized.ns.drop()
    return out


def against_lmcache(s: Settings, python: str | None, results: Results,
                    progress: Progress) -> None:
    """Both sides' figures as rows of section ``lmcache``; or why LMCache did not run."""
    progress.step("lmcache: LMCache's multiprocess server, same definitions")
    python = python or sys.executable
    why = lmcache_missing(python)
    if why is None:
        port, http_port = _free_ports(2)
        log = s.workdir / "lmcache-server.log"
        command = [python, "-I", str(DRIVER), "--port", str(port), "--http-port",
                   str(http_port), "--repeat", str(s.repeat), "--log", str(log)]
        if s.quick:
            command.append("--quick")
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=900,
                                 check=False)
        except subprocess.TimeoutExpired:
            why = "LMCache's side ran past 900 s"
        else:
            if run.returncode != 0:
                why = ("LMCache's side failed: "
                       + (run.stderr.strip().splitlines() or ["no output"])[-1])
    if why is not None:
        results.skipped["lmcache"] = why
        progress.note(f"lmcache: not measured: {why}")
        progress.advance()
        return
    theirs: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    ours = _kvstore_side(s)
    peer = f"LMCache {theirs.get('version', '?')} MP server"
    results.rows.append(Row("lmcache", "lookup 64 keys", "us", ours["lookup_64_us"],
                            theirs["lookup_64_us"], peer, "lower"))
    for label in SIZES:
        for op in ("store", "load"):
            key = f"{op}_{label}_gbs"
            results.rows.append(Row("lmcache", f"{op} {label} x16", "GB/s", ours[key],
                                    theirs[key], peer, "higher"))
    results.against["lmcache"] = {"python": python, **theirs,
                                  "kvstore": ours}
    progress.advance()
