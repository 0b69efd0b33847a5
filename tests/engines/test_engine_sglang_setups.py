"""kvstore's HiCache backend under set-ups users' SGLang engines have and the other
engine tests do not: engines of another page size on the daemon, requests longer than
DRAM with an SSD tier (sglang_setups_run.py, in the SGLang environment, against a real
daemon)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def setup_run(role: str, daemon: DaemonProcess) -> Any:
    proc = run_in_env("sglang", [str(HERE / "sglang_setups_run.py"), "--role", role,
                                 "--endpoint", daemon.endpoint,
                                 "--tenant", f"sglang-{uuid.uuid4().hex[:8]}"],
                      timeout=180)
    return last_json(proc.stdout)


def test_a_batch_fits_what_an_engine_of_another_page_size_leaves(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # one reservation of all 64 pages (the arena's slots) was refused, 48 free: none
    # was stored, and the engine found and loaded nothing
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    run = setup_run("mixed", daemon)
    assert run["small_stored"] == [True, True]
    assert run["stored"] == 48 and run["found"] == 48 and run["loaded"] == 48
    assert run["bytes_equal"]
    assert run["held"] == {"pinned": 0, "reserved": 0}


def test_a_request_longer_than_dram_goes_to_ssd_and_loads_back(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # a reservation of DRAM's size after a parent kept in DRAM was refused (32 of 80
    # stored); then a load of pages on SSD more than DRAM holds, in one pin, was refused
    # (80 found, none loaded)
    daemon = daemon_factory(dram_capacity="32MiB", ssd_capacity="256MiB",
                            extra=["--slab-size", "16MiB"])
    run = setup_run("longer_than_dram", daemon)
    assert run["stored"] == 80 and run["found"] == 80 and run["loaded"] == 80
    assert run["bytes_equal"]
    assert run["held"] == {"pinned": 0, "reserved": 0}
