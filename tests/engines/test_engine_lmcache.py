"""LMCache's own L2 adapter benchmark (``lmcache bench l2``) on kvstore's adapter, against
a real daemon, with round-trip verification on; then fresh processes look up and load
what the first one stored."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon_proc import DaemonProcess
from engine_envs import HERE, last_json, run_in_env

NUM_KEYS, IN_FLIGHT, ROUNDS, OBJECT_KB = 16, 2, 2, 256
MEASURED_KEYS = NUM_KEYS * IN_FLIGHT * ROUNDS


def bench(tmp: Path, name: str, adapter: dict[str, Any], *args: str) -> tuple[dict[str, Any], str]:
    """Run ``lmcache bench l2``; return its JSON report's metrics and its stdout."""
    report = tmp / f"{name}.json"
    proc = run_in_env("lmcache", [
        "-m", "lmcache.cli.main", "bench", "l2", "--l2-adapter", json.dumps(adapter),
        "--num-keys", str(NUM_KEYS), "--in-flight", str(IN_FLIGHT),
        "--rounds", str(ROUNDS), "--warmup-rounds", "1", "--data-size-kb", str(OBJECT_KB),
        "--format", "json", "--output", str(report), *args], timeout=120)
    metrics = json.loads(report.read_text())["metrics"]
    return {m["operation"]: m for key, m in metrics.items() if key.startswith("op_")}, proc.stdout


def test_bench_l2_stores_looks_up_and_loads_verified(
        daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    daemon = daemon_factory(dram_capacity="128MiB", extra=["--slab-size", "16MiB"])
    adapter = {"type": "plugin", "module_path": "kvstore.integrations.lmcache",
               "class_name": "KVStoreL2Adapter",
               "adapter_params": {"endpoint": daemon.endpoint,
                                  "tenant": f"lmcache-{uuid.uuid4().hex[:8]}",
                                  "object_bytes": OBJECT_KB * 1024}}

    ops, stdout = bench(tmp_path, "all", adapter, "--no-skip-verify",
                        "--lookup-max-hit-rate", "1.0")
    assert set(ops) == {"Store", "Lookup", "Load"}
    for op in ops.values():
        assert op["rounds_timed_out"] == 0, op
        assert op["total_keys"] == MEASURED_KEYS, op
        assert op["total_success"] == MEASURED_KEYS, op
    assert ops["Lookup"]["actual_hit_rate"] == 1.0
    assert f"All {NUM_KEYS * IN_FLIGHT} keys data verified OK" in stdout

    # New processes and daemon sessions: half the looked-up keys were stored, the rest
    # never were; every stored key loads.
    ops, _ = bench(tmp_path, "lookup", adapter, "--only", "lookup",
                   "--lookup-max-hit-rate", "0.5")
    assert ops["Lookup"]["total_success"] == MEASURED_KEYS // 2
    ops, _ = bench(tmp_path, "load", adapter, "--only", "load")
    assert ops["Load"]["total_success"] == MEASURED_KEYS


def test_a_held_up_store_holds_up_no_lookup_or_load(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    # Stores run on a thread (and a daemon connection) of their own: one whose objects'
    # bytes are not ready yet must not keep a lookup and a load queued after it waiting.
    daemon = daemon_factory(dram_capacity="64MiB")
    proc = run_in_env("lmcache", [str(HERE / "lmcache_store_thread.py"), daemon.endpoint,
                                  f"lmcache-{uuid.uuid4().hex[:8]}"], timeout=120)
    out = last_json(proc.stdout)
    assert out["first_store"] and out["first_result"] == [True], out
    assert out["lookup_while_held"] and out["found"] == 8, out
    assert out["load_while_held"] and out["loaded"] == 8 and out["same_bytes"], out
    assert not out["held_store_done_early"], out
    assert out["late_store"] and out["late_result"] == [True], out
