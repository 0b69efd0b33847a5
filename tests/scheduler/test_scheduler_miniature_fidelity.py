"""The miniatures' fidelity benchmark (benchmarks/miniature_fidelity.py): the miniature
hits it reports are those of the whole replay, and the densities it sets side by side
are what a hand-over would adopt and what ``density`` alone learned."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvstore.bench.replay import PolicyCache, TraceRequest, cacheable, replay
from kvstore.scheduler.density import HitDensityPolicy


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "miniature_fidelity.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_miniature_fidelity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


fidelity = _load()


def _trace(requests: int) -> list[TraceRequest]:
    made = fidelity.WORKLOADS["scan"](requests, 2)
    return cacheable(TraceRequest(*request) for request in made)


def test_the_held_duel_is_lru_throughout() -> None:
    """Held, the duel never hands over: the real cache is LRU's for the whole replay."""
    trace = _trace(600)
    duel = fidelity.held_duel()
    replay(trace, PolicyCache(duel, 60))
    assert duel.leader == "lru" and duel.switches == 0


def test_miniature_hits_are_the_whole_replay_s_not_the_faded_scores() -> None:
    """The scores fade by ``keep`` at each election; the counts reported do not, so over
    a replay with several elections each is above its candidate's score."""
    trace = _trace(600)
    hits = fidelity.miniature_hits(trace, 60)
    duel = fidelity.held_duel()
    replay(trace, PolicyCache(duel, 60))
    scores = duel.scores()
    assert set(hits) == set(scores) == {"lru", "slru", "arc", "density"}
    assert all(hits[name] > scores[name] > 0 for name in hits), (hits, scores)


def test_the_densities_set_side_by_side() -> None:
    """``alone`` is what ``density`` replayed alone learned; ``miniature`` is None until
    the miniature learned, and then tables for every class."""
    trace = _trace(600)
    handed, alone = fidelity.handed_densities(trace, 60, 3)
    assert handed is None
    handed, alone = fidelity.handed_densities(trace, 60, len(trace) // 2)
    density: HitDensityPolicy[Any] = HitDensityPolicy()
    replay(trace[:len(trace) // 2], PolicyCache(density, 60))
    assert alone == density._density
    assert handed is not None and len(handed) == len(alone or [])


def test_the_report_has_a_row_per_capacity_and_candidate(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert fidelity.main(["--workloads", "scan", "--requests", "300", "--capacities",
                          "0.05,0.25"]) == 0
    out = capsys.readouterr().out
    ranking = [line.split() for line in out.split("densities")[0].splitlines()
               if line.startswith("scan ")]
    assert [(row[1], row[2]) for row in ranking] == [
        (cap, order) for cap in ("5%", "25%") for order in ("lru", "slru", "arc", "density")]
    assert all(row[4] == "1.0000" and row[6] == "1.0000"
               for row in ranking if row[2] == "lru"), ranking


def test_only_known_workloads() -> None:
    with pytest.raises(SystemExit):
        fidelity.main(["--workloads", "nonesuch"])
