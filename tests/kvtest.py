"""Shared test helpers (imported by tests; not a conftest, so the name is unique)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstore import Client, Identity


def make_identity(**changes: Any) -> Identity:
    fields: dict[str, Any] = dict(
        model="tiny-llama", model_revision="r1", tenant="acme", kv_dtype="float16",
        num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16)
    fields.update(changes)
    return Identity(**fields)


def wait_for_lease_end(endpoint: str, tenant: str, at_most: float) -> None:
    """Until the daemon holds no session of ``tenant`` but a watcher's own (the others'
    leases ran out), or ``at_most`` seconds: what a test letting a lease run out waits
    for, rather than a fixed sleep (the watcher's requests keep its own session)."""
    deadline = time.monotonic() + at_most
    with Client(endpoint, tenant=tenant) as watcher:
        while watcher.stats()["sessions"] > 1 and time.monotonic() < deadline:
            time.sleep(0.02)


def arena_memory(pid: int) -> int:
    """The bytes a daemon's arena memory files (memfd arenas) hold now: their allocated
    blocks, each file once (an arena is open twice: its read-only twin)."""
    files: dict[int, int] = {}  # by inode
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            if os.readlink(f"{fds}/{fd}").startswith("/memfd:kvstore-arena"):
                st = os.stat(f"{fds}/{fd}")
                files[st.st_ino] = st.st_blocks * 512
        except OSError:
            continue  # (closed meanwhile)
    return sum(files.values())


def tenants_daemon(daemon_factory: Callable[..., Any], tmp_path: Path, capacity: str,
                   dram: str = "", auth: str = "",
                   **more: Any) -> tuple[Any, Callable[[str], str]]:
    """A daemon with credentials (a secret signing tenants' tokens; ``ops`` an operator,
    who sees the whole daemon's figures), so each tenant has its own arena; ``auth``
    (TOML after the ``[auth]`` keys: grants) and ``dram`` (lines of the ``[dram]``
    section); ``more``: the daemon's other settings.  With the token of a tenant."""
    from kvstore.auth import issue_token, read_secret, write_secret

    secret_file = tmp_path / "secret"
    write_secret(secret_file)
    config = tmp_path / "tenants.toml"
    config.write_text(f'[auth]\nsecret_file = "{secret_file}"\noperators = ["ops"]\n'
                      f'{auth}[dram]\n{dram}')
    d = daemon_factory(dram_capacity=capacity, extra=["--config", str(config)], **more)
    secret = read_secret(secret_file)
    return d, lambda tenant: issue_token(secret, tenant, 600.0)


def settled(client: Client, at_most: float = 10.0) -> dict[str, Any]:
    """The daemon's DRAM figures once nothing is reserved or pinned (a get's release is
    posted without waiting and may be served after a later request: polled)."""
    deadline = time.monotonic() + at_most
    while True:
        dram: dict[str, Any] = client.stats()["tiers"]["dram"]
        if (dram["reserved_slots"], dram["pinned_blocks"]) == (0, 0):
            return dram
        assert time.monotonic() < deadline, dram
        time.sleep(0.02)


def written(r: Any, data: dict[bytes, bytes]) -> Any:
    """A reservation ``r`` with its own slots written from ``data`` (by key); the keys
    it got no slot for (offset -1: held, or awaited from another writer) left alone."""
    for key, buf, offset in zip(r.keys, r.buffers, r.offsets):
        if offset >= 0:
            buf[:] = data[key]
    return r


def commits_waited(client: Client, commits: int = 1, at_most: float = 20.0) -> None:
    """Until ``commits`` commits have waited for older writers (polled, within a bound)."""
    deadline = time.monotonic() + at_most
    while client.stats()["tiers"]["dram"].get("commits_waited", 0) < commits:
        assert time.monotonic() < deadline, client.stats()["tiers"]["dram"]
        time.sleep(0.02)


def key_bytes(key: bytes, size: int) -> bytes:
    """The bytes every writer of ``key`` writes in the mixed tests: derived from the key."""
    return hashlib.blake2b(key, digest_size=32).digest() * (size // 32)


def misread(ns: Any, keys: list[bytes]) -> list[bytes]:
    """The keys of the cached prefix of ``keys`` whose bytes read back are not their
    ``key_bytes`` (none where the prefix was evicted between the lookup and the get)."""
    from kvstore.errors import NotFoundError

    hits = ns.lookup(keys).blocks
    try:
        got = ns.get(keys[:hits]) if hits else []
    except NotFoundError:
        return []
    return [k for k, b in zip(keys, got) if b != key_bytes(k, ns.block_bytes)]


def wait_for_file(path: Path, what: str, at_most: float = 10.0) -> None:
    """Until ``path`` exists (a wrapper's sign that it holds what it was told to)."""
    deadline = time.monotonic() + at_most
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@contextmanager
def removed_after(flag: Path, seconds: float = 0.8) -> Iterator[None]:
    """``flag`` removed ``seconds`` from now by a thread (joined on the way out): what
    a wrapper holds while it exists goes on meanwhile."""
    def remove() -> None:
        time.sleep(seconds)
        flag.unlink()

    remover = threading.Thread(target=remove)
    remover.start()
    try:
        yield
    finally:
        remover.join()
