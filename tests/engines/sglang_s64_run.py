"""An SGLang server started with LoRA adapters (``--lora-paths``) whose weights were
replaced in place must not load the pages the old weights computed: kvstore's HiCache
backend, built by SGLang's own factory, under the server arguments SGLang publishes to
it, against a daemon.  Runs inside the SGLang test environment, started by
test_engine_sglang_s64.py; prints one JSON object of named checks on its last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang.srt.lora.lora_registry import LoRARef  # noqa: E402
from sglang_identity_run import ShapedPool, backend, shared  # noqa: E402
from sglang_s57_run import serve  # noqa: E402


def adapter(root: Path, name: str, seed: int) -> Path:
    """An adapter directory as PEFT writes one: its settings and its weights."""
    path = root / name
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    (path / "adapter_model.safetensors").write_bytes(bytes([seed]) * 300_000)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--scratch", required=True, help="a scratch directory")
    a = parser.parse_args()
    root = Path(a.scratch)
    made: list[Any] = []

    def make(seed: int, lora_paths: Any) -> tuple[Any, ShapedPool]:
        serve(lora_paths=lora_paths)
        pool = ShapedPool(seed)
        made.append(backend(a.endpoint, a.tenant, pool, extra={"model_revision": "r1"}))
        return made[-1], pool

    path = adapter(root, "sql", 1)
    refs = [LoRARef(lora_id=LoRARef.deterministic_id("sql", str(path)), lora_name="sql",
                    lora_path=str(path))]
    first, first_pool = make(1, refs)
    # the same adapter, given as SGLang's command line does before it parses it: shared
    same, same_pool = make(2, [f"sql={path}"])
    out = {"same_adapter": shared(first, same, first_pool, same_pool, 1000)}
    # a new fine-tune written over it at the same path (same names and sizes), the
    # server restarted on it: the same lora_id, so the same page hashes
    adapter(root, "sql", 7)
    replaced, replaced_pool = make(3, refs)
    out["replaced_in_place"] = shared(first, replaced, first_pool, replaced_pool, 2000)
    # a server with no adapter and one with another adapter added share nothing with it
    plain, plain_pool = make(4, None)
    out["no_adapters"] = shared(replaced, plain, replaced_pool, plain_pool, 3000)
    other = adapter(root, "chat", 3)
    more, more_pool = make(5, {"sql": str(path), "chat": str(other)})
    out["another_added"] = shared(replaced, more, replaced_pool, more_pool, 4000)
    for storage in made:
        storage.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
