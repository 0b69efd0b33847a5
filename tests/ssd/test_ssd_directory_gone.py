"""The SSD tier's directory removed or replaced under an open store: ``directory_missing``
says what (the daemon's timer turns the tier off on it; ``tests/ops/test_ops_s63b.py``)."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path

import pytest

from kvstore.ssd_watch import SsdDirectoryWatch
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


@pytest.mark.parametrize("errno_", [errno.EIO, errno.ESTALE, errno.EACCES])
def test_a_stat_that_fails_otherwise_is_no_finding(open_store: StoreFactory,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   errno_: int) -> None:
    """A stat failing for another reason than the path being gone (an I/O error, a stale
    handle, a permission: perhaps for a moment) is raised to the watch, which logs it and
    looks again, not reported as the directory gone: one such stat turned the tier off
    until a restart and dropped every copy of files that were intact."""
    store = open_store()
    real = os.stat

    def failing(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).endswith("blocks.dat"):
            raise OSError(errno_, os.strerror(errno_), str(path))
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", failing)
    with pytest.raises(OSError):
        directory_missing(store)  # before: "its data file cannot be found: ..."
    monkeypatch.setattr(os, "stat", real)
    assert directory_missing(store) is None  # (looked at again: all there)


def test_the_watch_looks_again_after_a_failed_check() -> None:
    """The timer's side: a check that raised is logged and tried again; only a finding
    turns the tier off."""
    calls: list[str] = []
    results: list[object] = [OSError(errno.EIO, "Input/output error"), None,
                              "the directory was removed"]

    def missing() -> str | None:
        calls.append("check")
        result = results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result  # type: ignore[return-value]

    lost: list[str] = []

    async def run() -> None:
        watch = SsdDirectoryWatch(missing, lost.append, period=0.01)
        watch.start()
        for _ in range(200):
            if lost:
                break
            await asyncio.sleep(0.01)
        watch.close()

    asyncio.run(run())
    assert calls == ["check"] * 3 and lost == ["the directory was removed"]
