"""The policy sweep (benchmarks/policy_sweep.py): its workload variants are real
variants of their generators, and its report judges the subject against LRU and the
best of the others."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _load_sweep() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "policy_sweep.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_policy_sweep", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


sweep = _load_sweep()


@pytest.mark.parametrize("workload", sorted(sweep.VARIANTS))
def test_each_variant_is_another_trace_of_its_generator(workload: str) -> None:
    """A misspelt parameter would raise; one the generator ignores would give the
    default's trace again."""
    variants = dict(sweep.VARIANTS[workload])
    default = sweep._trace_of(workload, variants.pop("default"), 1, 300)
    for name, kwargs in variants.items():
        assert sweep._trace_of(workload, kwargs, 1, 300) != default, name


def test_a_cell_is_judged_against_lru_and_the_best_other_policy() -> None:
    cell = sweep.Cell("w", 1, 0.1, 10, {"lru": 100, "slru": 120, "auto": 110})
    to_lru, to_best, best = sweep.ratios(cell, "auto")
    assert (round(to_lru, 3), round(to_best, 3), best) == (1.1, 0.917, "slru")
    report = sweep.format_report([cell], "auto", worst=1)
    assert report.splitlines()[1].split() == ["w", "1", "10%", "110", "1.100", "0.917", "slru"]
    assert "/best 0.917 (slru), /lru 1.100" in report


def test_a_sweep_replays_every_seed_and_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep.main(["--workloads", "scan", "--seeds", "2", "--requests", "200",
                       "--capacities", "0.05,0.25", "--policies", "lru,slru",
                       "--subject", "slru"]) == 0
    out = capsys.readouterr().out
    cells = len(sweep.VARIANTS["scan"]) * 2 * 2
    total = next(line for line in out.splitlines() if line.startswith("ALL "))
    assert total.split()[1] == str(cells), out
    assert f"({cells} cells," in out


def test_a_sweep_of_some_variants_prints_the_duel_s_hand_overs(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--variants`` replays only the variants named; ``--elections`` says, per cell,
    when the duel handed its order over, to which candidate and why."""
    assert sweep.main(["--workloads", "scan,documents", "--variants", "scan/default",
                       "--seeds", "1", "--requests", "600", "--capacities", "0.05",
                       "--policies", "lru,auto", "--elections"]) == 0
    out = capsys.readouterr().out
    assert "(1 cells," in out and "documents" not in out, out
    handovers = out.split("auto's hand-overs:")[1].splitlines()
    assert handovers[1].strip().startswith("scan/default seed 2 at 5%"), out
    assert "lru -> slru (election; vs lru's miniature +0/-0; lru=" in handovers[2], out


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(SystemExit):
        sweep.main(["--variants", "scan/no-such-variant"])
