"""A whole snapshot's reply encoded a page at a time (``kvstore.routing.WholeEntries``).

The reply of a snapshot in one reply (limit 0, older clients) must decode to the same
message as when its list was encoded in one go: same entries, same order, whatever the
pages' sizes (MessagePack array headers differ below 16, 65536 and above).
"""

from __future__ import annotations

import random

from kvtest import make_identity

from kvstore import protocol as p
from kvstore.routing import Entry, SnapshotWalk, WholeEntries
from kvstore.store import BlockStore, Reservation

IDENT = make_identity(num_layers=1, num_kv_heads=1, head_dim=8)


def entries(rng: random.Random, n: int) -> list[Entry]:
    return [(rng.randbytes(16), None if i % 7 == 0 else rng.randbytes(16),
             ("dram", "ssd", "remote")[i % 3]) for i in range(n)]


def test_pages_of_every_header_size_decode_as_one_list() -> None:
    rng = random.Random(1)
    for rid, seq in ((4, 17), (1 << 40, -1)):
        for sizes in ([], [0], [1], [15], [16, 1, 0, 15], [65535, 1], [65536, 3, 70000]):
            whole = WholeEntries(rid, seq)
            listed: list[Entry] = []
            for n in sizes:
                page = entries(rng, n)
                whole.add(page)
                listed += page
            assert whole.count == len(listed)
            stand_in, header = whole.reply()
            assert stand_in.rid == rid and not header  # (no payload frames)
            encoded = bytes(header.header)
            reply = p.reply_decoder.decode(encoded)
            assert reply == p.SnapshotReply(rid, seq, listed, 0), sizes
            # the same bytes but for the array's header (its count in 4 bytes here)
            plain = p.encoder.encode(p.SnapshotReply(rid, seq, listed))
            assert len(encoded) - len(plain) == 5 - (1 if len(listed) < 16 else 3
                                                     if len(listed) < 1 << 16 else 5)


def test_a_walk_encoded_page_by_page_lists_what_it_lists_in_one_go() -> None:
    rng = random.Random(2)
    store = BlockStore(64 << 20, 1 << 20)
    ns = store.open_namespace(IDENT)
    for _ in range(40):
        keys = [rng.randbytes(16) for _ in range(50)]
        r = store.reserve("w", ns, keys, None, 0.0)
        assert isinstance(r, Reservation)
        store.commit("w", r.id, 0.0)
    listed: list[Entry] = []
    assert SnapshotWalk(store.order, 3).page(1 << 30, listed)
    walk, whole, page, pages = SnapshotWalk(store.order, 3), WholeEntries(1, 3), [], 0
    while True:
        done = walk.page(97, page)
        whole.add(page)
        page.clear()
        pages += 1
        if done:
            break
    assert pages > 20 and whole.count == len(listed) == 2000
    reply = p.reply_decoder.decode(bytes(whole.reply()[1].header))
    assert isinstance(reply, p.SnapshotReply) and reply.blocks == listed
