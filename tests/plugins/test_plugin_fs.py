"""The fs backend beyond the contract: layout, atomic writes, full disks, late writes."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from pathlib import Path

import pytest

from kvstore.errors import BackendError, UnavailableError
from kvstore.plugins import GuardedBackend, fs_backend, load_backend
from kvstore.plugins.fs_backend import FsBackend

NS = bytes(range(16))
KEY = bytes(range(16, 32))


def fs(root: Path, **options: object) -> GuardedBackend:
    return load_backend("fs", {"path": str(root), **options})


def test_layout_and_no_temporary_files_left(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = fs(tmp_path, fsync=True)
        assert await backend.put(NS, [KEY], [b"x" * 1000]) == [True]
        await backend.close()

    asyncio.run(scenario())
    files = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [f"{NS.hex()}/{KEY.hex()[:2]}/{KEY.hex()}"]


def test_a_full_disk_fails_the_key_not_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs_backend, "_write_all", full)

    async def scenario() -> None:
        backend = fs(tmp_path)
        assert await backend.put(NS, [KEY], [b"x"]) == [False]
        await backend.close()

    asyncio.run(scenario())
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "the temporary file is removed"


def test_other_os_errors_raise_typed_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failure = OSError(errno.EIO, "Input/output error")

    def broken(fd: int, data: object) -> None:
        raise failure

    monkeypatch.setattr(fs_backend, "_write_all", broken)

    async def scenario() -> None:
        backend = fs(tmp_path)
        with pytest.raises(BackendError, match="Input/output error"):
            await backend.put(NS, [KEY], [b"x"])
        failure.errno = errno.ETIMEDOUT
        with pytest.raises(UnavailableError):
            await backend.put(NS, [KEY], [b"x"])
        await backend.close()

    asyncio.run(scenario())


def test_health_of_an_unusable_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")

    async def scenario() -> None:
        backend = fs(blocker / "blocks")
        health = await backend.health()
        assert not health.ok and "fs backend" in health.detail
        assert (await fs(tmp_path / "new").health()).capacity_bytes

    asyncio.run(scenario())


class SlowReader(FsBackend):
    """Reads take 0.4 s whatever happens, as a read stuck in the kernel would."""

    wrote_at: float | None = None

    def _read_one(
        self, stop: threading.Event, namespace: bytes, key: bytes, out: memoryview
    ) -> int:
        time.sleep(0.4)
        out[:] = b"L" * out.nbytes
        self.wrote_at = time.monotonic()
        return 0


def test_a_timed_out_read_never_writes_into_the_buffer_afterwards(tmp_path: Path) -> None:
    """The caller reuses its buffers after an error; a thread must not fill them later."""
    inner = SlowReader(tmp_path, threads=2)
    backend = GuardedBackend(inner, name="fs", timeout_s=0.1)
    buffer = bytearray(8)

    async def scenario() -> float:
        with pytest.raises(UnavailableError):
            await backend.get_into(NS, [KEY], [memoryview(buffer)])
        raised_at = time.monotonic()
        await backend.close()
        return raised_at

    raised_at = asyncio.run(scenario())
    assert inner.wrote_at is not None and inner.wrote_at <= raised_at
    assert buffer == b"L" * 8
    time.sleep(0.1)
    assert buffer == b"L" * 8


def test_concurrent_writers_leave_a_whole_value(tmp_path: Path) -> None:
    values = [bytes([i]) * 300_000 for i in range(1, 9)]

    async def scenario() -> None:
        writers = [fs(tmp_path) for _ in range(4)]
        await asyncio.gather(*(w.put(NS, [KEY] * 2, values[2 * i:2 * i + 2])
                               for i, w in enumerate(writers)))
        out = bytearray(300_000)
        assert await writers[0].get_into(NS, [KEY], [memoryview(out)]) == [True]
        assert bytes(out) in values
        for writer in writers:
            await writer.close()

    asyncio.run(scenario())
    leftovers = [p.name for p in tmp_path.rglob(".*.tmp")]
    assert leftovers == []


def test_closed_pool_is_unavailable(tmp_path: Path) -> None:
    async def scenario() -> None:
        inner = FsBackend(tmp_path)
        await inner.close()
        with pytest.raises(UnavailableError, match="closed"):
            await inner.exists(NS, [KEY])

    asyncio.run(scenario())


def test_relative_paths_and_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    backend = load_backend("fs", {"path": "~/blocks"})
    assert isinstance(backend.inner, FsBackend)
    assert backend.inner.root == tmp_path / "blocks"
    assert os.fspath(backend.inner.path_for(NS, KEY)).startswith(str(tmp_path))


def test_the_generation_is_shared_and_changes_when_the_directory_is_emptied(
        tmp_path: Path) -> None:
    """The token a daemon checks to tell a store that lost what it held: one for every
    backend on the directory, made once (two making it at once agree), kept while the
    directory keeps its files, another once it was emptied."""
    root = tmp_path / "store"

    async def tokens(count: int) -> list[bytes | None]:
        backends = [fs(root) for _ in range(count)]
        try:
            return list(await asyncio.gather(*(b.generation() for b in backends)))
        finally:
            for b in backends:
                await b.close()

    first = asyncio.run(tokens(8))
    assert first[0] and len(set(first)) == 1
    assert asyncio.run(tokens(1)) == first[:1]
    assert [p.name for p in root.iterdir()] == ["generation"]  # no temporary file left
    for path in sorted(root.rglob("*"), reverse=True):  # emptied, as by rm -rf store/*
        path.unlink() if path.is_file() else path.rmdir()
    second = asyncio.run(tokens(2))
    assert second[0] and second[0] != first[0] and second[0] == second[1]
