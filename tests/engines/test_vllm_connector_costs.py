"""The vLLM connector's per-request costs cut from a first token's path, checked as
behaviour in the vLLM test environment (vllm_costs_run.py: no engine started)."""

from __future__ import annotations

from typing import Any

import pytest
from engine_envs import HERE, last_json, run_in_env

CHECKS = ["a_namespace_id_is_hashed_once_per_group_and_variant",
          "past_the_limit_ids_are_hashed_each_time_and_still_right",
          "a_staged_cache_block_size_is_its_pages_bytes",
          "a_step_that_loads_starts_held_saves_once_its_blocks_are_copied",
          "a_preempted_request_saves_are_still_waited_for_in_a_step_that_loads",
          "a_request_whose_load_failed_sends_no_save_and_is_let_go_at_its_end",
          "layerwise_is_true_false_or_auto",
          "auto_goes_layer_by_layer_once_every_layer_was_asked_for",
          "a_worker_on_host_pages_copies_every_steps_loads_on_one_kept_thread",
          "an_offer_never_waits_a_round_trip_for_the_daemons_rates"]


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    proc = run_in_env("vllm", [str(HERE / "vllm_costs_run.py")], timeout=300)
    found: dict[str, Any] = last_json(proc.stdout)
    return found


def test_every_check_ran(results: dict[str, Any]) -> None:
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_check(results: dict[str, Any], check: str) -> None:
    assert results.get(check) == "ok", results.get(check)
