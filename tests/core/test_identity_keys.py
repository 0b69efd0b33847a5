from __future__ import annotations

import subprocess
import sys

import pytest
from kvtest import make_identity

from kvstore.errors import MalformedError
from kvstore.identity import Identity
from kvstore.keys import chain_keys


def test_block_bytes_follows_the_kv_format() -> None:
    ident = Identity(model="llama-3-8b", model_revision="r1", tenant="acme",
                     kv_dtype="float16", num_layers=32, num_kv_heads=8, head_dim=128,
                     block_tokens=16)
    assert ident.block_bytes == 2 * 32 * 8 * 128 * 2 * 16
    assert make_identity(kv_dtype="float32").block_bytes == 2 * make_identity().block_bytes


@pytest.mark.parametrize("change", [
    {"model": "other"}, {"model_revision": "r2"}, {"tenant": "globex"},
    {"adapter": "lora-a"}, {"adapter": "lora-a", "adapter_revision": "v2"},
    {"kv_dtype": "bfloat16"}, {"num_layers": 3}, {"num_kv_heads": 4}, {"head_dim": 64},
    {"block_tokens": 32}, {"layout": "all_layer"}, {"rope_type": "yarn"},
    {"rope_scaling": "factor=4"}, {"salt": "image:abc"},
])
def test_every_field_changes_the_namespace(change: dict[str, object]) -> None:
    assert make_identity(**change).namespace_id != make_identity().namespace_id


def test_adapter_revision_is_part_of_the_identity() -> None:
    a = make_identity(adapter="lora", adapter_revision="v1")
    b = make_identity(adapter="lora", adapter_revision="v2")
    assert a.namespace_id != b.namespace_id


@pytest.mark.parametrize("bad", [
    {"model": ""}, {"tenant": ""}, {"kv_dtype": "float7"}, {"num_layers": 0},
    {"head_dim": -1}, {"block_tokens": 1.5}, {"adapter_revision": "v1"},
])
def test_bad_identity_is_a_typed_error(bad: dict[str, object]) -> None:
    with pytest.raises(MalformedError):
        make_identity(**bad)


def test_keys_are_chained_and_only_full_blocks_get_keys() -> None:
    ns = make_identity().namespace_id
    tokens = list(range(100))
    keys = chain_keys(ns, tokens, 16)
    assert len(keys) == 6 and all(len(k) == 16 for k in keys)
    assert chain_keys(ns, tokens[:96], 16) == keys
    # a key stands for its whole prefix: changing an early token changes every later key
    changed = chain_keys(ns, [7] + tokens[1:], 16)
    assert all(a != b for a, b in zip(keys, changed))
    # the same block of tokens after a different prefix gets a different key
    assert chain_keys(ns, tokens[16:32], 16)[0] != keys[1]
    # continuing from a parent gives the same keys as hashing the whole prefix
    assert chain_keys(ns, tokens[32:96], 16, parent=keys[1]) == keys[2:]
    assert chain_keys(make_identity(salt="x").namespace_id, tokens, 16) != keys


def test_keys_are_stable_across_processes() -> None:
    ns = make_identity().namespace_id
    code = ("from kvstore.keys import chain_keys; import sys; "
            f"print(','.join(k.hex() for k in chain_keys(bytes.fromhex('{ns.hex()}'), "
            "list(range(64)), 16)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out.split(",") == [k.hex() for k in chain_keys(ns, list(range(64)), 16)]
