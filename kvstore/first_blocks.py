"""The store's map of first blocks: a chain's first key -> the namespace it heads.

A router's probe finds a chain's namespace by one lookup of its first key rather than
asking every namespace its tenants see.  Keys made by the client library are hashed
with their namespace, so a key heads a chain in one namespace at most; but a client may
send keys of its own making, and one key may then head chains in several namespaces
(of any tenants).  Such a key maps to a tuple of them: one namespace setting it must
not take another's place (a tenant that knew another's first key, as of a shared
system prompt, hid that tenant's chain from its routers, and dropping its own lost the
other's entry), and one dropping it leaves the others.  The common case stays one dict
operation: ``roots.setdefault(key, ns) is ns``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from kvstore.blocks import Namespace

Heads = Union["Namespace", tuple["Namespace", ...]]


def also_heads(roots: dict[bytes, Heads], key: bytes, ns: Namespace) -> None:
    """``ns`` has a first block ``key`` too (after ``roots.setdefault(key, ns)`` found
    another namespace there)."""
    had = roots[key]
    if isinstance(had, tuple):
        if ns not in had:
            roots[key] = (*had, ns)
    elif had is not ns:
        roots[key] = (had, ns)


def no_longer_heads(roots: dict[bytes, Heads], key: bytes, ns: Namespace) -> None:
    """``ns`` has no first block ``key`` any more; other namespaces keep theirs."""
    had = roots.get(key)
    if had is ns:
        del roots[key]
    elif isinstance(had, tuple) and ns in had:
        rest = tuple(n for n in had if n is not ns)
        roots[key] = rest[0] if len(rest) == 1 else rest


def headed_by(roots: dict[bytes, Heads], key: bytes) -> tuple[Namespace, ...]:
    """The namespaces with a first block ``key``."""
    had = roots.get(key)
    if had is None:
        return ()
    return had if isinstance(had, tuple) else (had,)
