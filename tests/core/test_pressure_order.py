"""The pressure chain's order: the steps in ``dram.pressure`` run in the configured
order, so the same full DRAM tier gives up different blocks under different chains
(evict and demote side by side make one pass, coldest first; apart, or alone, each
takes only its kind; steps after defer wait for its deadline).

The set-up: four DRAM slots holding, coldest first, a *dirty* block (only in DRAM, the
SSD tier would take it), a *clean* block (its copy is on SSD too) and a *lossy* block
(a cold leaf the SSD tier declines), plus one warm block; one more slot is asked for.
"""

from __future__ import annotations

import pytest
from kvtest import make_identity

from kvstore.errors import CapacityError
from kvstore.keys import chain_keys
from kvstore.store import Block, BlockStore, Namespace, Plan

IDENT = make_identity()
SLOT = IDENT.block_bytes


def _keys(ns: Namespace, i: int) -> list[bytes]:
    return chain_keys(ns.id, [i * 1000 + t for t in range(IDENT.block_tokens)],
                      IDENT.block_tokens)


def _full_store(chain: tuple[str, ...]) -> tuple[BlockStore, Namespace, dict[str, Block]]:
    store = BlockStore(4 * SLOT, 4 * SLOT, ssd_capacity=8 * SLOT, ssd_slab_bytes=4 * SLOT,
                       ssd_admit_after=2)
    store.pressure = chain  # type: ignore[assignment]
    ns = store.open_namespace(IDENT)
    blocks: dict[str, Block] = {}
    for i, name in enumerate(("dirty", "clean", "lossy", "warm")):
        keys = _keys(ns, i)
        r = store.reserve("engine", ns, keys, None, 0.0)
        store.commit("engine", r.id, 0.0)
        blocks[name] = ns.blocks[keys[0]]
        if name != "lossy":
            store.lookup(ns, keys)             # seen twice: the SSD tier admits it
        if name == "clean":
            t, _ = store.ssd_copies.reserve([blocks["clean"]])
            store.ssd_copies.finish_write(t, [object()])
    # coldest first: dirty, clean, lossy, warm
    assert list(store.drams[""].policy(ns.cls).evictable()) == list(blocks.values())
    store.check_invariants()
    return store, ns, blocks


_asked = iter(range(100, 10**6))


def _ask(store: BlockStore, ns: Namespace, count: int = 1) -> list[Block] | None:
    """Reserve ``count`` more slots (kept reserved); the blocks a demotion plan names,
    or None if they fit without one."""
    keys = [k for _ in range(count) for k in _keys(ns, next(_asked))]
    answer = store.reserve("engine", ns, keys, None, 0.0)
    return list(answer.demote) if isinstance(answer, Plan) else None


@pytest.mark.parametrize("chain", [("evict", "demote", "defer", "reject"),
                                   ("demote", "evict", "defer", "reject")])
def test_evict_and_demote_side_by_side_take_the_coldest_first(chain: tuple[str, ...]) -> None:
    """Next to each other the two steps are one pass over the eviction order: the
    coldest block goes first, written down if it must be (taking all of one kind first
    would give up hotter blocks for colder ones)."""
    store, ns, b = _full_store(chain)
    assert _ask(store, ns) == [b["dirty"]]         # the coldest, written down first
    store.ssd_copies.abort_demotion([b["dirty"]])
    store.check_invariants()
    store, ns, b = _full_store(chain)
    assert _ask(store, ns, 3) == [b["dirty"]]      # then clean and lossy just go
    assert b["clean"].offset is None and b["lossy"].key not in ns.blocks
    assert b["warm"].offset is not None
    store.ssd_copies.abort_demotion([b["dirty"]])
    store.check_invariants()


def test_evict_alone_never_writes_down() -> None:
    store, ns, b = _full_store(("evict", "reject"))
    assert _ask(store, ns, 3) is None              # dirty, clean and lossy all just go
    assert b["dirty"].key not in ns.blocks         # lost: nothing was written
    assert store.counters.demotions == 0
    store.check_invariants()


def test_demote_alone_never_drops_what_no_tier_below_keeps() -> None:
    store, ns, b = _full_store(("demote", "reject"))
    with pytest.raises(CapacityError, match="demote"):
        _ask(store, ns, 4)                         # the lossy leaf may not go
    assert b["lossy"].offset is not None and b["dirty"].offset is not None
    assert _ask(store, ns, 2) == [b["dirty"]]      # dirty and clean move down
    store.check_invariants()


@pytest.mark.parametrize("chain", [("defer", "evict", "demote", "reject"),
                                   ("defer", "reject")])
def test_a_request_that_may_still_defer_runs_only_the_steps_before_defer(
        chain: tuple[str, ...]) -> None:
    store, ns, b = _full_store(chain)
    store.early = True
    with pytest.raises(CapacityError):
        _ask(store, ns)
    assert all(x.offset is not None for x in b.values())  # nothing was taken
    store.early = False                            # its deadline passed: every step
    if "evict" in chain:
        assert _ask(store, ns) == [b["dirty"]]     # the coldest, written down first
        store.ssd_copies.abort_demotion([b["dirty"]])
    else:
        with pytest.raises(CapacityError):
            _ask(store, ns)
    store.check_invariants()


def test_steps_after_defer_do_not_run_early_but_steps_before_do() -> None:
    store, ns, b = _full_store(("evict", "defer", "demote", "reject"))
    store.early = True
    assert _ask(store, ns, 2) is None              # clean and lossy go by eviction
    with pytest.raises(CapacityError):
        _ask(store, ns)                            # the dirty ones wait for the deadline
    store.early = False
    assert _ask(store, ns) == [b["dirty"]]
    store.ssd_copies.abort_demotion([b["dirty"]])
    store.check_invariants()
