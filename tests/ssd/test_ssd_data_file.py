"""The data file's positional I/O: runs split and issued several at a time, read back exact."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

from kvstore.errors import BackendError
from kvstore.tiers.ssd_io import DataFile, Span
from kvstore.tiers.ssd_layout import SlabLayout

MiB = 1 << 20
LAYOUT = SlabLayout(capacity_bytes=64 * MiB, slab_bytes=8 * MiB)


def spans_of(buffer: mmap.mmap, offsets: list[int], length: int) -> list[Span]:
    view = memoryview(buffer)
    return [Span(off, view[i * length:(i + 1) * length]) for i, off in enumerate(offsets)]


@pytest.mark.parametrize("queue_depth", [1, 4])
@pytest.mark.parametrize("direct_io", [False, True])
@pytest.mark.parametrize("length", [256 << 10, 2 * MiB, 12288])
def test_scattered_and_adjacent_runs_round_trip(tmp_path: Path, queue_depth: int,
                                                direct_io: bool, length: int) -> None:
    rng = random.Random(length * queue_depth)
    slots = LAYOUT.capacity_bytes // length
    # adjacent runs longer than one syscall's limit, plus scattered single blocks
    offsets = [i * length for i in range(12)]
    offsets += [i * length for i in rng.sample(range(12, slots), 9)]
    data = mmap.mmap(-1, len(offsets) * length)
    data.write(rng.randbytes(len(data)))
    f = DataFile(tmp_path / "data", LAYOUT, direct_io=direct_io, preallocate=False,
                 queue_depth=queue_depth)
    try:
        f.write(spans_of(data, offsets, length), sync=True)
        back = mmap.mmap(-1, len(data))
        got = f.read(spans_of(back, offsets, length))
        assert got == [length] * len(offsets)
        assert back[:] == data[:]
        # a read past the end of the file comes back short, the others whole
        tail = mmap.mmap(-1, 2 * length)
        end = LAYOUT.capacity_bytes
        os.truncate(tmp_path / "data", end - length // 2)
        got = f.read(spans_of(tail, [0, end - length], length))
        assert got == [length, length // 2]
    finally:
        f.close()


def test_an_error_in_one_run_is_raised_after_the_others_finish(tmp_path: Path) -> None:
    f = DataFile(tmp_path / "data", LAYOUT, direct_io=False, preallocate=False,
                 queue_depth=4)
    finished: list[int] = []

    def action(run: tuple[list[Span], bool]) -> int:
        offset = run[0][0].offset
        if offset == 2 * MiB:
            raise OSError(5, "injected")
        finished.append(offset)
        return offset

    runs = [([Span(i * MiB, memoryview(b""))], False) for i in range(8)]
    try:
        with pytest.raises(OSError, match="injected"):
            f._each(runs, action)
        assert sorted(finished) == [i * MiB for i in range(8) if i != 2]
    finally:
        f.close()


def test_write_into_a_closed_file_is_a_backend_error(tmp_path: Path) -> None:
    f = DataFile(tmp_path / "data", LAYOUT, direct_io=False, preallocate=False)
    data = mmap.mmap(-1, 8192)
    f.close()
    with pytest.raises(BackendError):
        f.write(spans_of(data, [0, 4096 * 4], 4096), sync=False)
