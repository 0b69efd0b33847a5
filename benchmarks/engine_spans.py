"""Where a request's time goes in ``engine_e2e.py``'s engine: nanoseconds spent in named
spans of vLLM's step and of kvstore's connector, summed per process, so the driver can
take the difference around each request (``--spans``).

Apart from the benchmark so that it stays within its size; patched onto the engine of
the arm's own process only, and only when asked (every span costs two clock reads).

Spans nest (``execute`` holds ``forward``, ``c.start_load_kv`` and the rest of the
worker's connector calls; ``schedule`` holds the scheduler's); each is the total time
inside it, so a parent less its children is its own work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# vLLM's parts of a step, always timed: what the rounds-2+ line reports
PHASES = ("schedule", "execute", "forward")

# The connector's calls (on both its scheduler and its worker instance: patched on the
# class), named ``c.<method>``
CONNECTOR_CALLS = ("on_new_request", "get_num_new_matched_tokens",
                   "update_state_after_alloc", "build_connector_meta", "request_finished",
                   "handle_preemptions", "start_load_kv", "wait_for_layer_load",
                   "wait_for_save", "get_finished", "get_block_ids_with_load_errors")


class SpanClock:
    """Nanoseconds spent in each span so far, in this process (``snapshot``)."""

    def __init__(self, llm: Any, *, detailed: bool) -> None:
        self.total: dict[str, int] = dict.fromkeys(PHASES, 0)
        core = llm.llm_engine.engine_core.engine_core
        runner = getattr(getattr(getattr(core.model_executor, "driver_worker", None),
                                 "worker", None), "model_runner", None)
        spans: list[tuple[Any, str, str]] = [
            (core.scheduler, "schedule", "schedule"),
            (core.model_executor, "execute_model", "execute"),
            (getattr(runner, "model", None), "forward", "forward")]
        if detailed:
            engine = llm.llm_engine
            spans += [(engine, "add_request", "add_request"), (engine, "step", "step"),
                      (core.model_executor, "sample_tokens", "sample_tokens"),
                      (core.scheduler, "update_from_output", "update_from_output"),
                      (runner, "_update_states", "_update_states"),
                      (runner, "_prepare_inputs", "_prepare_inputs"),
                      (getattr(engine, "output_processor", None), "process_outputs",
                       "output_processor")]
            connector = type(getattr(core.scheduler, "connector", None))
            spans += [(connector, name, f"c.{name}") for name in CONNECTOR_CALLS
                      if connector is not type(None)]
        for owner, name, span in spans:
            if owner is not None and callable(getattr(owner, name, None)):
                self.total.setdefault(span, 0)
                setattr(owner, name, self._timed(getattr(owner, name), span))

    def _timed(self, call: Callable[..., Any], span: str) -> Callable[..., Any]:
        """``call`` timed into ``span`` (set on a class, it binds as the method did)."""
        total = self.total

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return call(*args, **kwargs)
            finally:
                total[span] += time.perf_counter_ns() - started
        return timed

    def snapshot(self) -> dict[str, int]:
        return dict(self.total)

