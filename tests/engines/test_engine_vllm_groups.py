"""KV cache groups of one shape hold different layers: each gets a namespace of its own.

vLLM splits a hybrid model's full-attention layers into groups of equal size (its
uniform page size grouping): groups whose spec is the same.  Their identities were equal
(the identity names the layer count, heads and head size, not which layers), so their
blocks had the same keys in the same namespace, and a group loaded the KV another group
had stored for other layers.  The connector's ``kv_groups`` runs in the vLLM environment
on such a configuration."""

from __future__ import annotations

from typing import Any

from engine_envs import last_json, run_in_env

GROUPS = """
import json
from types import SimpleNamespace as S
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvstore.integrations.vllm_identity import kv_groups
from kvstore.keys import chain_keys

spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
other = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16)
config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec(["l0", "l3"], spec), KVCacheGroupSpec(["l1", "l4"], spec),
    KVCacheGroupSpec(["l2", "l5"], other)])
vllm_config = S(model_config=S(model="m", revision="r", hf_config=S()),
                load_config=S(load_format="auto"), cache_config=S(cache_dtype="auto"))
groups = kv_groups(vllm_config, config, "acme", {})
alone = kv_groups(vllm_config, KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                  kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)]), "acme", {})
tokens = list(range(64))
print(json.dumps({
    "ids": [g.identity.namespace_id.hex() for g in groups],
    "keys": [chain_keys(g.identity.namespace_id, tokens, 16, None)[0].hex() for g in groups],
    "layouts": [g.identity.layout for g in groups],
    "alone": alone[0].identity.namespace_id.hex()}))
"""


def test_groups_of_one_shape_have_namespaces_of_their_own() -> None:
    out: dict[str, Any] = last_json(run_in_env("vllm", ["-c", GROUPS], timeout=180).stdout)
    assert len(set(out["ids"])) == 3, out
    assert len(set(out["keys"])) == 3, out
    # the first group of a shape, and a group of a shape of its own, keep their identity
    # (engines already running share blocks with engines after this change)
    assert out["layouts"] == ["paged", "paged;group=1", "paged"], out
    assert out["ids"][0] == out["alone"], out
