"""Kill, restart, and nothing wrong comes back: found by a randomized harness that runs a
real daemon with an SSD tier under a mixed load from client processes, SIGKILLs and
SIGTERMs it at random moments (under load, during its start-up, during a stop's flush),
restarts it on the same directories and checks what it serves.

An evict or a drop answered before a crash stayed answered: the daemon replied with the
count as soon as the store had let the blocks go, and withdrew their SSD records from the
index in the background afterwards; a SIGKILL in between (a few milliseconds) restored
them at the next start, blocks the client had been told were gone (in a loop of put,
wait for the SSD copy, remove, SIGKILL: an evicted chain back 1 time in 5, a dropped
namespace 3 in 5).  Now the reply goes once the index no longer holds them.

A client whose daemon was killed between its hello and the mapping of the arena the
hello named (and whose arena the next daemon's start swept away) got a KVStoreError of
code "internal" from the constructor ("cannot map the daemon's arena ... No such file"),
where every other way of meeting a daemon gone is an UnavailableError a caller retries
on (a worker process stopped across a restart met it).  A missing arena is one now.

A clean stop on a full SSD tier holding two block sizes crashed in its flush (a
traceback, exit 1, and what only DRAM held lost): the flush plans blocks of several
namespaces interleaved, and a reservation of SSD slots that found room for the first
size and none for the second gave the first size's slots back paired with the blocks
in the order asked, not the order allocated: a slot freed into the other size's class,
KeyError in the pool.  Now the slots go back with the blocks they were taken for.

Run as a script, this module is the daemon (``python -m kvstore``'s main) with the SSD
index's deletes stalled while the file ``$STALL_FLAG`` exists (the file
``$STALL_REACHED`` made when one begins), so that the crash lands between the removal
and its withdrawal every time.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1])]  # the tests folder: daemon_proc, kvtest

from daemon_proc import DaemonProcess  # noqa: E402
from kvtest import make_identity  # noqa: E402

from kvstore import Client  # noqa: E402
from kvstore import protocol as p  # noqa: E402
from kvstore.errors import CapacityError, KVStoreError, UnavailableError  # noqa: E402
from kvstore.keys import chain_keys  # noqa: E402
from kvstore.store import Block, BlockStore, Namespace  # noqa: E402

IDENT = make_identity(num_layers=4, num_kv_heads=4, head_dim=16)  # 16 KiB blocks
CHAIN = 16 * IDENT.block_tokens   # 16 blocks a chain


def stalled_daemon(workdir: Path, flag: Path, reached: Path) -> DaemonProcess:
    d = DaemonProcess(workdir, dram_capacity="8MiB", ssd_capacity="16MiB",
                      extra=["--slab-size", "1MiB", "--ssd-write-policy", "write-through"],
                      env={"STALL_FLAG": str(flag), "STALL_REACHED": str(reached)})
    d.run_through(HERE)
    return d


def on_ssd(client: Client, blocks: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        stats = client.stats()
        assert stats["invariant_violations"] == 0
        if stats["tiers"]["ssd"]["committed_slots"] >= blocks:
            return
        assert time.monotonic() < deadline, "write-through did not reach the ssd"
        time.sleep(0.05)


@pytest.mark.parametrize("removal, chains", [("evict", 1), ("drop", 1), ("drop", 20)])
def test_a_removal_answered_before_a_crash_stays_removed(
        tmp_path: Path, removal: str, chains: int) -> None:
    # 20 chains: more than a drop takes at once (DROP_AT_ONCE), so it goes in slices
    flag, reached = tmp_path / "stall", tmp_path / "reached"
    d = stalled_daemon(tmp_path / "daemon", flag, reached).start()
    holder = Client(d.endpoint, tenant="acme")  # keeps the namespace open throughout
    try:
        ns = holder.namespace(IDENT)
        keys = [ns.keys(range(c * 100_000, c * 100_000 + CHAIN)) for c in range(chains)]
        for chain in keys:
            ns.put(chain, [os.urandom(IDENT.block_bytes) for _ in chain])
        on_ssd(holder, 16 * chains)
        flag.touch()
        answered: list[int] = []

        def remove() -> None:
            try:
                with Client(d.endpoint, tenant="acme", timeout=3) as client:
                    ns = client.namespace(IDENT)
                    answered.append(ns.evict(keys[0][2:]) if removal == "evict"
                                    else ns.drop())
            except KVStoreError:
                pass  # no answer: the daemon was killed first

        asking = threading.Thread(target=remove, daemon=True)
        asking.start()
        deadline = time.monotonic() + 20
        while not reached.exists():  # the withdrawal began, and stalls
            assert time.monotonic() < deadline, "the removal never reached the ssd index"
            time.sleep(0.01)
        asking.join(2.0)  # an answer that does not wait for the withdrawal comes by then
        d.stop(signal.SIGKILL)
        asking.join()
        flag.unlink()
        d.start()
        with Client(d.endpoint, tenant="acme") as client:
            ns = client.namespace(IDENT)
            back = [ns.lookup(chain).blocks for chain in keys]
            assert client.stats()["invariant_violations"] == 0
        kept = [2] if removal == "evict" else [0] * chains
        assert not answered or back == kept, (
            f"{removal} answered {answered[0]} entries gone, and after a crash the chains "
            f"held {back} blocks")
    finally:
        holder.close()
        d.stop()


def test_an_arena_gone_with_its_killed_daemon_is_unavailable_not_internal(
        tmp_path: Path) -> None:
    # the hello of a daemon killed right after it, naming an arena since swept away (a
    # socket of the test's own answers it, so that the order is certain)
    gone = tmp_path / "kvstore-0-1-00000000.arena"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path / 'kvstore.sock'}"
    sock.bind(endpoint)

    def answer() -> None:
        if sock.poll(10_000):
            peer, header = sock.recv_multipart()[:2]
            hello = p.request_decoder.decode(header)
            assert isinstance(hello, p.Hello)
            sock.send_multipart([peer, p.encoder.encode(p.HelloReply(
                hello.rid, p.PROTOCOL_VERSION, "s", "acme", str(gone), 1 << 20, 30.0, 4096,
                1 << 26))])

    daemon = threading.Thread(target=answer, daemon=True)
    daemon.start()
    try:
        with pytest.raises(UnavailableError, match="arena .*: it is gone"):
            Client(endpoint, tenant="acme", timeout=5)
    finally:
        daemon.join()
        sock.close()
        ctx.term()


def committed(store: BlockStore, ns: Namespace, first: int, blocks: int) -> list[Block]:
    tokens = ns.identity.block_tokens
    keys = chain_keys(ns.id, range(first, first + blocks * tokens), tokens)
    r = store.reserve("engine", ns, keys, None, 0.0)
    store.commit("engine", r.id, 0.0)
    return [ns.blocks[k] for k in keys]


def test_ssd_slots_of_one_size_go_back_whole_when_another_size_finds_no_room() -> None:
    slot = IDENT.block_bytes
    store = BlockStore(64 * slot, 8 * slot, ssd_capacity=4 * slot, ssd_slab_bytes=4 * slot)
    big = store.open_namespace(IDENT)
    small = store.open_namespace(make_identity(num_layers=4, num_kv_heads=4, head_dim=8))
    bigs, smalls = committed(store, big, 0, 2), committed(store, small, 10**6, 1)
    assert store.ssd is not None and big.ssd_cls is not None
    free_before = store.ssd.pool.available(big.ssd_cls)
    # interleaved, as the stop's flush plans them; the one slab goes to the big size
    # and none is left for the small, whose reservation is refused
    with pytest.raises(CapacityError):
        store.ssd_copies.reserve([bigs[0], smalls[0], bigs[1]], evict=lambda b: False)
    assert store.ssd.pool.available(big.ssd_cls) == free_before
    store.check_invariants()


def _stall_index_deletes() -> None:
    from kvstore.tiers.ssd_index import SSDIndex

    flag, reached = os.environ["STALL_FLAG"], os.environ["STALL_REACHED"]
    delete = SSDIndex.delete

    def stalled(self: SSDIndex, index_keys: Any) -> int:
        if os.path.exists(flag):
            Path(reached).touch()
            while os.path.exists(flag):
                time.sleep(0.02)
        return delete(self, index_keys)

    SSDIndex.delete = stalled  # type: ignore[method-assign]


if __name__ == "__main__":
    _stall_index_deletes()
    from kvstore.cli import main

    sys.exit(main(sys.argv[1:]))
