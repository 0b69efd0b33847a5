"""Shared test helpers (imported by tests; not a conftest, so the name is unique)."""

from __future__ import annotations

from typing import Any

from kvstore import Identity


def make_identity(**changes: Any) -> Identity:
    fields: dict[str, Any] = dict(
        model="tiny-llama", model_revision="r1", tenant="acme", kv_dtype="float16",
        num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16)
    fields.update(changes)
    return Identity(**fields)
