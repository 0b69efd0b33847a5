from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_proc import DaemonProcess  # noqa: E402

from kvtest import make_identity  # noqa: E402

from kvstore import Identity  # noqa: E402


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
