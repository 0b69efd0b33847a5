"""Kill and restart under a mixed load of several tenants and two block sizes, on a small
SSD tier that fills: the harness (``restarts.py`` beside this file) runs client processes
doing reserve (with ``skip_held``)/commit/abort, reserve_batch, put/get,
acquire/release, prefetch, evict, drop and lookups, SIGKILLs the daemon under load and
stops it cleanly, restarting it on the same workdir each time, and after every restart
checks what it serves: every present block reads back bit-exact, no block without its
parent, no invariant violated, nothing held once the sessions end, no arena of the
stopped daemon left in /dev/shm, and after a clean stop under write-back whose blocks fit
the SSD tier every block present before it is back (README, "write-back").

``benchmarks/restart_soak.py`` runs it by seeds for longer.
"""

from __future__ import annotations

from pathlib import Path

from restarts import RestartConfig, Restarts


def test_kills_and_clean_stops_under_a_mixed_load_serve_nothing_wrong(tmp_path: Path) -> None:
    config = RestartConfig(seed=56, clients=3, faults="kck", round_seconds=(2.0, 4.0),
                           chains=24, ssd="16MiB", ssd_policy="write-back", ssd_slab="1MiB")
    report = Restarts(tmp_path, config, say=print).run()
    print("\n".join(report.lines()))

    assert not report.problems, "\n".join(report.problems[:20])
    assert (report.kills, report.clean_stops) == (2, 1)
    # the run did what it is for: both block sizes written, read back, and restored
    for op in ("put", "reserve", "batch", "acquire", "get"):
        assert report.ops[op] > 0, (op, report.ops)
    assert report.verified > 100
    before, back, _ = report.back_after_clean[0]
    assert before > 0 and back == before
