"""Run a real vLLM engine on the CPU with or without kvstore, under set-ups the other
runners do not take (prompt log-probabilities, engines side by side on one daemon); print
JSON.

Runs inside the vLLM test environment (.engine-envs/vllm), started by
test_engine_setups_s55.py.  ``--spec`` names a JSON object as vllm_setups_run.py's
(``engine``, ``connector``, ``phases``); a phase may also give ``prompt_logprobs`` (the
log-probability of each prompt token, rounded, comes back per result) and ``pause``
(before the phase: ``NAME.ready`` written, ``NAME.go`` waited for); the spec's
``commit_pause`` names a pause the first commit of a save makes after its reserve (its
reservation open while the test acts; ``NAME.skipped``: how many of its keys it was
given no slot for).  kvstore's log
records of WARNING and above are counted (``warnings``, the first few in
``warning_texts``).  After each phase the run waits for the saves, steps the engine until
it holds no request, and reads the daemon's DRAM figures (``daemon``).  The result is one
JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in-process


class Counted(logging.Handler):
    """kvstore's records of WARNING and above: counted, the first few kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count, self.texts = 0, []

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.texts) < 5:
            self.texts.append(record.getMessage()[:300])


def prompt_logprobs(out: Any) -> list[float | None] | None:
    """Each prompt token's log-probability (None for the first), rounded."""
    found = getattr(out, "prompt_logprobs", None)
    if found is None:
        return None
    chosen = []
    for token, entry in zip(out.prompt_token_ids, found):
        chosen.append(None if entry is None or token not in entry
                      else round(float(entry[token].logprob), 3))
    return chosen


def pause_first_commit(name: str) -> None:
    """The first reservation committed waits at the pause ``name`` first (open)."""
    from vllm_setups_run import pause

    from kvstore.client import Reservation

    commit, first = Reservation.commit, [True]

    def paused(self: Reservation) -> int:
        if first[0]:
            first[0] = False
            # (its keys given no slot: held, or awaited from another writer's reservation)
            Path(f"{name}.skipped").write_text(str(sum(1 for o in self.offsets if o < 0)))
            pause(name)
        return commit(self)

    Reservation.commit = paused  # type: ignore[method-assign]


def run(spec: dict[str, Any], model: str) -> dict[str, Any]:
    from vllm_setups_run import daemon_dram, pause, run_requests, start_engine

    if spec.get("commit_pause"):
        pause_first_commit(spec["commit_pause"])
    counted = Counted()
    logging.getLogger("kvstore").addHandler(counted)
    eng, conn = spec.get("engine", {}), spec.get("connector")
    llm, engine, scheduler, preemptions, sched_conn, connected, worker = start_engine(
        model, eng, conn)
    phases, counter = [], 0
    for phase in spec["phases"]:
        if phase.get("pause"):
            pause(phase["pause"])
        if phase.get("reset_prefix_cache") and not llm.reset_prefix_cache():
            raise SystemExit("vLLM did not empty its prefix cache")
        before = dict(sched_conn.stats) if sched_conn else {}
        ids, outputs, steps = run_requests(
            engine, phase, counter, most_steps=4000,
            more=lambda out: {"prompt_logprobs": prompt_logprobs(out)},
            prompt_logprobs=phase.get("prompt_logprobs"))
        counter += len(ids)
        if worker is not None:
            worker.drain_saves(30)
        freeing = 0
        while (scheduler.requests or engine.has_unfinished_requests()) and freeing < 200:
            engine.step()
            freeing += 1
        after = dict(sched_conn.stats) if sched_conn else {}
        phases.append({
            "results": [outputs.get(i) for i in ids], "steps": steps,
            "left_in_scheduler": len(scheduler.requests),
            "daemon": daemon_dram(conn) if conn is not None else {},
            "offers": after.get("offers", 0) - before.get("offers", 0),
            "external_tokens": after.get("hit_tokens", 0) - before.get("hit_tokens", 0)})
    return {"phases": phases, "preemptions": preemptions[0], "connected": connected,
            "worker": dict(worker.stats) if worker else {},
            "scheduler": dict(sched_conn.stats) if sched_conn else {},
            "scheduler_requests_left": len(sched_conn._book) if sched_conn else 0,
            "warnings": counted.count, "warning_texts": counted.texts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    if not os.path.exists(args.model):
        from vllm_run import make_model
        make_model(args.model)
    with open(args.spec) as f:
        spec = json.load(f)
    result = run(spec, args.model)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown


if __name__ == "__main__":
    main()
