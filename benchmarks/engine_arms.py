"""The alternatives' arms of ``engine_e2e.py``: vLLM's own CPU offloading connectors and
LMCache's two vLLM connectors, each set up as its makers document, and the reason
each one that cannot run on vLLM's CPU build gives.

Apart from the benchmark because they carry what the CPU build needs to run LMCache
at all: LMCache's connectors need an environment with both vLLM and LMCache (``bash
tests/engines/setup_envs.sh vllm-lmcache``, opt-in); the in-process one
(``LMCacheConnectorV1``) fails to start its engine there and would go on recomputing
everything, so it is stopped with LMCache's error; the multiprocess one
(``LMCacheMPConnector``, what vLLM's ``kv_offloading_backend="lmcache"`` picks) runs
against an ``lmcache server`` in LMCache's engine-driven transfer mode (the worker
copies the pages, the only mode LMCache offers for a CPU device), once vLLM's worker
is kept from tripping over llvmlite (``spare_llvmlite``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ARMS = ["vllm-offload", "vllm-simple-offload", "lmcache", "lmcache-mp"]
SERVER_LOG = "KVSTORE_E2E_LMCACHE_LOG"   # the lmcache server's log, for the arm's counts


def cannot_run(arm: str) -> str:
    """Why an arm cannot run in this environment, known before its engine starts ("" if
    it may; the others say why themselves when their engine starts)."""
    if arm.startswith("lmcache") and importlib.util.find_spec("lmcache") is None:
        return ("ModuleNotFoundError: No module named 'lmcache': LMCache's connectors "
                "import it, and this vLLM environment lacks it (the engine tests keep "
                "LMCache in an environment without vLLM): run this benchmark with the "
                "Python of .engine-envs/vllm-lmcache, which `bash "
                "tests/engines/setup_envs.sh vllm-lmcache` makes")
    return ""


def engine_kwargs(arm: str, a: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    """``LLM``'s arguments for one of these arms, ``--store-mib`` of DRAM each."""
    from vllm.config import KVTransferConfig

    if arm == "vllm-offload":   # vLLM's OffloadingConnector with its CPU backend
        return {"kv_offloading_size": a.store_mib / 1024}
    if arm == "vllm-simple-offload":
        return {"kv_transfer_config": KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": a.store_mib << 20})}
    if arm == "lmcache":   # LMCache's engine in this process, configured by environment
        os.environ.update(LMCACHE_CHUNK_SIZE=str(a.lmcache_chunk), LMCACHE_LOCAL_CPU="True",
                          LMCACHE_MAX_LOCAL_CPU_SIZE=str(a.store_mib / 1024))
        return {"kv_transfer_config": KVTransferConfig(kv_connector="LMCacheConnectorV1",
                                                       kv_role="kv_both")}
    if arm == "lmcache-mp":
        spare_llvmlite()
        host, port = endpoint.rsplit(":", 1)
        return {"kv_transfer_config": KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": host, "lmcache.mp.port": int(port),
                                       "lmcache.mp.mq_timeout": 60})}
    raise ValueError(f"unknown arm {arm}")


def spare_llvmlite() -> None:
    """Keep vLLM's CPU build from tripping on llvmlite, which LMCache's numba loads
    before the engine's worker starts: the worker scans every module's namespace for
    Triton kernels to swap, asking each value for its ``__dict__``, and llvmlite's
    library wrapper answers any name with a function wrapper (``AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'``).  Here it answers dunders no
    more."""
    from llvmlite.binding import ffi

    wrapper = type(ffi.lib)
    lookup = wrapper.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    wrapper.__getattr__ = __getattr__


def failure(llm: Any) -> str:
    """The error LMCache's in-process engine logged at its start, if it failed ("" if
    not): LMCacheConnectorV1 then carries on "in degraded mode (recompute)", so the arm
    would measure the engine alone plus LMCache's lookups timing out."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    manager = getattr(getattr(worker, "_lmcache_engine", None), "_manager", None)
    if not getattr(manager, "_init_failed", False):
        return ""
    logged = getattr(manager, "_init_failed_reason", "")
    reason = [line for line in str(logged).splitlines() if line]
    return (f"{reason[-1] if reason else 'unknown'} (LMCacheConnectorV1's engine did not "
            f"start; LMCache would recompute every token)")


def start_server(a: argparse.Namespace, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``lmcache server`` on loopback with ``--store-mib`` of DRAM (its L1), in the
    engine-driven transfer mode over shared memory, its log in the work directory
    (``server_tokens`` reads it); up once its HTTP frontend answers."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
    with open(work / "lmcache-server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
             "--port", str(ports[0]), "--http-host", "127.0.0.1", "--http-port",
             str(ports[1]), "--l1-size-gb", str(a.store_mib / 1024), "--eviction-policy",
             "LRU", "--chunk-size", str(a.lmcache_chunk), "--disable-observability",
             "--supported-transfer-mode", "engine_driven",
             "--shm-name", f"kvstore-e2e-{uuid.uuid4().hex[:8]}"],
            stdout=log, stderr=log, env=env, cwd=work)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", ports[1]), timeout=0.5):
                return proc, f"tcp://127.0.0.1:{ports[0]}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"lmcache server did not come up (see {work / 'lmcache-server.log'})")


def server_tokens() -> dict[str, int]:
    """The tokens the ``lmcache-mp`` arm's server logged it retrieved (as
    ``s_hit_tokens``, the report's "loaded") and stored, so far; {} in other arms."""
    stats: dict[str, int] = {}
    if log := os.environ.get(SERVER_LOG):
        for line in Path(log).read_text(errors="replace").splitlines():
            for what, key in (("Retrieved ", "s_hit_tokens"), ("Stored ", "lmcache_stored")):
                if what in line and " tokens in " in line:
                    stats[key] = stats.get(key, 0) + int(line.split(what, 1)[1].split()[0])
    return stats
