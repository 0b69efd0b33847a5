"""Run a real vLLM engine on the CPU, with or without kvstore's connector; print JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_vllm.py.  ``--model DIR`` is a tiny Llama, written first if DIR does not
exist (config and seeded random weights, no tokenizer, and a LoRA adapter in DIR-lora).
``--requests`` names a JSON list of requests run in order, one ``generate`` call each:
``{"prompt": [token ids], "cache_salt": str, "lora": bool, "evict_before_load": bool}``;
the last makes the daemon drop the request's blocks between the scheduler's lookup and
the worker's load, as a concurrent eviction would.  The result is one JSON object on
the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# This checkout's kvstore (a script's directory, not the working one, starts sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2, 128, 4, 2, 32, 256, 512
BLOCK = 32  # the CPU attention backend wants a multiple of 32


def make_model(path: str) -> None:
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
    g = torch.Generator().manual_seed(1234)

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


def inject_eviction() -> None:
    """Make the connector's next load find its blocks gone (see the module doc)."""
    from kvstore.integrations.vllm import KVStoreConnector

    load = KVStoreConnector._load

    def evicting_load(self, transfer):  # type: ignore[no-untyped-def]
        global EVICT_NEXT_LOAD
        if EVICT_NEXT_LOAD:
            EVICT_NEXT_LOAD = False
            group = next(g for g in self._groups if g.index == transfer.group)
            self._namespace(group, transfer.variant, self._tp_rank).evict(transfer.keys)
        return load(self, transfer)

    KVStoreConnector._load = evicting_load


def run(args: argparse.Namespace) -> dict:
    global EVICT_NEXT_LOAD
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    kv_transfer_config = None
    if args.endpoint:
        kv_transfer_config = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"endpoint": args.endpoint, "tenant": args.tenant,
                                       "model_name": "tiny-llama", "model_revision": "seed1234"})
    with open(args.requests) as f:
        requests = json.load(f)
    lora = any(req.get("lora") for req in requests)
    if any(req.get("evict_before_load") for req in requests):
        inject_eviction()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
              max_model_len=512, enforce_eager=True, seed=0, gpu_memory_utilization=0.05,
              kv_cache_memory_bytes=32 << 20, kv_transfer_config=kv_transfer_config,
              enable_lora=lora, max_loras=1, max_lora_rank=8)
    scheduler_connector = None
    if args.endpoint:
        scheduler_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False,
                              ignore_eos=True)
    adapter = LoRARequest("tiny-lora", 1, args.model + "-lora") if lora else None
    results = []
    for req in requests:
        prompt = {"prompt_token_ids": req["prompt"]}
        if req.get("cache_salt"):
            prompt["cache_salt"] = req["cache_salt"]
        EVICT_NEXT_LOAD = bool(req.get("evict_before_load"))
        before = dict(scheduler_connector.stats) if scheduler_connector else {}
        (out,) = llm.generate([prompt], sampling, use_tqdm=False,
                              lora_request=adapter if req.get("lora") else None)
        after = dict(scheduler_connector.stats) if scheduler_connector else {}
        results.append({
            "output": list(out.outputs[0].token_ids),
            "num_cached_tokens": out.num_cached_tokens,
            "external_tokens": after.get("hit_tokens", 0) - before.get("hit_tokens", 0),
        })
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker_stats = dict(get_kv_transfer_group().stats) if has_kv_transfer_group() else {}
    return {"results": results, "worker": worker_stats,
            "scheduler": dict(scheduler_connector.stats) if scheduler_connector else {}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--tenant", default="acme")
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    if not os.path.exists(args.model):
        make_model(args.model)
        make_lora(args.model + "-lora")
    result = run(args)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
