"""Writers of overlapping chains at once, at random (real daemon process, three clients,
each on a thread of its own with up to three reservations open): reserves of chains that
share trunks (keys another writer's open reservation holds come back without a slot and
its commit waits for them), commits in any order, aborts, evictions under a small DRAM,
reads back.  What must hold whatever the interleaving: every block read back has the
bytes its key's writers wrote (no slot of another key, no scratch buffer stored), a
commit never waits out the wait's bound (two writers each waiting on the other's older
reservation end the wait at once, not after 2.5 s), and once every reservation ended
nothing is left reserved or pinned."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from kvtest import key_bytes, make_identity, misread, settled

from kvstore import Client
from kvstore.errors import KVStoreError

# 16 KiB blocks: a 2 MiB arena holds 128
IDENTITY = make_identity(model="commit-waits-mix", num_kv_heads=4, head_dim=64)
CAPACITY = "2MiB"
WRITERS, ROUNDS = 3, 12
TRUNKS, BRANCHES = 2, 3
BT = IDENTITY.block_tokens


def chain_tokens(rng: random.Random, round_: int) -> list[int]:
    """A chain of a round: one of its few trunks (2-6 blocks), then one of the trunk's
    branches (1-3 blocks).  A round's trunks are new: none of it is cached yet."""
    trunk, branch = rng.randrange(TRUNKS), rng.randrange(BRANCHES)
    base = round_ * 1_000_000 + trunk * 100_000
    head = [base + i for i in range(rng.randint(2, 6) * BT)]
    tail = [base + 50_000 + branch * 1000 + i for i in range(rng.randint(1, 3) * BT)]
    return head + tail


def writer(endpoint: str, seed: int, barrier: threading.Barrier,
           out: dict[str, Any]) -> None:
    """Each round: reserve one to three of the round's chains (at staggered moments, so
    that who reserves a shared key first varies), all writers together; then commit or
    abort them in a random order (younger first too), all together; then read some
    chains back."""
    rng = random.Random(seed)
    waits: list[float] = []
    wrong: list[bytes] = []
    with Client(endpoint, tenant="acme") as c:
        ns = c.namespace(IDENTITY)
        size = ns.block_bytes
        for round_ in range(ROUNDS):
            barrier.wait(timeout=60)
            open_ = []
            for _ in range(rng.randint(1, 3)):
                time.sleep(rng.random() * 0.003)
                keys = ns.keys(chain_tokens(rng, round_))
                r = ns.reserve(keys)
                for buf, key in zip(r.buffers, keys):  # (scratch where offset is -1)
                    buf[:] = key_bytes(key, size)
                open_.append(r)
            barrier.wait(timeout=60)
            rng.shuffle(open_)
            for r in open_:
                if rng.random() < 0.15:
                    r.abort()
                    continue
                start = time.monotonic()
                r.commit()
                waits.append(time.monotonic() - start)
            if rng.random() < 0.3:  # pressure: an earlier round's tail goes
                ns.evict(ns.keys(chain_tokens(rng, rng.randrange(round_ + 1)))[-2:])
            for _ in range(3):
                wrong += misread(ns, ns.keys(chain_tokens(rng, rng.randrange(round_ + 1))))
    out[f"waits{seed}"] = waits
    out[f"wrong{seed}"] = wrong


@pytest.mark.parametrize("seed", range(1, 13))
def test_overlapping_writers_store_right_bytes_and_never_wait_out_the_bound(
        daemon_factory: Any, seed: int) -> None:
    d = daemon_factory(dram_capacity=CAPACITY)
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    barrier = threading.Barrier(WRITERS)

    def run(i: int) -> None:
        try:
            writer(d.endpoint, seed * 10 + i, barrier, out)
        except (KVStoreError, AssertionError, threading.BrokenBarrierError) as e:
            errors.append(e)  # (reported below)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    with Client(d.endpoint, tenant="acme") as c:
        dram = settled(c)
        # every block cached now holds its key's bytes
        ns = c.namespace(IDENTITY)
        rng = random.Random(seed)
        for _ in range(40):
            keys = ns.keys(chain_tokens(rng, rng.randrange(ROUNDS)))
            hits = ns.lookup(keys).blocks
            got = ns.get(keys[:hits]) if hits else []
            assert [b == key_bytes(k, ns.block_bytes) for k, b in zip(keys, got)] == \
                [True] * len(got)
    waits = [w for i in range(WRITERS) for w in out[f"waits{seed * 10 + i}"]]
    assert all(not out[f"wrong{seed * 10 + i}"] for i in range(WRITERS))
    # the mix made reserves await others' keys (a commit waits only for those not stored
    # yet when it comes: in some mixes every one was, and no commit waited)
    assert dram["awaited"] > 0, dram
    assert dram["commit_wait_timeouts"] == 0, dram
    assert max(waits) < 2.0, sorted(waits)[-5:]
