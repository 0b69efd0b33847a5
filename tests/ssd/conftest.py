"""Fixtures for the SSD tier tests: real files under tmp_path, real LMDB."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.tiers.ssd import SSDStore
from ssd_helpers import MiB, StoreFactory


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[StoreFactory]:
    """Opens stores (default: 64 MiB in 8 MiB slabs under tmp_path/ssd); closes them all."""
    opened: list[SSDStore] = []

    def factory(path: Path | None = None, capacity: int = 64 * MiB, **kw: Any) -> SSDStore:
        kw.setdefault("slab_bytes", 8 * MiB)
        store = SSDStore(path or tmp_path / "ssd", capacity, **kw)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()
