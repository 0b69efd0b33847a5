"""vLLM on the CPU: the connector's pipeline and disaggregated prefill, real daemons.

Engine processes (vllm_run.py, each ~10-30 s) in one module fixture, in four lanes run
two at a time (``in_lanes``):

- ``baseline``: no connector.
- ``producer`` (``kv_producer``, every background save delayed 0.5 s) and ``consumer``
  (``kv_consumer``, whole-request loads) against one daemon: the producer prefills and
  stores, never loads; the consumer loads, never stores, and computes only the uncached
  tail; a batch of four prompts loads in one daemon call.  ``auto_consumer`` does the
  same with the default ``"layerwise": "auto"`` and one engine thread.
- ``remote_producer`` and ``remote_consumer`` (layer-wise loads) against two daemons
  sharing a Redis tier: the consumer's daemon finds the blocks in Redis.
- ``remote_declined``: a consumer with a prefill rate, against a daemon whose Redis
  tier it is told loads at 1 KB/s: the cached prefix is not offered.
- ``save_killed`` (a daemon killed before a background save) and ``load_killed``
  (killed between the lookup and the load, the producer's daemon, last): the outputs
  are recomputed, equal to the baseline's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_proc import DaemonProcess
from engine_envs import HERE, in_lanes, last_json, run_in_env
from redis_servers import RedisServer

from kvstore import Client

# Seven engine processes start in the module's fixture: on a loaded machine they take
# longer than the default limit, which counts the fixture against the first test.
pytestmark = pytest.mark.timeout(1500)

BLOCK = 32
PROMPT_P = [(11 * i) % 500 + 3 for i in range(100)]          # 3 reusable blocks
PROMPT_R = [(13 * i + 5) % 500 + 3 for i in range(70)]       # 2 reusable blocks
SHARED = [(17 * i) % 500 + 3 for i in range(64)]             # 2 blocks every B shares
BATCH = [SHARED + [(19 * i + 7 * k) % 500 + 3 for i in range(40 + 10 * k)]
         for k in range(4)]                                  # 3-4 reusable blocks each


def engine_run(tmp: Path, name: str, model: Path, requests: list[dict[str, Any]],
               daemon: DaemonProcess | None = None, tenant: str = "", *args: str,
               omp_threads: int = 0) -> dict[str, Any]:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(requests))
    argv = [str(HERE / "vllm_run.py"), "--model", str(model), "--requests", str(spec), *args]
    if daemon is not None:
        assert daemon.proc is not None
        argv += ["--endpoint", daemon.endpoint, "--tenant", tenant,
                 "--daemon-pid", str(daemon.proc.pid)]
    env = {"OMP_NUM_THREADS": str(omp_threads)} if omp_threads else {}
    return last_json(run_in_env("vllm", argv, timeout=300, cwd=tmp, **env).stdout)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("vllm-pipeline")
    redis = RedisServer(tmp / "redis")
    redis.start()
    daemons = {name: DaemonProcess(tmp / name, dram_capacity="128MiB", extra=[
        "--slab-size", "16MiB", *(["--remote", redis.url] if name.startswith("remote")
                                   else [])]) for name in ("one", "remote_a", "remote_b",
                                                           "doomed")}
    # A daemon whose remote tier loads at 1 KB/s (its configured figure, as a probe
    # tells it): no block from there is worth loading at 1000 prefill tokens/s.
    daemons["remote_slow"] = DaemonProcess(
        tmp / "remote_slow", dram_capacity="128MiB",
        extra=["--slab-size", "16MiB", "--remote", redis.url],
        env={"KVSTORE_EVENTS_REMOTE_BANDWIDTH": "1KB"})
    tenant = f"vllm-{uuid.uuid4().hex[:8]}"  # nothing from an earlier run can match
    out: dict[str, Any] = {}
    try:
        for d in daemons.values():
            d.start()
        everything = [{"prompt": PROMPT_P}, {"prompts": BATCH}, {"prompt": PROMPT_R}]

        # Four lanes, two at a time (``in_lanes``); each lane's daemons are its own but
        # for Redis, which only the second lane's daemons use.  Each lane writes a model
        # of its own on first use (the seeded weights are the same).
        def through_one_daemon() -> None:
            own = tmp / "tiny-llama-1"
            out["producer"] = engine_run(
                tmp, "producer", own, [{"prompt": PROMPT_P}, {"prompts": BATCH}],
                daemons["one"], tenant, "--role", "kv_producer", "--save-delay", "0.5")
            out["consumer"] = engine_run(
                tmp, "consumer", own, [{"prompt": PROMPT_P}, {"prompts": BATCH}],
                daemons["one"], tenant, "--role", "kv_consumer",
                "--extra", json.dumps({"layerwise": False}))
            out["auto_consumer"] = engine_run(  # "layerwise": "auto", the default, and
                tmp, "auto_consumer", own, [{"prompt": PROMPT_P}, {"prompts": BATCH}],
                daemons["one"], tenant, "--role", "kv_consumer", omp_threads=1)  # a core spare
            # last on this daemon: it is killed
            out["load_killed"] = engine_run(
                tmp, "load_killed", own, [{"prompt": PROMPT_P, "kill_daemon": "load"},
                                          {"prompt": PROMPT_R}],
                daemons["one"], tenant, "--extra", json.dumps({"timeout": 1}))

        def through_redis() -> None:
            own = tmp / "tiny-llama-2"
            out["remote_producer"] = engine_run(
                tmp, "remote_producer", own, [{"prompt": PROMPT_P}, {"prompts": BATCH}],
                daemons["remote_a"], tenant, "--role", "kv_producer")
            with Client(daemons["remote_a"].endpoint, tenant=tenant) as client:
                blocks = out["remote_producer"]["worker"]["saved_blocks"]
                wait_for(lambda: client.stats()["remote"]["writes"] >= blocks,
                         "the producer's blocks in Redis")
            out["remote_consumer"] = engine_run(
                tmp, "remote_consumer", own, [{"prompt": PROMPT_P}, {"prompts": BATCH}],
                daemons["remote_b"], tenant, "--role", "kv_consumer",
                "--extra", json.dumps({"layerwise": True}))
            out["remote_declined"] = engine_run(
                tmp, "remote_declined", own, [{"prompt": PROMPT_P}],
                daemons["remote_slow"], tenant, "--role", "kv_consumer",
                "--extra", json.dumps({"prefill_tokens_per_s": 1000}))

        def baseline() -> None:
            out["baseline"] = engine_run(tmp, "baseline", tmp / "tiny-llama-3", everything)

        def save_killed() -> None:
            out["save_killed"] = engine_run(
                tmp, "save_killed", tmp / "tiny-llama-4",
                [{"prompt": PROMPT_R, "kill_daemon": "save"}, {"prompt": PROMPT_P}],
                daemons["doomed"], tenant, "--extra", json.dumps({"timeout": 1}))

        in_lanes(through_one_daemon, through_redis, baseline, save_killed)
        yield out
    finally:
        for d in daemons.values():
            d.stop()
            assert "invariant violated" not in d.log(), d.log()
        redis.stop()


def outputs(result: dict[str, Any]) -> list[list[int]]:
    """Every output of a run, in order (a batch's one by one)."""
    found = []
    for r in result["results"]:
        found.extend([o["output"] for o in r["outputs"]] if "outputs" in r else [r["output"]])
    return found


def test_the_producer_stores_and_never_loads(runs: dict[str, Any]) -> None:
    producer = runs["producer"]
    assert outputs(producer) == outputs(runs["baseline"])[:5]
    assert [r["external_tokens"] for r in producer["results"]] == [0, 0]
    assert producer["worker"]["loaded_blocks"] == 0
    # P: 100 + 12 tokens fill 3 blocks; the batch's 64 + 40..70 prompt + 12 generated
    # tokens fill 3, 3, 4, 4: 2 shared (stored once), then 1, 1, 2, 2 of their own.
    assert producer["worker"]["saved_blocks"] == 3 + 2 + 1 + 1 + 2 + 2
    assert producer["worker"]["save_failures"] == 0


def test_a_request_with_saves_in_flight_keeps_its_blocks_until_they_end(
        runs: dict[str, Any]) -> None:
    # Each save waits 0.5 s on the sender's thread: generate returns first, vLLM still
    # holds the finished request, and frees it once get_finished reports the saves.
    single = runs["producer"]["results"][0]
    assert single["held_after_generate"] == 1
    assert single["steps_until_freed"] >= 1
    # What was stored is what the pages held when the step ended: the consumer's
    # outputs from those blocks are the baseline's (next test).


def test_the_consumer_loads_the_prefix_and_computes_only_the_tail(
        runs: dict[str, Any]) -> None:
    consumer = runs["consumer"]
    assert outputs(consumer) == outputs(runs["baseline"])[:5]
    single = consumer["results"][0]
    assert single["external_tokens"] == 3 * BLOCK
    assert single["num_cached_tokens"] == 3 * BLOCK  # vLLM computed 100 - 96 tokens
    assert consumer["worker"]["saved_blocks"] == 0 and consumer["worker"]["saves"] == 0
    assert consumer["scheduler"]["lookups"] == 5
    # every loaded token was found in DRAM; no prefill rate: no rates asked for
    assert consumer["scheduler"]["hit_tokens_dram"] == consumer["scheduler"]["hit_tokens"]
    assert consumer["scheduler"]["rate_refreshes"] == 0


def test_a_batch_of_requests_loads_in_one_daemon_call(runs: dict[str, Any]) -> None:
    batch = runs["consumer"]["results"][1]
    # Reusable: all full blocks but the last token's: 64 + 40..70 tokens -> 3, 3, 3, 4.
    assert [o["num_cached_tokens"] for o in batch["outputs"]] == [
        3 * BLOCK, 3 * BLOCK, 3 * BLOCK, 4 * BLOCK], batch
    # The first request loads its 3 blocks; vLLM finds the 2 shared ones in its own
    # cache for the other three (allocated in the same step), which load the rest.
    assert batch["external_tokens"] == (3 + 1 + 1 + 2) * BLOCK, batch
    assert batch["load_calls"] == 1, batch  # one acquire for the four requests' blocks


def test_disaggregated_through_two_daemons_sharing_redis_layer_wise(
        runs: dict[str, Any]) -> None:
    consumer = runs["remote_consumer"]
    assert outputs(consumer) == outputs(runs["baseline"])[:5]
    assert outputs(consumer) == outputs(runs["consumer"])  # layer-wise == whole-request
    assert [r["external_tokens"] for r in consumer["results"]] == [3 * BLOCK, 7 * BLOCK]
    assert consumer["worker"]["load_failed_blocks"] == 0
    assert consumer["scheduler"]["prefetches"] >= 1  # the blocks were in Redis only
    tiers = {k: v for k, v in consumer["scheduler"].items() if k.startswith("hit_tokens_")}
    assert tiers["hit_tokens_remote"] >= 3 * BLOCK, tiers  # tokens offered, by tier
    assert sum(tiers.values()) == consumer["scheduler"]["hit_tokens"], tiers


def test_auto_loads_layer_by_layer_once_vllm_asks_for_layers_where_a_core_is_spare(
        runs: dict[str, Any]) -> None:
    """``"layerwise": "auto"``: the first step that loads copies whole (vLLM not yet
    seen asking for every layer), later ones layer by layer where the engine's process
    may run on more cores than its threads, whole where it may not; the outputs are the
    baseline's either way."""
    auto = runs["auto_consumer"]
    assert outputs(auto) == outputs(runs["baseline"])[:5]
    assert [r["external_tokens"] for r in auto["results"]] == [3 * BLOCK, 7 * BLOCK]
    assert auto["worker"]["load_failed_blocks"] == 0
    # one thread on a machine of two cores or more: a core spare (where the run has
    # only one, it says so, and every step copies whole)
    assert auto["worker"]["layerwise_steps"] == (1 if auto["layerwise_fits"] else 0), auto
    assert runs["consumer"]["worker"]["layerwise_steps"] == 0  # false: never
    remote = runs["remote_consumer"]["worker"]
    assert remote["layerwise_steps"] >= 2, remote  # true: from the first step that loads


def test_an_offer_is_judged_by_the_daemons_rates_not_the_configured_ones(
        runs: dict[str, Any]) -> None:
    # Configured, Redis loads at 1 GB/s (worth it); the daemon says 1 KB/s: declined.
    run = runs["remote_declined"]
    assert outputs(run) == outputs(runs["baseline"])[:1]
    assert run["scheduler"]["rate_refreshes"] == 1
    assert run["scheduler"]["offers_declined"] == 1
    assert run["scheduler"]["declined_tokens"] == 3 * BLOCK
    assert run["results"][0]["external_tokens"] == 0
    assert run["worker"]["loaded_blocks"] == 0


def test_a_daemon_killed_mid_save_costs_the_save_not_the_output(
        runs: dict[str, Any]) -> None:
    run = runs["save_killed"]
    assert outputs(run) == [outputs(runs["baseline"])[5], outputs(runs["baseline"])[0]]
    assert run["worker"]["save_failures"] >= 1
    assert [r["external_tokens"] for r in run["results"]] == [0, 0]


def test_a_daemon_killed_mid_load_gives_recompute_not_wrong_tokens(
        runs: dict[str, Any]) -> None:
    run = runs["load_killed"]
    assert run["results"][0]["external_tokens"] == 3 * BLOCK  # offered by the lookup
    assert run["worker"]["load_failed_blocks"] == 3            # gone by the load
    assert run["worker"]["loaded_blocks"] == 0
    assert outputs(run) == [outputs(runs["baseline"])[0], outputs(runs["baseline"])[5]]
