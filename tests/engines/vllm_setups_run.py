"""Run a real vLLM engine on the CPU under one set-up, with or without kvstore; print JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_vllm_setups.py.  ``--spec`` names a JSON object: ``engine`` (vLLM's
``block_size``, ``enable_prefix_caching``, ``max_num_batched_tokens``,
``kv_cache_mib``, ``max_model_len``, ``dtype``, ``max_num_seqs``,
``async_scheduling``), ``connector``
(``role``, ``load_failure_policy`` and extra config; absent: no kvstore), ``log``
(kvstore's log level on stderr), ``save_delay`` (seconds each background save is held
before it goes, as on a busy host) and ``phases``,
run in order, each ``{"prompts": [token id lists], "n": samples, "max_tokens": int,
"seed": int, "temperature": float, "abort_after_steps": int, "reset_prefix_cache": bool,
"pause": name, "step_pause": {"after": steps, "name": name}, "sleep": seconds,
"update_weights": seed}``: its prompts added at once and the engine stepped until all
finish (or, with ``abort_after_steps``, that many steps and then every request aborted;
with ``step_pause``, paused as ``pause`` says after that many steps).  Before a phase:
``pause`` writes ``NAME.ready`` in the working directory and waits for the test's
``NAME.go`` (the test acts on the daemon meanwhile), then ``sleep``; ``update_weights``
changes the running engine's weights, then resets its caches and the connector's, as
vLLM's pause for a weight update does.  After each phase the run waits for the saves,
steps the engine until it holds no request and reads the daemon's duplicate blocks; at
the end, its DRAM figures (pinned and reserved blocks).  The tiny Llama is vllm_run.py's.
The result is one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process


def pause(name: str) -> None:
    """Write ``NAME.ready`` in the working directory, wait for the test's ``NAME.go``."""
    Path(f"{name}.ready").write_text("")
    for _ in range(1200):
        if Path(f"{name}.go").exists():
            return
        time.sleep(0.1)
    raise SystemExit(f"no {name}.go came")


def update_weights(llm: Any, seed: int) -> bool:
    """Change the running engine's weights in place (seeded noise added to the token
    embeddings: every layer's keys and values change), then reset its caches, the
    connector's too, as vLLM's pause for a weight update does; whether the reset was
    successful."""
    import torch

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    embed = model.model.embed_tokens.weight
    noise = torch.randn(embed.shape, generator=torch.Generator().manual_seed(seed))
    embed.data.add_(noise.to(embed.dtype))
    return bool(llm.reset_prefix_cache(reset_connector=True))


def daemon_dram(conn: dict[str, Any], settle: float = 5.0) -> dict[str, Any]:
    """The daemon's DRAM figures (pinned and reserved blocks, duplicates, ...), once
    nothing is pinned or reserved, or after ``settle`` seconds: the connector posts its
    pins' releases without waiting, on its own socket, so a request from this one may be
    served before them (a leak still shows: it outlasts the wait)."""
    import time

    from kvstore import Client
    try:
        with Client(conn["extra"]["endpoint"],
                    tenant=conn["extra"].get("tenant", "")) as client:
            deadline = time.monotonic() + settle
            while True:
                dram = client.stats()["tiers"]["dram"]
                if (dram["pinned_blocks"], dram["reserved_slots"]) == (0, 0) \
                        or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
    except Exception as exc:  # noqa: BLE001 - reported, the test decides
        return {"error": repr(exc)}
    return {k: v for k, v in dram.items() if isinstance(v, (int, float))}


def start_engine(model: str, eng: dict[str, Any], conn: dict[str, Any] | None,
                 **more: Any) -> tuple[Any, Any, Any, list[int], Any, bool, Any]:
    """The LLM of ``eng``'s settings (``more``: other arguments of vLLM's), with kvstore's
    connector where ``conn`` is given: the LLM, its engine and scheduler, the scheduler's
    preemptions counted (a list of one), the scheduler's connector, whether it connected,
    and the worker's connector."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    kv_transfer_config = None
    if conn is not None:
        extra = {"model_name": "tiny-llama", "model_revision": "seed1234",
                 **conn.get("extra", {})}
        kv_transfer_config = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role=conn.get("role", "kv_both"),
            kv_load_failure_policy=conn.get("load_failure_policy", "recompute"),
            kv_connector_extra_config=extra)
    batched = eng.get("max_num_batched_tokens")
    for name in ("max_num_seqs", "async_scheduling"):
        if name in eng:
            more = {name: eng[name], **more}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype=eng.get("dtype", "float32"),
              block_size=eng.get("block_size", 32),
              max_model_len=eng.get("max_model_len", 512), enforce_eager=True, seed=0,
              gpu_memory_utilization=0.05,
              kv_cache_memory_bytes=int(eng.get("kv_cache_mib", 32) * (1 << 20)),
              enable_prefix_caching=eng.get("enable_prefix_caching", True),
              kv_transfer_config=kv_transfer_config, **more,
              **({"max_num_batched_tokens": batched, "enable_chunked_prefill": True}
                 if batched else {}))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preemptions = [0]
    preempt = scheduler._preempt_request

    def counting_preempt(*a: object, **k: object) -> object:
        preemptions[0] += 1
        return preempt(*a, **k)
    scheduler._preempt_request = counting_preempt
    sched_conn = scheduler.connector if conn is not None else None
    connected = bool(sched_conn and sched_conn._link.wait_connected(30))
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return llm, engine, scheduler, preemptions, sched_conn, connected, worker


def run_requests(engine: Any, phase: dict[str, Any], counter: int, *, most_steps: int = 2000,
                 more: Callable[[Any], dict[str, Any]] | None = None,
                 **params: Any) -> tuple[list[str], dict[str, Any], int]:
    """A phase's prompts added as requests ``r<counter+1>``... (sampling as the phase
    says, ``params`` besides) and the engine stepped until they finish, or are aborted
    after ``abort_after_steps``: their ids, each finished one's outputs and cached
    tokens (and ``more(out)``), and the steps taken."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = SamplingParams(temperature=phase.get("temperature", 0.0),
                              n=phase.get("n", 1), seed=phase.get("seed"),
                              max_tokens=phase.get("max_tokens", 12), detokenize=False,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY,
                              **params)
    ids = []
    for prompt in phase["prompts"]:
        counter += 1
        ids.append(f"r{counter}")
        engine.add_request(ids[-1], {"prompt_token_ids": prompt}, sampling)
    outputs: dict[str, Any] = {}
    steps = 0
    abort = phase.get("abort_after_steps")
    step_pause = phase.get("step_pause") or {}
    while engine.has_unfinished_requests() and steps < most_steps:
        if steps == step_pause.get("after"):  # (the test acts meanwhile)
            pause(step_pause["name"])
        if abort is not None and steps >= abort:
            engine.abort_request(ids)
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = {
                    "outputs": [list(o.token_ids) for o in out.outputs],
                    "num_cached_tokens": out.num_cached_tokens,
                    **(more(out) if more is not None else {})}
        steps += 1
    return ids, outputs, steps


def run(spec: dict[str, Any], model: str) -> dict[str, Any]:
    eng, conn = spec.get("engine", {}), spec.get("connector")
    if spec.get("log"):  # kvstore's log, at this level, on stderr
        import logging
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(relativeCreated)d %(threadName)s %(message)s"))
        logging.getLogger("kvstore").addHandler(handler)
        logging.getLogger("kvstore").setLevel(spec["log"].upper())
    if spec.get("save_delay"):  # each background save held this long before it goes
        from kvstore.integrations import pipeline

        store = pipeline.SaveSender._store

        def slow_store(self: Any, number: int, job: Any) -> Any:
            time.sleep(spec["save_delay"])
            return store(self, number, job)

        pipeline.SaveSender._store = slow_store  # type: ignore[method-assign]
    llm, engine, scheduler, preemptions, sched_conn, connected, worker = start_engine(
        model, eng, conn)
    phases, counter = [], 0
    for phase in spec["phases"]:
        if phase.get("pause"):  # the test acts on the daemon meanwhile (see the doc)
            pause(phase["pause"])
        time.sleep(phase.get("sleep", 0))
        if phase.get("update_weights"):  # weights changed in place, as RL trainers do
            reset = update_weights(llm, phase["update_weights"])
        if phase.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise SystemExit("vLLM did not empty its prefix cache")
        before = dict(sched_conn.stats) if sched_conn else {}
        ids, outputs, steps = run_requests(engine, phase, counter)
        counter += len(ids)
        held, freeing = len(scheduler.requests), 0
        if worker is not None:
            worker.drain_saves(30)
        while (scheduler.requests or engine.has_unfinished_requests()) and freeing < 200:
            engine.step()
            freeing += 1
        after = dict(sched_conn.stats) if sched_conn else {}
        phases.append({
            "results": [outputs.get(i) for i in ids], "steps": steps,
            **({"reset": reset} if phase.get("update_weights") else {}),
            "held_after": held, "steps_until_freed": freeing,
            "left_in_scheduler": len(scheduler.requests),
            # blocks the daemon was sent again, though it held them (all phases so far)
            "duplicates": daemon_dram(conn).get("duplicates") if conn is not None else None,
            "external_tokens": after.get("hit_tokens", 0) - before.get("hit_tokens", 0)})
    daemon = daemon_dram(conn) if conn is not None else {}
    return {"phases": phases, "preemptions": preemptions[0], "connected": connected,
            "worker": dict(worker.stats) if worker else {},
            "scheduler": dict(sched_conn.stats) if sched_conn else {},
            "scheduler_requests_left": len(sched_conn._book) if sched_conn else 0,
            "daemon_dram": daemon}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--weights-seed", type=int, default=1234)
    args = parser.parse_args()
    if not os.path.exists(args.model):
        from vllm_run import make_model
        make_model(args.model, args.weights_seed)
    with open(args.spec) as f:
        spec = json.load(f)
    result = run(spec, args.model)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
