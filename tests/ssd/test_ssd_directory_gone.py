"""The SSD tier's directory removed or replaced under an open store: ``directory_missing``
says what (the daemon's timer turns the tier off on it; ``tests/ops/test_ops_s63b.py``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvstore.tiers.ssd import directory_missing
from ssd_helpers import StoreFactory


def test_an_untouched_directory_is_not_missing(open_store: StoreFactory) -> None:
    assert directory_missing(open_store()) is None


@pytest.mark.parametrize("change, said", [
    (lambda p: shutil.rmtree(p), "the directory was removed"),
    (lambda p: (p.rename(p.with_name("old")), p.mkdir()), "the directory was replaced"),
    (lambda p: (p / "blocks.dat").unlink(), "its data file was removed"),
    (lambda p: (p / "lock").unlink(), "its lock file was removed"),
    (lambda p: os.replace(p / "index" / "lock.mdb", p / "index" / "data.mdb"),
     "its index was replaced"),
])
def test_a_changed_directory_is_named(open_store: StoreFactory, tmp_path: Path,
                                      change: object, said: str) -> None:
    store = open_store()
    change(tmp_path / "ssd")  # type: ignore[operator]
    found = directory_missing(store)
    assert found is not None and found.startswith(said), found
