"""SGLang servers of different weights served under one alias (``--served-model-name``,
a canary beside the model it may replace) must not load each other's pages through
kvstore, and servers of one model under two aliases may: kvstore's HiCache backend,
built by SGLang's own factory, under the server arguments SGLang publishes to it, against
a daemon.  Runs inside the SGLang test environment, started by
test_engine_sglang_s62.py; prints one JSON object of named checks on its last line.
The host pool is sglang_identity_run.py's stand-in (SGLang's own needs CUDA).

SGLang names the model to storage backends by its served name; the weights' revision
is found only for a checkpoint directory or a hub id in the default Hugging Face cache
(not one downloaded with ``--download-dir``, say), else "unversioned".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_identity_run import ShapedPool, backend, shared  # noqa: E402
from sglang_s57_run import serve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--tenant", required=True)
    a = parser.parse_args()
    made: list[Any] = []

    def make(seed: int, model_path: str, alias: str) -> tuple[Any, ShapedPool]:
        serve(model_path=model_path)  # (hub ids in no local cache: no revision found)
        pool = ShapedPool(seed)
        made.append(backend(a.endpoint, a.tenant, pool, model_name=alias))
        return made[-1], pool

    stable, stable_pool = make(1, "example-org/tiny-base", "tiny")
    canary, canary_pool = make(2, "example-org/tiny-finetune", "tiny")
    out = {"one_alias": shared(stable, canary, stable_pool, canary_pool, 1000),
           "names": [stable._identity.model, canary._identity.model]}
    other, other_pool = make(3, "example-org/tiny-base", "tiny-eu")
    out["two_aliases"] = shared(stable, other, stable_pool, other_pool, 2000)
    for storage in made:
        storage.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
