"""SGLang servers whose arguments change the KV of one checkpoint must not share its
pages: kvstore's HiCache backend, built by SGLang's own factory, under the server
arguments SGLang publishes to it (``--json-model-override-args``, ``--quantization``),
against a daemon.  Runs inside the SGLang test environment, started by
test_engine_sglang_s57.py; prints one JSON object of named checks on its last line.
The host pool is sglang_identity_run.py's stand-in (SGLang's own needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang_identity_run import ShapedPool, backend, shared  # noqa: E402


def serve(**args: Any) -> None:
    """The server's arguments as SGLang publishes them to the backend (those it reads)."""
    fields = {"json_model_override_args": "{}", "quantization": None, "kv_cache_dtype": "auto",
              "model_path": None, "revision": None, "enable_torch_compile": False}
    get_context().set_server_args(types.SimpleNamespace(**{**fields, **args}))  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--tenant", required=True)
    a = parser.parse_args()
    made: list[Any] = []

    def make(seed: int, **args: Any) -> tuple[Any, ShapedPool]:
        serve(**args)
        pool = ShapedPool(seed)
        made.append(backend(a.endpoint, a.tenant, pool, extra={"model_revision": "r1"}))
        return made[-1], pool

    rope = json.dumps({"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    plain, plain_pool = make(1)
    scaled, scaled_pool = make(2, json_model_override_args=rope)
    quantized, quantized_pool = make(3, quantization="fp8")
    out = {"overridden": shared(plain, scaled, plain_pool, scaled_pool, 1000),
           "quantized": shared(plain, quantized, plain_pool, quantized_pool, 2000)}
    # the same overrides (written another way) and none ("{}"): their pages shared
    again, again_pool = make(4, json_model_override_args=rope.replace(" ", ""))
    out["same_overrides"] = shared(scaled, again, scaled_pool, again_pool, 3000)
    empty, empty_pool = make(5, json_model_override_args="{}")
    out["empty_overrides"] = shared(plain, empty, plain_pool, empty_pool, 4000)
    for storage in made:
        storage.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
