"""An engine's pins whose releases all fail (the daemon gone, the session ended) were a
warning each, every pin of every step; now the first, then one in 10 s with a count."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvstore.errors import NoSessionError
from kvstore.integrations import engine_side


class Gone:
    def release(self) -> None:
        raise NoSessionError("no session: the daemon restarted")


def test_releases_failing_at_every_pin_are_one_line(caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: Any) -> None:
    monkeypatch.setattr(engine_side, "_RELEASES", engine_side.Repeats(engine_side.logger))
    with caplog.at_level(logging.WARNING, logger=engine_side.logger.name):
        for _ in range(50):  # 50 steps of 8 pins
            engine_side.release_all([Gone() for _ in range(8)])
    lines = [r for r in caplog.records if "release failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
