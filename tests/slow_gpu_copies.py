"""``python tests/slow_gpu_copies.py serve ...``: the daemon, its copies into the GPU tier
held while the file ``$GPU_HOLD_FLAG`` exists (the DRAM copies they read stay pinned
meanwhile, as they do for the length of a slow device copy); ``$GPU_HOLD_REACHED`` is
created when a copy is held."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.gpu_mover import GpuMover

FLAG = os.environ["GPU_HOLD_FLAG"]
REACHED = os.environ["GPU_HOLD_REACHED"]
_copy = GpuMover._copy


def _held_copy(self: GpuMover, items: list[tuple[memoryview, int]]) -> Any:
    while os.path.exists(FLAG):
        Path(REACHED).touch()
        time.sleep(0.02)
    return _copy(self, items)


GpuMover._copy = _held_copy  # type: ignore[method-assign]

if __name__ == "__main__":
    from kvstore.cli import main

    sys.exit(main(sys.argv[1:]))
