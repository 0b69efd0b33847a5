"""A tenant over its share of a shared DRAM tier, its victims behind another's cold blocks.

    python benchmarks/tenant_victims.py [--cold 0 2000 8000] [--puts 20] [--against ROOT]

A daemon (``kvstore serve``: 64 MiB of DRAM, a 512 MiB SSD tier written through, 4 KiB
blocks) per figure.  Tenant ``cold`` puts ``--cold`` blocks (64-block chains) and waits
until they are on SSD: the coldest blocks in DRAM, under its share, kept there.  Tenant
``busy`` then puts 512-block chains: once DRAM is full, each put evicts 512 of busy's own
blocks (it is over its share), which lie behind cold's in the eviction order.  Printed:
the daemon loop thread's CPU per put (its scheduler's nanoseconds from /proc, the median
of ``--puts`` puts into a full tier), and its ratio to the figure with no cold blocks.
``--against`` runs the same from another checkout of kvstore (its root), figures side by
side: before and after a change.  When the victims were looked for from the coldest
block again each time, every cold block was walked past once per victim: the CPU per put
grew with the cold blocks (about 100 ms of the loop at 2000 of them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore import Client, Identity

CHAIN = 512


def identity(tenant: str) -> Identity:
    """4 KiB blocks of 16 tokens."""
    return Identity(model="victims", model_revision="r1", tenant=tenant, kv_dtype="float16",
                    num_layers=1, num_kv_heads=1, head_dim=64, block_tokens=16)


def _loop_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _content(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def cpu_per_put(root: str, cold: int, puts: int) -> float:
    """The loop's median CPU seconds per 512-block put by a tenant over its share, with
    ``cold`` blocks of another tenant colder than its own in DRAM."""
    work = Path(tempfile.mkdtemp(prefix="kvvictims-"))
    endpoint = f"ipc://{work}/kvstore.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
         "--dram-capacity", "64MiB", "--ssd-capacity", "512MiB", "--ssd-path",
         str(work / "ssd"), "--slab-size", "1MiB", "--ssd-write-policy", "write-through",
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": root, "KVSTORE_SSD_SYNC": "none"}, cwd=root)
    try:
        assert proc.stdout is not None
        while b"serving on" not in proc.stdout.readline():
            if proc.poll() is not None:
                raise SystemExit(f"the daemon of {root} did not start")
        with Client(endpoint, tenant="cold") as client:
            ns = client.namespace(identity("cold"))
            for first in range(0, cold, 64):
                keys = ns.keys(range(first * 16, (first + min(64, cold - first)) * 16))
                ns.put(keys, [_content(k, ns.block_bytes) for k in keys])
            deadline = time.monotonic() + 60
            while client.stats()["ssd_io"]["writes"] < cold:
                if time.monotonic() > deadline:
                    raise SystemExit("the cold blocks did not reach the SSD tier")
                time.sleep(0.05)
        figures: list[float] = []
        with Client(endpoint, tenant="busy") as client:
            ns = client.namespace(identity("busy"))
            at = 1 << 30
            while len(figures) < puts:
                keys = ns.keys(range(at, at + CHAIN * 16))
                at += CHAIN * 16
                blocks = [_content(k, ns.block_bytes) for k in keys]
                full = client.stats()["tiers"]["dram"]["free"] < CHAIN * ns.block_bytes
                before = _loop_cpu(proc.pid)
                ns.put(keys, blocks)
                if full:
                    figures.append(_loop_cpu(proc.pid) - before)
        return statistics.median(figures)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", type=int, nargs="+", default=[0, 2000, 8000])
    parser.add_argument("--puts", type=int, default=20)
    parser.add_argument("--against", help="another checkout's root, run side by side")
    args = parser.parse_args()
    if any(c < 0 or c > 8000 for c in args.cold) or args.puts < 1:
        parser.error("--cold from 0 to 8000 (under the cold tenant's share), --puts >= 1")
    here = str(Path(__file__).resolve().parent.parent)
    roots = {"this": here, **({"against": args.against} if args.against else {})}
    print("loop CPU per 512-block put into a full DRAM tier (ms), tenant over its share:")
    print(f"  {'cold blocks':>11}" + "".join(f"{name:>10}{'ratio':>7}" for name in roots))
    base: dict[str, float] = {}
    for cold in args.cold:
        row = f"  {cold:>11}"
        for name, root in roots.items():
            cpu = cpu_per_put(root, cold, args.puts)
            base.setdefault(name, cpu)
            row += f"{cpu * 1e3:10.1f}{cpu / base[name]:7.1f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
