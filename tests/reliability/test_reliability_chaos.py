"""Chaos under load: client processes SIGKILLed at random, the daemon SIGKILLed and
restarted a few times, over a small DRAM tier and an SSD tier in write-through mode.

The harness (``chaos.py`` beside this file) prints operations done, faults injected,
blocks verified and p50/p99 latency (``pytest -s``).  The test then asserts: no block
ever read back wrong (by the clients while running, and every present block at the end,
through get and acquire), no durable block lost across the daemon kills, every
reservation and pin of the killed clients rolled back within the lease, nothing held at
the end, no invariant violation in any daemon generation, and no error in the log.
"""

from __future__ import annotations

from pathlib import Path

from chaos import Chaos, ChaosConfig


def test_chaos_under_load_loses_and_leaks_nothing(tmp_path: Path) -> None:
    config = ChaosConfig(clients=8, seconds=30.0, daemon_kills=3, lease=2.0)
    report = Chaos(tmp_path, config, say=print).run()
    print()
    print("\n".join(report.lines()))

    assert not report.problems(), "\n".join(report.problems())
    assert report.daemon_kills == config.daemon_kills
    assert report.client_kills >= 5
    assert report.reconnects >= config.clients + report.client_kills   # restarts survived
    assert report.released_after <= report.lease_bound
    final = report.final_stats
    assert final["invariant_violations"] == 0
    assert final["tiers"]["dram"]["reserved_slots"] == 0
    assert final["tiers"]["dram"]["pinned_blocks"] == 0

    # The run did what it is for: blocks moved between tiers and were read back.
    for verb in ("put", "reserve", "commit", "acquire", "get", "evict"):
        assert report.ops[verb] > 0, (verb, report.ops)
    assert report.verified_by_clients > 100
    assert report.present_at_end > 0 and report.verified_at_end >= report.present_at_end
    assert report.durable_blocks > 0, "no block was ever seen on the ssd tier"
