"""Cache identity: everything that decides whether two KV blocks are interchangeable.

Two blocks may be shared only if every field here is equal.  The namespace id is a
stable, domain-tagged 128-bit hash of the identity's canonical encoding, so it is the
same in every process and on every host, and changing any field changes it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from kvstore.errors import MalformedError

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,  # (AMD MI300's fp8: other bits than e4m3fn, not to be mixed)
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}

_NAMESPACE_DOMAIN = b"kvstore.ns.v1"
_MAX_TEXT = 512


def tenant_problem(tenant: str) -> str | None:
    """Why ``tenant`` cannot name a tenant (an identity's ``tenant`` field takes no
    other), or None: it is empty, or longer than an identity's text fields may be."""
    if not tenant:
        return "is empty"
    if len(tenant) > _MAX_TEXT:
        return f"is longer than {_MAX_TEXT} characters"
    return None


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """The identity of a KV cache: model, adapter, tenant, KV format, positions, salt."""

    model: str
    model_revision: str
    tenant: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    adapter: str | None = None
    adapter_revision: str | None = None
    layout: str = "paged"
    rope_type: str = "default"
    rope_scaling: str = ""
    salt: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "model_revision", "tenant", "kv_dtype", "layout", "rope_type"):
            value = getattr(self, name)
            if not value:
                raise MalformedError(f"identity field {name!r} must be a non-empty string")
        for name in ("model", "model_revision", "tenant", "adapter", "adapter_revision",
                     "layout", "rope_type", "rope_scaling", "salt"):
            value = getattr(self, name)
            if value is not None and len(value) > _MAX_TEXT:
                raise MalformedError(f"identity field {name!r} is longer than {_MAX_TEXT}")
        if self.kv_dtype not in DTYPE_BYTES:
            raise MalformedError(
                f"identity field 'kv_dtype' is {self.kv_dtype!r}; "
                f"expected one of {sorted(DTYPE_BYTES)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if type(value) is not int or not 0 < value <= 1 << 20:
                raise MalformedError(f"identity field {name!r} must be a positive integer")
        if self.adapter is None and self.adapter_revision is not None:
            raise MalformedError("identity field 'adapter_revision' is set without 'adapter'")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def bytes_per_token(self) -> int:
        """kappa = 2 * L * n_kv * d_head * b_kv."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def namespace_id(self) -> bytes:
        """16 bytes: domain-tagged BLAKE2b of the canonical encoding."""
        return namespace_id(self)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def canonical_encoding(identity: Identity) -> bytes:
    """MessagePack of the fields sorted by name: the same bytes wherever it is computed."""
    fields = msgspec.structs.asdict(identity)
    return msgspec.msgpack.encode(sorted(fields.items()))


def namespace_id(identity: Identity) -> bytes:
    return hashlib.blake2b(
        canonical_encoding(identity), digest_size=16, person=_NAMESPACE_DOMAIN
    ).digest()
