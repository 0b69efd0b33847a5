"""Run a real vLLM engine on the CPU as vllm_s57_run.py does (its ``--spec``), counting
besides the draft tokens vLLM's speculative decoding had each step verify (``drafts``):
a run that drafted none tested nothing of it.  Runs inside the vLLM test environment
(.engine-envs/vllm), started by test_engine_vllm_s62.py.  The result is one JSON object
on the last line of stdout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process


def counting_drafts(drafts: list[int]) -> None:
    """Have vllm_setups_run's engines count, in ``drafts[0]``, the draft tokens their
    scheduler hands each step to verify."""
    import vllm_setups_run

    start = vllm_setups_run.start_engine

    def start_engine(*args: Any, **kwargs: Any) -> Any:
        started = start(*args, **kwargs)
        scheduler = started[2]
        schedule = scheduler.schedule

        def schedule_counting(*a: Any, **k: Any) -> Any:
            out = schedule(*a, **k)
            drafts[0] += sum(len(t) for t in out.scheduled_spec_decode_tokens.values())
            return out
        scheduler.schedule = schedule_counting
        return started
    vllm_setups_run.start_engine = start_engine


def main() -> None:
    import vllm_s57_run

    drafts = [0]
    counting_drafts(drafts)
    vllm_s57_run.main(lambda: {"drafts": drafts[0]})


if __name__ == "__main__":
    main()
