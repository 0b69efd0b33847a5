"""Run a real vLLM engine on the CPU with LoRA adapters, stop conditions, aborts and a
shutdown, with or without kvstore; print JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_vllm_setups_s54.py.  ``--spec`` names a JSON object as vllm_setups_run.py's
(``engine``, ``connector``, ``phases``), with more: the engine's ``loras`` (adapter names,
each a LoRA of the tiny Llama of its own: the first vllm_run.py's, the others its
matrices scaled); a phase's ``prompts`` entries may be ``{"tokens": [...], "lora":
name}``, and a phase may give ``stop_token_ids``, ``max_tokens`` (1 too) and
``abort_after_steps`` (past the prefill: mid-decode); ``shutdown`` (at the top level)
shuts the engine down right after the last phase's requests finished, with their saves
in flight, and then reads the daemon's figures (``after_shutdown``).  After each phase
the run waits for the saves, steps the engine until it holds no request, and reads the
daemon's DRAM figures.  The result is one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process
# prompts past the tiny Llama's 1024 positions (RoPE computes any position): longer than
# a daemon's smallest DRAM (1 MiB, 1024 tokens of its KV)
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")


def make_loras(model: str, names: list[str]) -> dict[str, str]:
    """An adapter directory per name: the first vllm_run.py's LoRA, the next ones its
    ``lora_B`` matrices scaled by -1, 2, ... (other adapters, other KV)."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm_run import make_lora

    first = model + "-lora"
    if not os.path.exists(first):
        make_lora(first)
    paths = {}
    for i, name in enumerate(names):
        path = first if i == 0 else f"{model}-lora-{name}"
        if i and not os.path.exists(path):
            os.makedirs(path)
            (Path(path) / "adapter_config.json").write_text(
                (Path(first) / "adapter_config.json").read_text())
            weights = load_file(os.path.join(first, "adapter_model.safetensors"))
            scale = -1.0 if i == 1 else float(i)
            save_file({k: (v * scale if "lora_B" in k else v).contiguous()
                       for k, v in weights.items()},
                      os.path.join(path, "adapter_model.safetensors"))
        paths[name] = path
    return paths


def run(spec: dict[str, Any], model: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
    from vllm_setups_run import daemon_dram, start_engine

    eng, conn = spec.get("engine", {}), spec.get("connector")  # (and ``layers``: main)
    loras = make_loras(model, eng.get("loras", []))
    adapters = {name: LoRARequest(name, i + 1, path)
                for i, (name, path) in enumerate(loras.items())}
    llm, engine, scheduler, preemptions, sched_conn, connected, worker = start_engine(
        model, eng, conn, **({"enable_lora": True, "max_loras": len(loras),
                              "max_lora_rank": 8} if loras else {}))
    phases, counter = [], 0
    last = len(spec["phases"]) - 1
    for number, phase in enumerate(spec["phases"]):
        if phase.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise SystemExit("vLLM did not empty its prefix cache")
        before = dict(sched_conn.stats) if sched_conn else {}
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 12),
                                stop_token_ids=phase.get("stop_token_ids"),
                                detokenize=False, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        ids = []
        for prompt in phase["prompts"]:
            counter += 1
            ids.append(f"r{counter}")
            tokens, lora = (prompt, None) if isinstance(prompt, list) else (
                prompt["tokens"], prompt.get("lora"))
            engine.add_request(ids[-1], {"prompt_token_ids": tokens}, params,
                               lora_request=adapters[lora] if lora else None)
        outputs: dict[str, Any] = {}
        steps = 0
        abort = phase.get("abort_after_steps")
        while engine.has_unfinished_requests() and steps < 4000:
            if abort is not None and steps >= abort:
                if not (spec.get("shutdown") and number == last):  # shut down running
                    engine.abort_request(ids)
                break
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = {
                        "outputs": [list(o.token_ids) for o in out.outputs],
                        "num_cached_tokens": out.num_cached_tokens}
            steps += 1
        if spec.get("shutdown") and number == last:
            # the engine shut down as its last requests finish: their saves in flight
            in_flight = worker is not None and bool(worker._sender._pending)
            running = len(scheduler.requests)
            engine.engine_core.shutdown()
            phases.append({"results": [outputs.get(i) for i in ids],
                           "saves_in_flight": in_flight, "running": running})
            break
        held, freeing = len(scheduler.requests), 0
        if worker is not None:
            worker.drain_saves(30)
        while (scheduler.requests or engine.has_unfinished_requests()) and freeing < 200:
            engine.step()
            freeing += 1
        after = dict(sched_conn.stats) if sched_conn else {}
        phases.append({
            "results": [outputs.get(i) for i in ids], "steps": steps,
            "held_after": held, "left_in_scheduler": len(scheduler.requests),
            "daemon": daemon_dram(conn) if conn is not None else {},
            "external_tokens": after.get("hit_tokens", 0) - before.get("hit_tokens", 0)})
    out = {"phases": phases, "preemptions": preemptions[0], "connected": connected,
           "worker": dict(worker.stats) if worker else {},
           "scheduler": dict(sched_conn.stats) if sched_conn else {},
           "scheduler_requests_left": len(sched_conn._book) if sched_conn else 0}
    if conn is not None:
        time.sleep(spec.get("settle", 0))
        out["daemon_dram"] = daemon_dram(conn)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    if not os.path.exists(args.model):
        import vllm_run
        # (``layers``: a deeper Llama, more KV a token: longer than a small DRAM)
        vllm_run.LAYERS = spec.get("engine", {}).get("layers", vllm_run.LAYERS)
        vllm_run.make_model(args.model)
    result = run(spec, args.model)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
