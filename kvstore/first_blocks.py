"""The store's map of first blocks: a chain's first key -> the namespace it heads.

A router's probe finds a chain's namespace by one lookup of its first key rather than
asking every namespace its tenants see.  Keys made by the client library are hashed
with their namespace, so a key heads a chain in one namespace at most; but a client may
send keys of its own making, and one key may then head chains in several namespaces
(of any tenants).  Such a key maps to them all, by tenant: one namespace setting it
must not take another's place (a tenant that knew another's first key, as of a shared
system prompt, hid that tenant's chain from its routers, and dropping its own lost the
other's entry), and one dropping it leaves the others.

The common case stays one dict operation: ``roots.setdefault(key, ns) is ns``.  A key
of several heads maps to ``{tenant: {namespace: None}}``, so that adding or removing one
costs O(1) however many there are (a tuple of them, copied at each change, let a tenant
make one key head thousands of its own namespaces and each commit or eviction of them
cost as many steps: quadratic to build, quadratic to evict), and a probe looks only at
the tenants its session sees, its own first (``visible_head``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from kvstore.blocks import Namespace

Heads = Union["Namespace", dict[str, dict["Namespace", None]]]


def also_heads(roots: dict[bytes, Heads], key: bytes, ns: Namespace) -> None:
    """``ns`` has a first block ``key`` too (after ``roots.setdefault(key, ns)`` found
    another namespace there)."""
    had = roots[key]
    if not isinstance(had, dict):
        if had is ns:
            return
        had = roots[key] = {had.tenant: {had: None}}
    group = had.get(ns.tenant)
    if group is None:
        had[ns.tenant] = {ns: None}
    else:
        group[ns] = None


def no_longer_heads(roots: dict[bytes, Heads], key: bytes, ns: Namespace) -> None:
    """``ns`` has no first block ``key`` any more; other namespaces keep theirs."""
    had = roots.get(key)
    if had is ns:
        del roots[key]
        return
    if not isinstance(had, dict):
        return
    group = had.get(ns.tenant)
    if group is None or ns not in group:
        return
    del group[ns]
    if not group:
        del had[ns.tenant]
    if len(had) == 1:
        (only,) = had.values()
        if len(only) == 1:  # one head left: back to the common case
            roots[key] = next(iter(only))


def headed_by(roots: dict[bytes, Heads], key: bytes) -> tuple[Namespace, ...]:
    """The namespaces with a first block ``key`` (by tenant, each tenant's in the order
    added): O(them), for checks and tests."""
    had = roots.get(key)
    if had is None:
        return ()
    if not isinstance(had, dict):
        return (had,)
    return tuple(ns for group in had.values() for ns in group)


def visible_head(roots: dict[bytes, Heads], key: bytes,
                 tenants: Sequence[str]) -> Namespace | None:
    """The first namespace with a first block ``key`` of the first of ``tenants`` that
    has one (a session's own tenant first, then those that share with it), or None:
    O(``tenants``), however many namespaces the key heads.  A session's own chain is
    never hidden by a namespace of another tenant under its first key (a writer of a
    namespace shared with it could plant one there)."""
    had = roots.get(key)
    if had is None:
        return None
    if not isinstance(had, dict):
        return had if had.tenant in tenants else None
    for tenant in tenants:
        group = had.get(tenant)
        if group:
            return next(iter(group))
    return None
