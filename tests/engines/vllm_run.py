"""Run a real vLLM engine on the CPU, with or without kvstore's connector; print JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_vllm.py.  ``--model DIR`` is a tiny Llama, written first if DIR does not
exist (config and seeded random weights, no tokenizer, and a LoRA adapter in DIR-lora).
``--requests`` names a JSON list of requests run in order, one ``generate`` call each:
``{"prompt": [token ids] (or "prompts": a list of them, run in one call), "cache_salt":
str, "lora": bool, "evict_before_load": bool, "kill_daemon": "load" | "save",
"reset_prefix_cache": bool}``; ``reset_prefix_cache`` empties vLLM's own prefix cache
first (the request's prefix then comes from the daemon, or is computed);
``evict_before_load`` makes the daemon drop the request's blocks between the scheduler's
lookup and the worker's load, as a concurrent eviction would; ``kill_daemon`` kills the
daemon (``--daemon-pid``) right before the worker's next load or background save.
``--save-delay`` makes every background save wait first (a slow daemon).  After each
call the run notes how many finished requests vLLM still held (their saves in flight),
waits for the saves, and steps the engine until it freed them.  The result is one JSON
object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

# This checkout's kvstore (a script's directory, not the working one, starts sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2, 128, 4, 2, 32, 256, 512
BLOCK = 32  # the CPU attention backend wants a multiple of 32


def make_model(path: str, seed: int = 1234) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)

    def dense(rows: int, cols: int) -> torch.Tensor:
        # Unit-scale activations, so attention depends on the keys and values it reads.
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
               "model.norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": dense(VOCAB, HIDDEN) * 4}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": dense(HEADS * HEAD_DIM, HIDDEN) * 4,
            p + "self_attn.k_proj.weight": dense(KV_HEADS * HEAD_DIM, HIDDEN) * 4,
            p + "self_attn.v_proj.weight": dense(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": dense(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": dense(FFN, HIDDEN),
            p + "mlp.up_proj.weight": dense(FFN, HIDDEN),
            p + "mlp.down_proj.weight": dense(HIDDEN, FFN),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    save_file({k: v.contiguous() for k, v in weights.items()},
              os.path.join(path, "model.safetensors"))


def make_lora(path: str) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                   "target_modules": ["q_proj", "v_proj"], "bias": "none",
                   "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny-llama"}, f)
    g = torch.Generator().manual_seed(7)
    weights = {}
    for i in range(LAYERS):
        for module, out in (("q_proj", HEADS * HEAD_DIM), ("v_proj", KV_HEADS * HEAD_DIM)):
            p = f"base_model.model.model.layers.{i}.self_attn.{module}."
            weights[p + "lora_A.weight"] = torch.randn(8, HIDDEN, generator=g) * 0.1
            weights[p + "lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.1
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))


EVICT_NEXT_LOAD = False
KILL_DAEMON_AT = ""     # "load": before the next load's daemon call; "save": the next save's
DAEMON_PID = 0


def kill_daemon() -> None:
    global KILL_DAEMON_AT
    KILL_DAEMON_AT = ""
    os.kill(DAEMON_PID, signal.SIGKILL)
    for _ in range(200):  # until it is gone, so the next call cannot reach it
        try:
            os.kill(DAEMON_PID, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def inject_faults(save_delay: float) -> None:
    """Hooks in the connector: evict a load's blocks between the lookup and the load,
    kill the daemon before a load or a save, delay every save (see the module doc)."""
    from kvstore.integrations.pipeline import SaveSender
    from kvstore.integrations.vllm import KVStoreConnector

    # The first step of a load is the acquire handle_preemptions posts.
    start_load = KVStoreConnector.handle_preemptions

    def faulty_load(self, meta):  # type: ignore[no-untyped-def]
        global EVICT_NEXT_LOAD
        if meta.loads and EVICT_NEXT_LOAD:
            EVICT_NEXT_LOAD = False
            for t in meta.loads:
                group = next(g for g in self._groups if g.index == t.group)
                self._namespace(group, t.variant, self._tp_rank).evict(t.keys)
        if meta.loads and KILL_DAEMON_AT == "load":
            kill_daemon()
        return start_load(self, meta)

    store = SaveSender._store

    def faulty_store(self, *job):  # type: ignore[no-untyped-def]
        if KILL_DAEMON_AT == "save":
            kill_daemon()
        time.sleep(save_delay)
        return store(self, *job)

    KVStoreConnector.handle_preemptions = faulty_load
    SaveSender._store = faulty_store


def run(args: argparse.Namespace) -> dict:
    global EVICT_NEXT_LOAD, KILL_DAEMON_AT, DAEMON_PID
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    kv_transfer_config = None
    if args.endpoint:
        extra = {"endpoint": args.endpoint, "tenant": args.tenant,
                 **({} if args.own_identity else {"model_name": "tiny-llama",
                                                  "model_revision": "seed1234"}),
                 **json.loads(args.extra)}
        kv_transfer_config = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role=args.role, kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    with open(args.requests) as f:
        requests = json.load(f)
    lora = any(req.get("lora") for req in requests)
    DAEMON_PID = args.daemon_pid
    if args.endpoint:
        inject_faults(args.save_delay)
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
              max_model_len=args.max_model_len, enforce_eager=True, seed=0, gpu_memory_utilization=0.05,
              kv_cache_memory_bytes=int(args.kv_cache_mib * (1 << 20)),
              kv_transfer_config=kv_transfer_config,
              enable_lora=lora, max_loras=1, max_lora_rank=8,
              **({"served_model_name": args.served_name} if args.served_name else {}))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preemptions = [0]  # requests vLLM preempted (its cache full), counted
    preempt = scheduler._preempt_request

    def counting_preempt(*a: object, **k: object) -> object:
        preemptions[0] += 1
        return preempt(*a, **k)
    scheduler._preempt_request = counting_preempt
    scheduler_connector = scheduler.connector if args.endpoint else None
    # The scheduler side connects on a thread from its construction: the requests wait
    # for it here, so that the first one's lookup is not a miss for want of a connection.
    connected = bool(scheduler_connector and scheduler_connector._link.wait_connected(30))
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False,
                              ignore_eos=True)
    adapter = LoRARequest("tiny-lora", 1, args.model + "-lora") if lora else None
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    results = []
    for req in requests:
        prompts = [{"prompt_token_ids": p} for p in req.get("prompts", [req.get("prompt")])]
        for prompt in prompts:
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
        EVICT_NEXT_LOAD = bool(req.get("evict_before_load"))
        KILL_DAEMON_AT = req.get("kill_daemon", "")
        if req.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise SystemExit("vLLM did not empty its prefix cache")
        before = dict(scheduler_connector.stats) if scheduler_connector else {}
        worker_before = dict(worker.stats) if worker else {}
        outs = llm.generate(prompts, sampling, use_tqdm=False,
                            lora_request=adapter if req.get("lora") else None)
        after = dict(scheduler_connector.stats) if scheduler_connector else {}
        held = len(scheduler.requests)  # finished, their blocks kept for saves in flight
        steps = 0
        if worker is not None:
            worker.drain_saves(30)
            while scheduler.requests and steps < 100:  # the engine frees them as it steps
                llm.llm_engine.step()
                steps += 1
        result = {
            "external_tokens": after.get("hit_tokens", 0) - before.get("hit_tokens", 0),
            "held_after_generate": held, "steps_until_freed": steps,
            "load_calls": (worker.stats["load_calls"] - worker_before["load_calls"]
                           if worker else 0),
        }
        outputs = [{"output": list(out.outputs[0].token_ids),
                    "num_cached_tokens": out.num_cached_tokens} for out in outs]
        result |= outputs[0] if len(outputs) == 1 else {"outputs": outputs}
        results.append(result)
    return {"results": results, "worker": dict(worker.stats) if worker else {},
            "preemptions": preemptions[0],
            "layerwise_fits": bool(worker and worker._layerwise_fits),
            "scheduler_connected": connected,
            "scheduler": dict(scheduler_connector.stats) if scheduler_connector else {}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--tenant", default="acme")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--role", default="kv_both")
    parser.add_argument("--extra", default="{}", help="more connector extra config (JSON)")
    parser.add_argument("--kv-cache-mib", type=float, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--save-delay", type=float, default=0.0,
                        help="seconds each background save waits before it starts")
    parser.add_argument("--daemon-pid", type=int, default=0)
    parser.add_argument("--weights-seed", type=int, default=1234,
                        help="the seed of a model made here (its weights)")
    parser.add_argument("--served-name", default="", help="vLLM's served_model_name")
    parser.add_argument("--own-identity", action="store_true",
                        help="no model_name/model_revision in the extra config: the "
                             "connector works out the model's identity itself")
    args = parser.parse_args()
    if not os.path.exists(args.model):
        make_model(args.model, args.weights_seed)
        make_lora(args.model + "-lora")
    result = run(args)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
