"""SGLang's HiCache storage factory builds kvstore's backend; pages round-trip through
a real daemon, across processes.

Out of reach here: a real SGLang server (its model runner, host memory pools and
kernels need CUDA), so the host pool is a stand-in for SGLang's layer_first
MHATokenToKVPoolHost (see sglang_run.py); the factory, the config, the page hashing and
the backend interface are SGLang's own.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env


def sglang_run(role: str, daemon: DaemonProcess, tenant: str) -> Any:
    proc = run_in_env("sglang", [str(HERE / "sglang_run.py"), "--role", role,
                                 "--endpoint", daemon.endpoint, "--tenant", tenant],
                      timeout=120)
    return last_json(proc.stdout)


def test_hicache_backend_round_trip(daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory(dram_capacity="64MiB", extra=["--slab-size", "16MiB"])
    tenant = f"sglang-{uuid.uuid4().hex[:8]}"

    written = sglang_run("writer", daemon, tenant)
    assert written["backend"] == "KVStoreHiCacheStorage"
    assert written["exists_before"] == 0
    assert written["set_v1"] == [True] * 4
    assert written["exists_after"] == 4
    assert written["exists_one"] == [True, False]
    assert written["get_v1"] == [True] * 4 + [False]  # the longest cached prefix
    assert written["get_v1_bytes_equal"]
    assert written["set"] and written["batch_set"]
    assert written["get_bytes_equal"] and written["get_missing"]
    assert written["exists_all"] == 6
    assert written["other_rank_exists"] == 0
    # decode context parallelism: a logical page is two of the pool's pages wide
    assert written["dcp_set_v1"] == [True] * 3
    assert written["dcp_get_v1"] == [True] * 3
    assert written["dcp_bytes_equal"]

    read = sglang_run("reader", daemon, tenant)  # another process, another session
    assert read["exists"] == 6
    assert read["get_v1"] == [True] * 6
    assert read["bytes_equal"] and read["batch_get_bytes_equal"]
    assert read["other_tenant_exists"] == 0


def test_a_daemon_not_up_fails_no_sglang_start(tmp_path: Path) -> None:
    # SGLang's start failed with the backend's connect; now it starts, and its calls
    # miss until a connect made in the background gets through, as vLLM's connector does
    late = DaemonProcess(tmp_path / "late")  # never started
    run = sglang_run("late", late, f"sglang-{uuid.uuid4().hex[:8]}")
    assert run["made"] and run["exists"] == 0
    assert run["set_v1"] == [False, False] and run["get_v1"] == [False, False]
    assert run["seconds"] < 10


def test_batches_over_the_daemons_key_limit_are_split(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    # a reserve or acquire of more keys than a request may name was refused whole
    config = tmp_path / "few-keys.toml"
    config.write_text("[server]\nmax_keys_per_request = 4\n")
    daemon = daemon_factory(dram_capacity="64MiB",
                            extra=["--slab-size", "16MiB", "--config", str(config)])
    run = sglang_run("split", daemon, f"sglang-{uuid.uuid4().hex[:8]}")
    assert run["set_v1"] == [True] * 6
    assert run["exists"] == 6
    assert run["get_v1"] == [True] * 6
    assert run["bytes_equal"] and run["batch_get_bytes_equal"]
