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

from daemon_proc import DaemonProcess
from restarts import RestartConfig, Restarts, chain_tokens, content, identities

from kvstore import Client
from kvstore.identity import Identity


def write_back_daemon(tmp_path: Path, more_toml: str = "") -> DaemonProcess:
    """A daemon of 32 MiB of DRAM over an 8 MiB SSD tier in write-back, 1 MiB slabs in
    both (``more_toml``: further settings), started."""
    conf = tmp_path / "kvstore.toml"
    conf.write_text('[ssd]\nslab_size = "1MiB"\n' + more_toml)
    return DaemonProcess(tmp_path / "daemon", dram_capacity="32MiB", ssd_capacity="8MiB",
                         extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-back",
                                "--config", str(conf)]).start()


def test_kills_and_clean_stops_under_a_mixed_load_serve_nothing_wrong(tmp_path: Path) -> None:
    config = RestartConfig(seed=56, clients=3, faults="kck", round_seconds=(2.0, 4.0),
                           chains=16, ssd="24MiB", ssd_policy="write-back", ssd_slab="1MiB")
    # (16 chains of 8 blocks, of 16 and 32 KiB, for 3 tenants: at most 18 MiB, which the
    # tier holds, so the clean stop must bring back everything)
    report = Restarts(tmp_path, config, say=print).run()
    print("\n".join(report.lines()))

    assert not report.problems, "\n".join(report.problems[:20])
    assert (report.kills, report.clean_stops) == (2, 1)
    # the run did what it is for: both block sizes written, read back, and restored
    for op in ("put", "reserve", "batch", "acquire", "get"):
        assert report.ops[op] > 0, (op, report.ops)
    assert report.verified > 100
    assert report.census_fit == 1 and report.orphans_after_clean == 0
    before, back, _ = report.back_after_clean[0]
    assert before > 0 and back == before


def test_a_clean_stop_on_a_tier_full_of_parents_writes_the_other_size(tmp_path: Path) -> None:
    # Found by the harness (a clean stop under write-back wrote a few hundred blocks of
    # the thousand DRAM held, and a restart dropped some as orphans).  The flush counted
    # every slot of a full class as room for its blocks (in place of its leaves), also
    # where every copy there was the parent of a block only DRAM held, so no leaf could
    # go: it planned the children, wrote none, and, planned, they kept the other size
    # from the class's slabs (a slab holding a planned block's parent is never given).
    # A tier full of 32 KiB chains whose continuations DRAM alone held, and 16 KiB
    # chains only in DRAM: the stop wrote nothing at all; now the 16 KiB size takes
    # slabs of the other (at most half of them), as the README says.
    d = write_back_daemon(tmp_path)
    small, big = identities("t0")
    try:
        put_chains(d, big, 32, 0, 8)   # 256 x 32 KiB: the tier's eight slabs, once on it
        d.stop()
        d.start()
        assert count_chains(d, big, 32, 8) == (256, 256)
        put_chains(d, big, 32, 8, 12)  # their continuations, only in DRAM
        put_chains(d, small, 16, 0, 8)  # 128 x 16 KiB, only in DRAM: two slabs' worth
        d.stop()
        d.start()
        # two of the big size's slabs given (its chains there go with what hangs below)
        assert count_chains(d, small, 16, 8)[0] == 128
        assert count_chains(d, big, 32, 12)[0] == 192
    finally:
        d.stop()
    assert "dropped at restore" not in d.log()


def put_chains(d: DaemonProcess, ident: Identity, chains: int, lo: int, hi: int) -> None:
    with Client(d.endpoint, tenant=ident.tenant) as c:
        ns = c.namespace(ident)
        for chain in range(chains):
            keys = ns.keys(chain_tokens(chain, hi))
            ns.put(keys[lo:hi], [content(k, ns.block_bytes) for k in keys[lo:hi]],
                   parent=keys[lo - 1] if lo else None)


def count_chains(d: DaemonProcess, ident: Identity, chains: int, blocks: int
                 ) -> tuple[int, int]:
    """Blocks found (each chain's leading hits, read back bit-exact), and SSD copies."""
    with Client(d.endpoint, tenant=ident.tenant) as c:
        ns = c.namespace(ident)
        found = 0
        for chain in range(chains):
            keys = ns.keys(chain_tokens(chain, blocks))
            hit = ns.lookup(keys).blocks
            if hit:
                assert ns.get(keys[:hit]) == [content(k, ns.block_bytes) for k in keys[:hit]]
            found += hit
        return found, c.stats()["tiers"]["ssd"]["committed_slots"]


def test_a_clean_stop_writes_no_block_whose_parent_it_failed_to_write(tmp_path: Path) -> None:
    # Found by the harness (a clean stop under write-back, then "blocks dropped at
    # restore: their parents were not on it").  The flush writes its plan 64 blocks at
    # a time, all or none; a batch that found no room went whole, and the next one, the
    # chain's continuation, fitted and was written: orphans the restart dropped, and
    # room for the chain's head lost.  A tier with 40 free slots, the rest another
    # tenant's within its share (no victim), and a chain of 100 only in DRAM: the stop
    # wrote blocks 64-99 and the restart dropped all 36; now it writes blocks 0-39.
    d = write_back_daemon(tmp_path, '[server]\ntenant_weights = { t1 = 100.0 }\n')
    mine, theirs = identities("t0")[0], identities("t1")[0]
    try:
        put_chains(d, theirs, 59, 0, 8)  # 472 of the tier's 512 slots, once on it
        d.stop()
        d.start()
        assert count_chains(d, theirs, 59, 8) == (472, 472)
        put_chains(d, mine, 1, 0, 100)
        d.stop()
        d.start()
        assert count_chains(d, mine, 1, 100) == (40, 512)
        assert count_chains(d, theirs, 59, 8)[0] == 472
    finally:
        d.stop()
    assert "dropped at restore" not in d.log()


def test_a_clean_stop_under_write_through_writes_what_only_dram_holds(tmp_path: Path) -> None:
    # Under SSD write-through the stop wrote nothing more: blocks whose SSD copy the
    # tier had let go (or never took, full) were lost with DRAM, and their children on
    # the tier were orphans the restart dropped.  Here (three tenants' 20 MiB over an
    # 8 MiB tier) 6.0 and 6.4 MiB came back, 159 orphans dropped; the stop's flush now
    # runs under either policy: 7.7-8.0 MiB, 35 orphans (parents it found no room for).
    # Those orphans (5 to 45 a run, more under load) were copies below a parent the tier
    # had let go while DRAM held it, which the flush found no room or no time for: the
    # stop now withdraws them before it syncs the index, and the restart drops none.
    config = RestartConfig(seed=57, clients=3, faults="cc", round_seconds=(2.0, 4.0),
                           chains=32, ssd="8MiB", ssd_policy="write-through",
                           ssd_slab="1MiB")
    report = Restarts(tmp_path, config, say=print).run()
    print("\n".join(report.lines()))

    assert not report.problems, "\n".join(report.problems[:20])
    assert report.clean_stops == 2
    # The tier less a slab for each of the two block sizes (each size's last slab may be
    # part-filled: the room the stop can count on), or all there was: on a loaded
    # machine the clients' round stored 2.2-4.6 MiB before the first stop (all of it
    # back).  Most stops bring back 7.4-8.0 MiB; a floor of 7 MiB failed one stop in
    # some twenty (6.9 MiB back: the planner counts room in slabs it then does not take)
    room = (8 << 20) - 2 * (1 << 20)
    for need, back in zip(report.bytes_before_clean, report.back_bytes_after_clean):
        assert back >= min(need, room), (report.bytes_before_clean,
                                         report.back_bytes_after_clean)
    assert report.orphans_after_clean == 0, report.lines()
