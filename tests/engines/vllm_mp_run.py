"""Run a real vLLM engine on the CPU as ``vllm serve`` runs it: its engine core in a
process of its own (V1 multiprocessing, vLLM's default), with kvstore's connector;
print JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_vllm_mp.py.  ``--spec`` names a JSON object: ``connector`` (its extra
config; absent: no kvstore) and ``phases``, each ``{"prompts": [token id lists],
"reset_prefix_cache": bool, "max_tokens": int}``, run as one ``generate`` call each.
A reset vLLM refuses is tried again (``reset_refused`` counts them): the requests that
just finished hold their pages until the engine core's next step reports their saves
done, and ``generate`` returns before.
The scheduler and worker live in the engine core's process: what a phase loaded is read
from its outputs (``num_cached_tokens``).  The result is one JSON object on the last
line of stdout.
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
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process


def run(spec: dict[str, Any], model: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    conn = spec.get("connector")
    kv_transfer_config = None
    if conn is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",  # (as the docs say)
            kv_connector_extra_config={
                "model_name": "tiny-llama", "model_revision": "seed1234", **conn["extra"]})
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", block_size=32,
              max_model_len=512, enforce_eager=True, seed=0, gpu_memory_utilization=0.05,
              kv_cache_memory_bytes=32 << 20, kv_transfer_config=kv_transfer_config)
    phases = []
    for phase in spec["phases"]:
        tries = 0
        if phase.get("reset_prefix_cache"):
            while not llm.reset_prefix_cache():
                tries += 1
                if tries > 200:
                    raise SystemExit("vLLM did not empty its prefix cache")
                time.sleep(0.05)
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 12),
                                detokenize=False, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in phase["prompts"]], params,
                            use_tqdm=False)
        phases.append({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                       "num_cached_tokens": [o.num_cached_tokens for o in outs],
                       "reset_refused": tries})
    return {"phases": phases}


def main() -> None:
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
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown (the engine core's process ends)


if __name__ == "__main__":
    main()
