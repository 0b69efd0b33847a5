"""Shared test helpers (imported by tests; not a conftest, so the name is unique)."""

from __future__ import annotations

import os
import time
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
