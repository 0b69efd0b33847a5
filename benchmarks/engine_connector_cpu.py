"""The vLLM connector's own time per request, in-process: no engine, a real daemon.

    .engine-envs/vllm/bin/python benchmarks/engine_connector_cpu.py [--against ROOT]
        [--rounds 7]
    .engine-envs/vllm/bin/python benchmarks/engine_connector_cpu.py --profile

``engine_e2e.py`` measures the connector's share of a first token (lookup, load, save
a request) beside a 35 ms forward that varies more than that share.  This program makes
the connector's calls alone, as vLLM's scheduler and worker make them for the requests
of multi-round QA one at a time (``engine_e2e.py``'s ``mrqa``: a shared system prompt,
a history per user, rounds of question and answer, its block size and model shape,
vLLM's CPU layout of pages), against a daemon process (``kvstore serve``): two
connector instances, the scheduler's and the worker's, built from a stub of vLLM's
configuration; the engine's own prefix cache holds the system prompt.  Per request of
rounds 2 and later, the median of the main thread's CPU time and of the wall time in
each part: ``lookup`` (``on_new_request`` + ``get_num_new_matched_tokens``), ``alloc``
(``update_state_after_alloc`` + ``build_connector_meta``), ``load``
(``handle_preemptions`` + ``start_load_kv``: ``engine_e2e``'s load), ``layers``
(``wait_for_layer_load`` of every layer: the copy's share past the forward's layers), ``save`` (``wait_for_save``); ``step``: the
first token's step, its forward included; ``_max``: the slowest request's (the tail).  The forward is
computation on the engine's one thread (a layer at a time, after its wait), the
daemon's and the sockets' threads idle meanwhile, as in the engine.  ``--against`` alternates
rounds with another checkout (``alternated.py``); ``--profile`` prints cProfile's top
functions of the connector's calls instead.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # run by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

BLOCK, LAYERS, KV_HEADS, HEAD_DIM = 32, 4, 2, 64     # engine_e2e's model and block size
SYSTEM, HISTORY, QUESTION, ANSWER = 1000, 2000, 40, 16
USERS, ROUNDS, PAGES, FORWARD_S, DECODE_S = 8, 3, 1024, 0.03, 0.005
PARTS = ("lookup", "alloc", "load", "layers", "save")
# offers judged by the daemon's load rates (a CPU engine's prefill rate), asked for more
# often than the connector's default 10 s so that a short run meets their refreshes
PREFILL_RATE, RATES_REFRESH_S = 20000, 0.5
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def busy(seconds: float) -> None:
    """Compute on the engine's one thread for ``seconds``, as a layer's forward does."""
    import torch

    a = torch.ones(256, 256)
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        torch.mm(a, a)


def start_daemon(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    endpoint = f"ipc://{work / 'kvstore.sock'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--endpoint", endpoint,
         "--dram-capacity", "256MiB", "--ssd-capacity", "0", "--ssd-path", str(work / "ssd"),
         "--slab-size", "16MiB", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if b"serving on" in line:
            return proc, endpoint
    raise RuntimeError("the daemon did not start")


def vllm_config(endpoint: str) -> tuple[Any, Any]:
    """The parts of vLLM's configuration the connector reads, and a KV cache config."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.float32)
    layers = LAYER_NAMES
    kv_cache_config = SimpleNamespace(
        prefix_cacheable_group_ids=[0], needs_kv_cache_zeroing=False,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=layers)])
    transfer = KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": endpoint, "tenant": "bench",
                                   "layerwise": "auto", "prefill_tokens_per_s": PREFILL_RATE,
                                   "rates_refresh_s": RATES_REFRESH_S})
    config = SimpleNamespace(
        kv_transfer_config=transfer,
        model_config=SimpleNamespace(model="bench-model", revision="r1", hf_config=None,
                                     hf_overrides=None, quantization=None),
        load_config=SimpleNamespace(load_format="dummy"),
        cache_config=SimpleNamespace(cache_dtype="auto", enable_prefix_caching=True,
                                     prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    return config, kv_cache_config


class Request:
    """What the connector reads of vLLM's ``Request``; block hashes as vLLM's sha256
    chain (their values need only tell prefixes apart)."""

    mm_features: list[Any] = []
    prompt_embeds = None
    lora_request = None
    cache_salt = None
    skip_reading_prefix_cache = False

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.extend(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def extend(self, tokens: list[int]) -> None:
        self.all_token_ids.extend(tokens)
        while (len(self.block_hashes) + 1) * BLOCK <= len(self.all_token_ids):
            j = len(self.block_hashes)
            parent = self.block_hashes[-1] if j else b""
            block = self.all_token_ids[j * BLOCK:(j + 1) * BLOCK]
            self.block_hashes.append(hashlib.sha256(parent + repr(block).encode()).digest())


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def new_step(req: Request, pages: list[int], computed: int, scheduled: int) -> Any:
    new = SimpleNamespace(req_id=req.request_id, block_ids=(pages,),
                          num_computed_tokens=computed)
    return SimpleNamespace(
        scheduled_new_reqs=[new], num_scheduled_tokens={req.request_id: scheduled},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set(), num_computed_tokens=[]),
        preempted_req_ids=set())


def cached_step(req: Request, more: list[int], computed: int) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={req.request_id: 1},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req.request_id], new_block_ids=[(more,) if more else None],
            resumed_req_ids=set(), num_computed_tokens=[computed]),
        preempted_req_ids=set())


class Timer:
    """Main-thread CPU and wall time per part of the request being timed."""

    def __init__(self) -> None:
        self.cpu: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.wall: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.profile: cProfile.Profile | None = None

    def __call__(self, part: str, call: Callable[[], Any]) -> Any:
        if self.profile is not None:
            self.profile.enable()
        cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            return call()
        finally:
            self.cpu[part] += time.thread_time_ns() - cpu
            self.wall[part] += time.perf_counter_ns() - wall
            if self.profile is not None:
                self.profile.disable()


def run(profile: cProfile.Profile | None = None) -> dict[str, float]:
    import random

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.integrations.vllm import KVStoreConnector

    torch.set_num_threads(1)  # engine_e2e's engine: one thread on the CPU build
    work = Path(tempfile.mkdtemp(prefix="kvconn-"))
    daemon, endpoint = start_daemon(work)
    try:
        config, kv_cache_config = vllm_config(endpoint)
        sched = KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        worker = KVStoreConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        caches = {name: torch.zeros(PAGES, KV_HEADS, BLOCK, 2 * HEAD_DIM)
                  for name in kv_cache_config.kv_cache_groups[0].layer_names}
        worker.register_kv_caches(caches)
        sched._link.wait_connected(10.0)
        rng = random.Random(0)
        system = [rng.randrange(3, 4096) for _ in range(SYSTEM)]
        histories = [system + [rng.randrange(3, 4096) for _ in range(HISTORY)]
                     for _ in range(USERS)]
        figures: dict[str, list[float]] = {}
        next_page, number = 0, 0
        for round_ in range(ROUNDS):
            for user in range(USERS):
                number += 1
                timer = Timer()
                timer.profile = profile if round_ > 0 else None
                tokens = histories[user] + [rng.randrange(3, 4096) for _ in range(QUESTION)]
                req = Request(f"r{number}", tokens)
                local = SYSTEM // BLOCK * BLOCK   # the engine's own cache: the system prompt
                timer("lookup", lambda: sched.on_new_request(req))
                ext, _ = timer("lookup", lambda: sched.get_num_new_matched_tokens(req, local))
                ext = ext or 0
                need = (req.num_tokens + ANSWER) // BLOCK + 1
                if next_page + need > PAGES:
                    next_page = 0
                pages = list(range(next_page, next_page + need))
                next_page += need
                computed = local + ext
                timer("alloc", lambda: sched.update_state_after_alloc(
                    req, Blocks(pages), ext))  # type: ignore[arg-type]
                out = new_step(req, pages, computed, req.num_tokens - computed)
                started = time.perf_counter_ns()
                step(sched, worker, timer, out, FORWARD_S)
                first_step_ns = time.perf_counter_ns() - started
                if round_ > 0:  # rounds 2 and later: what their first token waits for
                    for part in PARTS:
                        figures.setdefault(f"{part}_cpu_us", []).append(timer.cpu[part] / 1e3)
                        figures.setdefault(f"{part}_wall_us", []).append(
                            timer.wall[part] / 1e3)
                    figures.setdefault("loaded_tokens", []).append(ext)
                    figures.setdefault("step_wall_us", []).append(first_step_ns / 1e3)
                computed = req.num_tokens
                answer = []
                for _ in range(ANSWER - 1):  # the decode steps after the first token
                    t = rng.randrange(3, 4096)
                    answer.append(t)
                    req.extend([t])
                    timer = Timer()  # (only the first token's path is reported)
                    step(sched, worker, timer, cached_step(req, [], computed), DECODE_S)
                    computed += 1
                sched.request_finished(req, pages)  # type: ignore[arg-type]
                worker.get_finished({req.request_id})
                histories[user] = tokens + answer
                time.sleep(FORWARD_S)
            worker.drain_saves(10.0)
        out = {k: statistics.median(v) for k, v in figures.items()}
        for k in ("lookup_wall_us", "step_wall_us"):  # the tail: the slowest request's
            out[k.replace("_us", "_max_us")] = max(figures[k])
        return out
    finally:
        daemon.terminate()
        daemon.wait()


def step(sched: Any, worker: Any, timer: Timer, out: Any, forward_s: float) -> None:
    """One engine step's connector calls, in vLLM's order, around a pause for its
    forward."""
    meta = timer("alloc", lambda: sched.build_connector_meta(out))
    timer("load", lambda: worker.handle_preemptions(meta))
    worker.bind_connector_metadata(meta)
    timer("load", lambda: worker.start_load_kv(None))
    for name in LAYER_NAMES:  # the forward, a layer at a time
        timer("layers", lambda: worker.wait_for_layer_load(name))
        busy(forward_s / LAYERS)
    timer("save", lambda: worker.wait_for_save())
    worker.clear_connector_metadata()


def main() -> int:
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        figures = run(profile)
        print({k: round(v, 1) for k, v in figures.items()})
        pstats.Stats(profile).sort_stats("tottime").print_stats(40)
        return 0
    import alternated
    return alternated.main(__file__, __doc__.split("\n\n")[0], run)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
