"""Run a real vLLM engine on the CPU with or without kvstore, under set-ups the other
runners do not take; print JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_vllm_s57.py.  ``--spec`` names a JSON object as vllm_setups_run.py's
(``engine``, with ``loras`` as vllm_mixed_run.py's and ``llm_args``, more arguments of
vLLM's ``LLM``; ``connector``; ``phases``); a
phase's ``prompts`` entries are token id lists or ``{"tokens": [...], "lora": name,
"salt": cache salt}``, and a phase may give ``follow`` (its prompts are the previous
phase's, each followed by its output: a conversation's next turn), ``max_tokens`` and
``reset_prefix_cache``.  kvstore's log records of WARNING and above are counted
(``warnings``, the first few in ``warning_texts``).  After each phase the run waits for
the saves, steps the engine until it holds no request, and reads the daemon's DRAM
figures (``daemon``).  The result is one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process


def prompts_of(phase: dict[str, Any], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The phase's prompts as ``{"tokens", "lora", "salt"}``; with ``follow``, the
    previous phase's, each followed by its output."""
    if phase.get("follow"):
        return [{**p, "tokens": p["tokens"] + r["outputs"][0]} for p, r in before]
    return [p if isinstance(p, dict) else {"tokens": p} for p in phase["prompts"]]


def run(spec: dict[str, Any], model: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
    from vllm_mixed_run import make_loras
    from vllm_s55_run import Counted
    from vllm_setups_run import daemon_dram, start_engine

    counted = Counted()
    logging.getLogger("kvstore").addHandler(counted)
    eng, conn = spec.get("engine", {}), spec.get("connector")
    loras = make_loras(model, eng.get("loras", []))
    adapters = {name: LoRARequest(name, i + 1, path)
                for i, (name, path) in enumerate(loras.items())}
    llm, engine, scheduler, preemptions, sched_conn, connected, worker = start_engine(
        model, eng, conn, **eng.get("llm_args", {}),
        **({"enable_lora": True, "max_loras": len(loras), "max_lora_rank": 8} if loras else {}))
    phases: list[dict[str, Any]] = []
    last: list[Any] = []
    for number, phase in enumerate(spec["phases"]):
        if phase.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise SystemExit("vLLM did not empty its prefix cache")
        before = dict(sched_conn.stats) if sched_conn else {}
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 12),
                                detokenize=False, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        prompts = prompts_of(phase, last)
        ids = [f"p{number}r{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p["tokens"],
                                     **({"cache_salt": p["salt"]} if p.get("salt") else {})},
                               params, lora_request=adapters[p["lora"]] if p.get("lora") else None)
        outputs: dict[str, Any] = {}
        steps = 0
        while engine.has_unfinished_requests() and steps < 4000:
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = {
                        "outputs": [list(o.token_ids) for o in out.outputs],
                        "num_cached_tokens": out.num_cached_tokens}
            steps += 1
        if worker is not None:
            worker.drain_saves(30)
        freeing = 0
        while (scheduler.requests or engine.has_unfinished_requests()) and freeing < 200:
            engine.step()
            freeing += 1
        after = dict(sched_conn.stats) if sched_conn else {}
        results = [outputs.get(i) for i in ids]
        last = list(zip(prompts, results))
        phases.append({
            "results": results, "left_in_scheduler": len(scheduler.requests),
            "daemon": daemon_dram(conn) if conn is not None else {},
            "external_tokens": after.get("hit_tokens", 0) - before.get("hit_tokens", 0)})
    return {"phases": phases, "preemptions": preemptions[0], "connected": connected,
            "worker": dict(worker.stats) if worker else {},
            "scheduler": dict(sched_conn.stats) if sched_conn else {},
            "scheduler_requests_left": len(sched_conn._book) if sched_conn else 0,
            "warnings": counted.count, "warning_texts": counted.texts}


def main(more: Callable[[], dict[str, Any]] | None = None) -> None:
    """``--model`` and ``--spec``: the run's result printed (with ``more()``'s figures,
    read once it ended: a driver that counts something besides, vllm_s62_run.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    if not os.path.exists(args.model):
        from vllm_run import make_model
        make_model(args.model)
    result = run(spec, args.model)
    if more is not None:
        result.update(more())
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
