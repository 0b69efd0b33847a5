"""Run a real vLLM engine on the CPU as vllm_mixed_run.py does (``--spec``: ``engine``,
``connector``, ``phases``; adapters by name), and count kvstore's log records of WARNING
and above (``warnings``, the first few in ``warning_texts``); print JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_vllm_s57.py.  The result is one JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    if not os.path.exists(args.model):
        import vllm_run
        vllm_run.make_model(args.model)
    from vllm_mixed_run import run
    from vllm_s55_run import Counted

    counted = Counted()
    logging.getLogger("kvstore").addHandler(counted)
    result = run(spec, args.model)
    result |= {"warnings": counted.count, "warning_texts": counted.texts}
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
