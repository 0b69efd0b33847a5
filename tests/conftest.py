from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_proc import DaemonProcess  # noqa: E402

from kvstore import Identity  # noqa: E402


def make_identity(**changes: Any) -> Identity:
    fields: dict[str, Any] = dict(
        model="tiny-llama", model_revision="r1", tenant="acme", kv_dtype="float16",
        num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16)
    fields.update(changes)
    return Identity(**fields)


@pytest.fixture
def identity() -> Identity:
    return make_identity()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(**kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path / f"daemon{len(started)}", **kwargs)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.stop()
        assert "invariant violated" not in d.log(), d.log()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return daemon_factory(tcp=True)
