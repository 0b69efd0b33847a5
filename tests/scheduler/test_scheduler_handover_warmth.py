"""The hand-over benchmark (benchmarks/handover_warmth.py): ``auto`` held on LRU is
LRU until it is made to hand over, and then the candidate named is in charge."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvstore.bench.replay import TraceRequest, cacheable
from kvstore.scheduler.eviction import LRUPolicy, SLRUPolicy


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "handover_warmth.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_handover_warmth", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


warmth = _load()


def _trace(requests: int) -> list[TraceRequest]:
    made = warmth.WORKLOADS["scan"](requests, 2)
    return cacheable(TraceRequest(*request) for request in made)


def test_held_auto_hits_as_lru_does() -> None:
    """Held on LRU, the duel never elects: before and after any point, LRU's hits."""
    trace = _trace(400)
    cut = len(trace) // 3
    assert warmth.hits_after(trace, 60, cut, warmth.held_auto) == \
        warmth.hits_after(trace, 60, cut, LRUPolicy)


def test_held_on_another_candidate_it_hits_as_that_one_does() -> None:
    trace = _trace(400)
    cut = len(trace) // 3
    assert warmth.hits_after(trace, 60, cut, lambda: warmth.held_auto("slru")) == \
        warmth.hits_after(trace, 60, cut, SLRUPolicy)


def test_a_hand_over_puts_the_candidate_in_charge() -> None:
    trace = _trace(400)
    seen: list[str] = []

    def handed(policy: object) -> None:
        warmth.hand_over("slru")(policy)
        seen.append(policy.leader)  # type: ignore[attr-defined]

    before, _ = warmth.hits_after(trace, 60, len(trace) // 3, warmth.held_auto, handed)
    assert seen == ["slru"]
    assert before == warmth.hits_after(trace, 60, len(trace) // 3, LRUPolicy)[0]


def test_the_report_has_a_row_per_capacity_and_candidate(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert warmth.main(["--workloads", "scan", "--requests", "300", "--capacities",
                        "0.05,0.25", "--to", "slru,density"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("scan ")]
    assert [(row[1], row[2]) for row in rows] == [
        ("5%", "slru"), ("5%", "density"), ("25%", "slru"), ("25%", "density")]
    assert all(len(row) == 7 for row in rows), rows


def test_only_the_duel_s_candidates_are_handed_to() -> None:
    with pytest.raises(SystemExit):
        warmth.main(["--workloads", "scan", "--to", "s3fifo"])
