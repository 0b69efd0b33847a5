"""Who a vLLM engine's KV is to kvstore: the identity of each KV cache group it stores
(model, revision, KV format, RoPE) and what a request adds to it (LoRA adapter, cache
salt).  See ``kvstore.integrations.vllm``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvstore.identity import DTYPE_BYTES, Identity
from kvstore.integrations.engine_side import checkpoint_fingerprint, settings_tag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_MAX_TEXT = 512  # Identity's limit on text fields


class RequestVariant(msgspec.Struct, frozen=True, array_like=True):
    """What a request adds to the engine's identity: adapter and cache salt; and
    ``weights``, the engine's weights since its caches were last reset (vLLM resets
    them as it loads new weights in place: an RL trainer's update), a tag of that reset
    ("": none yet), so that no block stored before it is loaded after it."""

    adapter: str | None = None
    adapter_revision: str | None = None
    salt: str = ""
    weights: str = ""


def bounded(text: str) -> str:
    """``text`` if it fits an identity field, else a stable digest of it."""
    if len(text) <= _MAX_TEXT:
        return text
    return "blake2b:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class AdapterRevisions:
    """The revision of each LoRA adapter a request names: a fingerprint of its local
    directory's weights (``checkpoint_fingerprint``), else its path, else its id.

    Before, the path: an adapter fine-tuned again and deployed in place (new weights at
    the same path, the same name) loaded the blocks the old weights computed, and
    answered wrong.  A fingerprint reads spans of the weight files: it is made once per
    adapter as vLLM loads it (its path and id: an adapter unloaded and loaded again gets
    another id, and is read again), and kept while the engine holds that one."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], str] = {}

    def of(self, path: str | None, int_id: int) -> str:
        if not path:
            return f"id:{int_id}"
        revision = self._known.get((path, int_id))
        if revision is None:
            revision = bounded(checkpoint_fingerprint(path) or path)
            if len(self._known) >= _MAX_ADAPTERS:
                self._known.pop(next(iter(self._known)))
            self._known[(path, int_id)] = revision
        return revision


_MAX_ADAPTERS = 1024  # adapters' revisions kept


def request_variant(request: Request, weights: str = "",
                    adapters: AdapterRevisions | None = None) -> RequestVariant:
    """What ``request`` adds to the engine's identity (``adapters``: the revisions of
    LoRA adapters, kept across requests; without it each is worked out again)."""
    lora = request.lora_request
    adapter = revision = None
    if lora is not None:
        adapter = bounded(lora.lora_name)
        revision = (adapters or AdapterRevisions()).of(lora.lora_path, lora.lora_int_id)
    return RequestVariant(adapter, revision, bounded(request.cache_salt or ""), weights)


def model_and_revision(model_config: Any, extra: dict[str, Any]) -> tuple[str, str]:
    """The identity's model and revision: ``model_name`` and ``model_revision`` where
    the connector's settings give them (to share blocks between engines that load the
    same weights from different places); else the model as loaded (its hub id or path:
    never the served name, an alias that two deployments of different weights may both
    use, canaries and A/B tests) and its revision, else the hub commit its config came
    from, else a fingerprint of the local checkpoint (``checkpoint_fingerprint``)."""
    model = str(extra.get("model_name") or model_config.model)
    revision = extra.get("model_revision") or model_config.revision
    if not revision:
        revision = (getattr(model_config.hf_config, "_commit_hash", None)
                    or checkpoint_fingerprint(str(model_config.model)))
    return model, str(revision or "unversioned")


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"kvstore cannot store a KV cache of dtype {dtype}")
    return name


def _rope(hf_config: Any) -> tuple[str, str]:
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    params = (getattr(text_config, "rope_parameters", None)
              or getattr(text_config, "rope_scaling", None))
    if not params:
        return "default", ""
    params = dict(params)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    return rope_type, bounded(json.dumps(params, sort_keys=True, default=str))


@dataclass(frozen=True)
class Group:
    """A KV cache group the connector moves: its layers and its base identity."""

    index: int
    layer_names: tuple[str, ...]
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    identity: Identity  # tensor-parallel rank 0, no adapter, no salt

    def identity_for(self, variant: RequestVariant, tp_rank: int, tp_size: int) -> Identity:
        layout = self.identity.layout if tp_size == 1 else (
            f"{self.identity.layout};tp={tp_rank}/{tp_size}")
        revision = self.identity.model_revision
        if variant.weights:
            revision = bounded(f"{revision}+reset:{variant.weights}")
        return msgspec.structs.replace(
            self.identity, adapter=variant.adapter, adapter_revision=variant.adapter_revision,
            salt=variant.salt, layout=layout, model_revision=revision)


def kv_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, tenant: str,
            extra: dict[str, Any]) -> list[Group]:
    model_config = vllm_config.model_config
    model, revision = model_and_revision(model_config, extra)
    if str(vllm_config.load_config.load_format) == "dummy":
        revision += "+dummy"  # random weights are not the model's weights
    revision += settings_tag(getattr(model_config, "hf_overrides", None),
                             getattr(model_config, "quantization", None))
    rope_type, rope_scaling = _rope(model_config.hf_config)
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    layout = "paged" if cache_dtype == "auto" else f"paged;cache_dtype={cache_dtype}"

    groups: list[Group] = []
    for index in kv_cache_config.prefix_cacheable_group_ids:
        group = kv_cache_config.kv_cache_groups[index]
        spec = group.kv_cache_spec
        if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
            raise ValueError(  # noqa: TRY004 - an unsupported configuration, not a bad call
                f"KVStoreConnector stores full-attention KV caches only; KV cache group "
                f"{index} is a {type(spec).__name__}")
        if (spec.head_size_v != spec.head_size or spec.page_size_padded is not None
                or spec.num_head_slots is not None or int(spec.kv_quant_mode) != 0):
            raise ValueError(
                f"KVStoreConnector cannot store KV cache group {index}: its pages are "
                f"packed or quantized ({spec})")
        identity = Identity(
            model=bounded(model), model_revision=bounded(revision), tenant=tenant,
            kv_dtype=_dtype_name(spec.dtype), num_layers=len(group.layer_names),
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
            block_tokens=spec.block_size, layout=layout, rope_type=rope_type,
            rope_scaling=rope_scaling)
        if any(g.identity == identity for g in groups):
            # Groups of the same shape (vLLM splits a hybrid model's full-attention
            # layers into groups of equal size) hold other layers' KV: under one identity
            # they shared keys, and a group loaded the blocks another group stored.
            # A repeated one gets its index (the first keeps the plain identity).
            identity = msgspec.structs.replace(identity, layout=f"{layout};group={index}")
        groups.append(Group(index, tuple(group.layer_names), spec.block_size,
                             spec.num_kv_heads, spec.head_size, identity))
    if not groups:
        raise ValueError("KVStoreConnector found no prefix-cacheable KV cache group")
    return groups
