"""What a grantee may keep pinned of its owner's DRAM (``auth.grantee_pin_share``): in
bytes of distinct blocks, per grantee tenant and owner, over all the grantee's sessions,
given back on release and when a lease runs out.  The sessions and the store, no
sockets; ``check_invariants`` recounts after every step."""

from __future__ import annotations

import pytest
from kvtest import make_identity

from kvstore.blocks import Pin
from kvstore.config import ServerConfig
from kvstore.errors import LimitExceededError
from kvstore.grant_pins import GrantPins
from kvstore.keys import chain_keys
from kvstore.sessions import Session, Sessions
from kvstore.store import BlockStore, Limits, Namespace, Reservation

OWNED = make_identity(tenant="public", model="system-prompt", num_layers=4,
                      num_kv_heads=4, head_dim=64)  # 64 KiB blocks
SLOTS = 64  # in the DRAM tier


class World:
    """A store of ``SLOTS`` slots shared by all tenants, the sessions over it, and a
    chain of 32 of the owner's blocks, committed."""

    def __init__(self, share: float = 0.25, total: float = 1.0) -> None:
        self.now = 0.0
        slot = OWNED.block_bytes
        self.store = BlockStore(SLOTS * slot, 16 * slot, limits=Limits(lease_seconds=5.0))
        self.sessions = Sessions(self.store, ServerConfig(), clock=lambda: self.now,
                                 max_bytes_in_flight=0, max_tenant_bytes_in_flight=0,
                                 grantee_pin_share=share, grantee_pin_total=total)
        self.ns = self.store.open_namespace(OWNED)
        self.keys = chain_keys(self.ns.id, list(range(32 * 16)), 16)
        r = self.store.reserve("owner", self.ns, self.keys, None, 0.0)
        assert isinstance(r, Reservation)
        self.store.commit("owner", r.id, 0.0)
        self.slot = self.ns.cls.slot_bytes
        self.settle = True  # recount after each step (settles queued discharges)

    def acquire(self, session: Session, keys: list[bytes], ns: Namespace | None = None) -> Pin:
        """As the acquire verb does: the check, the pin, the count."""
        ns = self.ns if ns is None else ns
        self.sessions.check_grant(session, ns, keys)
        pin = self.store.acquire(session.id, ns, keys, self.now)
        assert isinstance(pin, Pin)
        self.sessions.pinned(session, pin)
        self.sessions.counted(session)
        if self.settle:
            self.sessions.check_invariants()
        return pin

    def writer_reserves(self, slots: int) -> tuple[Session, Session, Reservation]:
        """Two sessions of the grantee ``acme``, the first holding ``slots`` of fresh
        blocks reserved in the owner's namespace (checked, as the reserve verb does)."""
        a1 = self.sessions.hello(b"a1", "acme", "")
        a2 = self.sessions.hello(b"a2", "acme", "")
        fresh = chain_keys(self.ns.id, list(range(10**6, 10**6 + 16 * slots)), 16)
        self.sessions.check_grant_reserve(a1, self.ns, slots)
        r1 = self.store.reserve(a1.id, self.ns, fresh, None, self.now)
        assert isinstance(r1, Reservation)
        self.sessions.counted(a1)
        return a1, a2, r1

    def release(self, session: Session, pin: Pin) -> None:
        self.store.release(session.id, pin.id)
        self.sessions.unpinned(session, pin.id)
        self.sessions.counted(session)
        if self.settle:
            self.sessions.check_invariants()

    def held(self, grantee: str) -> int:
        return self.sessions.grant_pins.of(grantee).get("public", 0)


def test_a_grantee_pins_up_to_its_share_of_distinct_blocks_over_its_sessions() -> None:
    w = World()
    limit = SLOTS * w.slot // 4
    assert w.sessions.grant_pins.limit(w.ns) == limit
    a1 = w.sessions.hello(b"a1", "acme", "")
    a2 = w.sessions.hello(b"a2", "acme", "")
    first = w.acquire(a1, w.keys[:10])
    assert w.held("acme") == 10 * w.slot
    again = w.acquire(a2, w.keys[:10])  # the same blocks: no more room taken
    assert w.held("acme") == 10 * w.slot
    with pytest.raises(LimitExceededError, match="grantee_pin_share"):
        w.acquire(a1, w.keys[10:20])  # 20 blocks > 16
    assert sum(b.refs for b in w.ns.blocks.values()) == 20  # the refused one pinned nothing
    w.sessions.check_invariants()
    tail = w.acquire(a1, w.keys[10:16])  # exactly at the share
    assert w.held("acme") == limit
    with pytest.raises(LimitExceededError):
        w.acquire(a2, w.keys[16:17])
    # a co-grantee has a share of its own: another grantee's pins do not shut it out
    g = w.sessions.hello(b"g", "globex", "")
    other = w.acquire(g, w.keys[:16])
    assert w.held("globex") == limit and w.held("acme") == limit
    assert w.sessions.grant_pins.of("globex") == {"public": limit}  # its own figures only
    # the owner's own pins are its business, never counted
    owner = w.sessions.hello(b"o", "public", "")
    mine = w.acquire(owner, w.keys)
    assert owner.grant_pins == {} and w.sessions.grant_pins.of("public") == {}
    w.release(a1, first)  # a2 still holds those ten
    assert w.held("acme") == limit
    w.release(a2, again)  # the tail still keeps its prefix in place: still counted
    assert w.held("acme") == limit
    w.release(a1, tail)
    w.release(g, other)
    w.release(owner, mine)
    assert w.sessions.grant_pins.held == {} and w.sessions.grant_pins.stats() == {}


def test_a_pinned_leaf_counts_the_prefix_it_keeps_in_place() -> None:
    """Eviction is leaf first: a pinned leaf keeps its whole chain in DRAM, so it
    counts it; pinning the last block of a chain is no way around the share."""
    w = World()
    a = w.sessions.hello(b"a", "acme", "")
    with pytest.raises(LimitExceededError, match="prefixes"):
        w.acquire(a, w.keys[31:32])  # a chain of 32 blocks > 16
    assert sum(b.refs for b in w.ns.blocks.values()) == 0
    leaf = w.acquire(a, w.keys[15:16])  # a chain of 16: exactly the share
    assert w.held("acme") == 16 * w.slot
    inner = w.acquire(a, w.keys[3:4])  # within what it keeps already: nothing more
    assert w.held("acme") == 16 * w.slot
    w.release(a, leaf)  # the inner pin keeps its own prefix only
    assert w.held("acme") == 4 * w.slot
    w.release(a, inner)
    assert w.sessions.grant_pins.held == {}


def test_pins_come_back_when_a_lease_runs_out() -> None:
    w = World()
    a = w.sessions.hello(b"a", "acme", "")
    w.acquire(a, w.keys[:8])
    w.acquire(a, w.keys[:4])
    assert w.held("acme") == 8 * w.slot
    w.now = 10.0  # past the lease
    w.sessions.forget(set(w.store.expire(w.now)))
    # queued, not done there and then (a lease's end lets go of all its pins in one
    # loop pass): the daemon drains the queue a bounded slice a loop turn
    assert a.grant_pins == {} and not w.sessions.grant_pins.settled
    assert w.held("acme") == 8 * w.slot
    w.sessions.grant_pins.drain()
    assert w.sessions.grant_pins.held == {} and w.sessions.grant_pins.settled
    w.sessions.check_invariants()
    b = w.sessions.hello(b"b", "acme", "")
    w.acquire(b, w.keys[:16])  # the whole share again


def test_a_share_of_zero_pins_nothing_and_one_the_whole_tier() -> None:
    none = World(share=0.0)
    a = none.sessions.hello(b"a", "acme", "")
    with pytest.raises(LimitExceededError):
        none.acquire(a, none.keys[:1])
    whole = World(share=1.0)  # refuses nothing, so counts nothing (no walks)
    a = whole.sessions.hello(b"a", "acme", "")
    whole.acquire(a, whole.keys)
    assert whole.held("acme") == 0 and a.grant_pins == {} and len(a.free_pins) == 1
    whole.sessions.configure(ServerConfig(), 0.0)  # lowered live: takes nothing back
    with pytest.raises(LimitExceededError):  # pins taken since are counted
        whole.acquire(a, whole.keys[:1])


def test_a_pin_walks_a_bounded_prefix_beyond_the_keys_it_names() -> None:
    """The walk up a chain runs on the daemon's loop: a pin of a chain's last block
    may not walk the whole chain (refused, typed, saying how), while a chain pinned
    from its head in order walks one step a key and passes however long."""
    w = World(share=0.9)  # 57 slots: room for the whole chain
    w.sessions.grant_pins.max_steps = 4
    a = w.sessions.hello(b"a", "acme", "")
    with pytest.raises(LimitExceededError, match="from its head"):
        w.acquire(a, w.keys[31:32])
    assert w.held("acme") == 0
    w.acquire(a, w.keys[:8])  # named keys are never "beyond"
    pins = [w.acquire(a, w.keys[i:i + 1]) for i in range(8, 27)]  # one step a key
    w.acquire(a, w.keys[31:32])  # 3 prefix blocks beyond it unprotected: passes
    assert w.held("acme") == 32 * w.slot
    assert pins


def test_a_long_discharge_is_done_in_bounded_slices_each_request() -> None:
    """Releasing the last pin that keeps a long chain frees it all; that discharge is
    done ``max_steps`` blocks a request, over-counting meanwhile, exact at the end."""
    w = World(share=0.9)
    gp = w.sessions.grant_pins
    gp.max_steps = 5
    a = w.sessions.hello(b"a", "acme", "")
    pins = [w.acquire(a, w.keys[i:i + 1]) for i in range(32)]
    for pin in pins[:-1]:  # the tail pin keeps the whole chain: nothing freed
        w.release(a, pin)
    assert w.held("acme") == 32 * w.slot
    w.store.release(a.id, pins[-1].id)
    w.sessions.unpinned(a, pins[-1].id)
    w.sessions.counted(a)
    assert not gp.settled and w.held("acme") == 27 * w.slot  # 5 blocks done
    w.sessions.admit(a)  # each request does 5 more
    assert w.held("acme") == 22 * w.slot
    for _ in range(5):
        w.sessions.admit(a)
    assert gp.settled and gp.held == {} and gp.stats() == {}
    w.sessions.check_invariants()


def test_all_grantees_together_stay_within_the_total_of_distinct_blocks() -> None:
    """``auth.grantee_pin_total``: four grantees at a quarter each would pin the whole
    arena; together they keep at most the total, a block pinned by many once."""
    w = World(share=0.25, total=0.5)  # 16 slots each, 32 together
    branch = chain_keys(w.ns.id, list(range(10**6, 10**6 + 16 * 32)), 16)
    r = w.store.reserve("owner", w.ns, branch, None, 0.0)
    assert isinstance(r, Reservation)
    w.store.commit("owner", r.id, 0.0)
    a, g, c, d = (w.sessions.hello(bytes([i]), t, "")
                  for i, t in enumerate(["acme", "globex", "initech", "umbrella"]))
    w.acquire(a, w.keys[:16])
    w.acquire(g, w.keys[:16])  # the same blocks: counted once in the total
    assert w.sessions.grant_pins.total_held == {"public": 16 * w.slot}
    w.acquire(c, branch[:16])
    assert w.sessions.grant_pins.total_held == {"public": 32 * w.slot}
    with pytest.raises(LimitExceededError, match="grantee_pin_total"):
        w.acquire(d, branch[16:17])  # within its own share, past the total
    w.acquire(d, w.keys[:4])  # what others protect already costs the total nothing
    w.now = 100.0
    w.sessions.forget(set(w.store.expire(w.now)))
    w.sessions.check_invariants()
    assert w.sessions.grant_pins.total_held == {}


def test_a_writer_grantee_s_open_reservations_count_against_its_share() -> None:
    """Open reservations hold DRAM slots nothing else counts: a writer grantee's in the
    owner's namespaces count, with its pins there, against its share, and come back
    at commit, abort or lease end (recounted from the store)."""
    w = World()  # 16 slots a grantee
    a1, a2, r1 = w.writer_reserves(10)
    w.acquire(a2, w.keys[:4])  # 10 reserved + 4 pinned over its two sessions
    with pytest.raises(LimitExceededError, match="reserved slots"):
        w.sessions.check_grant_reserve(a2, w.ns, 3)
    w.sessions.check_grant_reserve(a2, w.ns, 2)  # exactly at the share
    w.sessions.check_grant_reserve(w.sessions.hello(b"g", "globex", ""), w.ns, 16)
    w.sessions.check_grant_reserve(w.sessions.hello(b"o", "public", ""), w.ns, 64)
    w.store.abort(a1.id, r1.id)
    w.sessions.counted(a1)
    w.sessions.check_grant_reserve(a2, w.ns, 12)  # the abort gave its slots back


def test_a_writer_grantee_s_pins_count_its_open_reservations_too() -> None:
    """A writer grantee holding its share in open reservations pins nothing more of the
    owner's blocks (it held its share in reservations and again in pins before), and
    pins again once the reservation goes."""
    w = World()  # 16 slots a grantee
    a1, a2, r1 = w.writer_reserves(14)
    with pytest.raises(LimitExceededError, match="pinned or reserved"):
        w.acquire(a2, w.keys[:3])  # 14 reserved + 3 pinned > 16
    assert w.sessions.grant_pins.held == {}  # nothing pinned
    w.acquire(a2, w.keys[:2])  # exactly at the share
    w.store.abort(a1.id, r1.id)
    w.sessions.counted(a1)
    w.acquire(a2, w.keys[2:12])  # the abort gave its slots back


def test_the_store_keeps_each_session_s_reserved_slots_by_namespace_owner() -> None:
    """What ``check_grant_reserve`` adds up, kept as reservations open and close (a
    recount of every reservation made each reserve O(reservations))."""
    w = World()
    a = w.sessions.hello(b"a", "acme", "")
    fresh = chain_keys(w.ns.id, list(range(10**6, 10**6 + 16 * 12)), 16)
    state = w.store.owners
    r1 = w.store.reserve(a.id, w.ns, fresh[:5], None, w.now)
    r2 = w.store.reserve(a.id, w.ns, fresh[5:8], None, w.now)
    r3 = w.store.reserve(a.id, w.ns, fresh[8:12], None, w.now)
    assert isinstance(r1, Reservation) and isinstance(r2, Reservation)
    assert isinstance(r3, Reservation)
    assert state[a.id].reserved_in == {"public": 12}
    w.store.commit(a.id, r1.id, w.now)
    assert state[a.id].reserved_in == {"public": 7}
    w.store.abort(a.id, r2.id)
    assert state[a.id].reserved_in == {"public": 4}
    with pytest.raises(LimitExceededError, match="reserved slots"):
        w.sessions.check_grant_reserve(a, w.ns, 13)  # 4 open + 13 > 16
    w.sessions.check_grant_reserve(a, w.ns, 12)
    w.now = 10.0  # past the lease: the rest rolled back with the session
    w.sessions.forget(set(w.store.expire(w.now)))
    assert a.id not in state
    b = w.sessions.hello(b"b", "acme", "")
    w.sessions.check_grant_reserve(b, w.ns, 16)
    r4 = w.store.reserve(b.id, w.ns, fresh[:2], None, w.now)
    assert isinstance(r4, Reservation)
    w.store.abort(b.id, r4.id)
    assert state[b.id].reserved_in == {}


def test_the_share_of_a_shared_tier_is_of_the_owner_s_quota() -> None:
    w = World()
    w.store.tenant_quota = 8 * w.slot  # the owner may hold 8 slots of the shared tier
    assert w.sessions.grant_pins.limit(w.ns) == 2 * w.slot
    a = w.sessions.hello(b"a", "acme", "")
    w.acquire(a, w.keys[:2])
    with pytest.raises(LimitExceededError):
        w.acquire(a, w.keys[2:3])


def test_the_metrics_show_each_grantee_s_bytes_by_owner() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore.metrics import Metrics

    w = World()
    a = w.sessions.hello(b"a", "acme", "")
    w.acquire(a, w.keys[:3])
    stats = {"grantee_pinned_bytes": w.sessions.grant_pins.stats()}
    text = Metrics(lambda: stats).exposition().decode()
    samples = {tuple(sorted(s.labels.items())): s.value
               for family in text_string_to_metric_families(text)
               if family.name == "kvstore_grantee_pinned_bytes" for s in family.samples}
    assert samples == {(("grantee", "acme"), ("owner", "public")): 3 * w.slot}


def test_random_pins_and_releases_over_branching_chains_keep_exact_counts() -> None:
    """A model check: grantees pin runs of keys anywhere in a tree of chains (shared
    prefixes, branches), release them in any order, and a lease runs out; after every
    step the counts equal a recount, and the bytes never pass the share."""
    import random

    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.integers(0, 2**32 - 1))
    def run(seed: int) -> None:
        rnd = random.Random(seed)
        w = World(share=rnd.choice([0.1, 0.25, 0.5, 1.0]),
                  total=rnd.choice([0.2, 0.5, 1.0]))
        gp = w.sessions.grant_pins
        gp.max_steps = rnd.choice([1, 3, 4096])
        w.settle = rnd.random() < 0.5  # else discharges interleave with pins, in slices
        # three more chains branching off the committed one at random depths
        chains = [w.keys]
        for i in range(3):
            at = rnd.randrange(1, 31)
            tail = chain_keys(w.ns.id, list(range(10**6 * (i + 1), 10**6 * (i + 1) + 16 * 8)),
                              16, parent=w.keys[at - 1])
            r = w.store.reserve("owner", w.ns, tail, w.keys[at - 1], 0.0)
            assert isinstance(r, Reservation)
            w.store.commit("owner", r.id, 0.0)
            chains.append(w.keys[:at] + tail)
        sessions = [w.sessions.hello(bytes([i]), t, "")
                    for i, t in enumerate(["acme", "acme", "globex"])]
        held: list[tuple[Session, Pin]] = []
        limit = w.sessions.grant_pins.limit(w.ns)
        for _ in range(40):
            if held and rnd.random() < 0.4:
                session, pin = held.pop(rnd.randrange(len(held)))
                w.release(session, pin)
            else:
                keys = rnd.choice(chains)
                start = rnd.randrange(len(keys))
                run_keys = keys[start:start + rnd.randint(1, 6)]
                session = rnd.choice(sessions)
                try:
                    held.append((session, w.acquire(session, run_keys)))
                except LimitExceededError:
                    if w.settle:
                        w.sessions.check_invariants()
            exact = GrantPins(gp.share, gp.capacity)
            for session, pin in held:
                if pin.id in session.grant_pins:
                    exact.charge(session.tenant, pin)
            for tenant in ("acme", "globex"):  # over-counted meanwhile, never under
                assert exact.held.get((tenant, "public"), 0) <= w.held(tenant) <= limit
            assert (exact.total_held.get("public", 0)
                    <= gp.total_held.get("public", 0) <= gp.total * SLOTS * w.slot)
        w.now = 100.0  # every lease runs out
        w.sessions.forget(set(w.store.expire(w.now)))
        w.sessions.check_invariants()
        assert w.sessions.grant_pins.held == {}

    run()
