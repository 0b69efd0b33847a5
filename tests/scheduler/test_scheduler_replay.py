"""The offline replay: its simulators and bounds, on small synthetic traces."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvstore.bench.replay import trace_block_tokens
from kvstore.scheduler.eviction import DEFAULT_POLICY, LRUPolicy, S3FIFOPolicy, make_policy


def _load_replay() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "replay.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_replay", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


replay = _load_replay()


def _request(ids: list[int], last_tokens: int = 512) -> object:
    return replay.TraceRequest(0, 512 * (len(ids) - 1) + last_tokens, 1, ids)


def _scan_plus_hot_set(seed: int = 7) -> list[object]:
    """Ten hot 3-block chains hit over and over; now and then a scan of ten one-time
    10-block requests, 100 blocks in all, more than the cache of the tests holds."""
    rng = random.Random(seed)
    hot = [[1000 + 3 * c, 1000 + 3 * c + 1, 1000 + 3 * c + 2] for c in range(10)]
    trace = []
    fresh = 10_000
    for _ in range(30):
        for _ in range(20):
            trace.append(_request(rng.choice(hot)))
        for _ in range(10):
            trace.append(_request(list(range(fresh, fresh + 10))))
            fresh += 10
    return trace


def _block_hits(trace: list[object], cache: object) -> int:
    hits: int = replay.replay(trace, cache).hit_blocks
    return hits


def test_s3fifo_beats_lru_on_scans_through_a_hot_set() -> None:
    trace = _scan_plus_hot_set()
    lru = _block_hits(trace, replay.PolicyCache(LRUPolicy(), 60))
    s3fifo = _block_hits(trace, replay.PolicyCache(S3FIFOPolicy(), 60))
    best = _block_hits(trace, replay.BeladyCache(trace, 60))
    assert s3fifo > 1.2 * lru, (s3fifo, lru, best)
    assert best >= s3fifo


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc", "slru", "auto"])
def test_bounds_order_and_prefix_closure_on_a_random_tree(name: str) -> None:
    rng = random.Random(3)
    chains: list[list[int]] = [[]]
    next_id = 0
    trace = []
    for _ in range(400):
        base = rng.choice(chains)[: rng.randint(0, 6)]
        extra = list(range(next_id, next_id + rng.randint(0 if base else 1, 5)))
        next_id += len(extra)
        chain = base + extra
        chains.append(chain)
        trace.append(_request(chain, last_tokens=rng.randint(1, 512)))
    factory = replay.POLICIES[name]
    for capacity in (8, 20, 50):
        policy = _block_hits(trace, replay.PolicyCache(factory(), capacity))
        best = _block_hits(trace, replay.BeladyCache(trace, capacity))
        must_cache = _block_hits(trace, replay.BeladyCache(trace, capacity, bypass=False))
        infinite = _block_hits(trace, replay.InfiniteCache())
        oracle = _block_hits(trace, replay.OracleCache(trace, capacity))
        rate = _block_hits(trace, replay.RateOracleCache(trace, capacity))
        assert policy <= must_cache <= best <= infinite
        assert oracle <= must_cache   # knowing whether a block returns, not when
        assert rate <= must_cache     # knowing how often, not when


def test_rate_oracle_keeps_the_popular_chain() -> None:
    """A chain asked for every other request and a chain asked for twice, with one-time
    chains between: at a capacity that holds one of them beside the one-time chain, the
    popularity oracle keeps the popular one and gives up the rare one."""
    popular, rare = [1, 2, 3], [11, 12, 13]
    trace = [_request(rare)]
    fresh = 100
    for i in range(40):
        trace.append(_request(popular if i % 2 else list(range(fresh, fresh + 3))))
        fresh += 3
    trace.append(_request(rare))
    rate = replay.replay(trace, replay.RateOracleCache(trace, 6))
    assert rate.hit_blocks == 3 * 19  # every repeat of the popular chain, not the rare one


def test_token_hits_count_the_partial_last_block() -> None:
    trace = [_request([1, 2], last_tokens=100), _request([1, 2], last_tokens=100)]
    stats = replay.replay(trace, replay.InfiniteCache())
    assert (stats.blocks, stats.hit_blocks) == (4, 2)
    assert (stats.tokens, stats.hit_tokens) == (2 * 612, 612)
    partial = replay.replay([_request([1, 2, 3]), _request([1, 2, 4])], replay.InfiniteCache())
    assert partial.hit_tokens == 2 * 512


def test_format_table_puts_ratios_against_belady() -> None:
    trace = _scan_plus_hot_set()[:200]
    rows = replay.run_sim(trace, [0.05], ["lru", "s3fifo"])
    assert [row[2] for row in rows] == ["belady", "belady-ins", "rate+oracle", "lru+oracle",
                                        "lru", "s3fifo", "infinite"]
    table = replay.format_table(rows)
    assert "belady" in table and "1.000" in table


@pytest.mark.parametrize("name", sorted(replay.WORKLOADS))
def test_synthetic_workloads_are_prefix_chained(name: str) -> None:
    trace = replay.synthetic(name, 400)
    assert len(trace) == 400
    prefix_of: dict[int, tuple[int, ...]] = {}
    for request in trace:
        ids = request.hash_ids
        assert request.input_length // 512 == len(ids) and request.input_length % 512
        for i, h in enumerate(ids):
            assert prefix_of.setdefault(h, tuple(ids[:i])) == tuple(ids[:i])
    assert len(prefix_of) < sum(len(r.hash_ids) for r in trace)  # something repeats
    assert replay.synthetic(name, 400) == trace  # seeded: the same every run


def test_default_policy_beats_lru_on_scans() -> None:
    trace = replay.synthetic("scan", 1500)
    capacity = replay.sim_capacity(0.05, replay.unique_blocks(trace))
    lru = _block_hits(trace, replay.PolicyCache(LRUPolicy(), capacity))
    default = _block_hits(trace, replay.PolicyCache(make_policy(DEFAULT_POLICY), capacity))
    assert default > lru


def test_main_replays_a_workload_and_reports_hits_twice_alike(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--workload", "conversations", "--requests", "300", "--capacities", "0.05"]
    assert replay.main(args) == 0
    once = capsys.readouterr().out
    assert replay.main([*args, "--touches", "2"]) == 0
    twice = capsys.readouterr().out
    assert "synthetic workload 'conversations'" in once and "arc" in once
    assert once.splitlines()[:-1] == twice.splitlines()[:-1]  # all but the timing


def test_the_oracle_lru_puts_blocks_never_used_again_first() -> None:
    trace = [_request([3, 4]), _request([1, 2]), _request([3, 4]), _request([5, 6]),
             _request([1, 2])]
    # capacity 4: when [5, 6] comes, 3 and 4 are the most recent but never asked for
    # again; the oracle evicts them, LRU evicts 1 and 2 (and misses them next)
    cache = replay.OracleCache(trace, 4)
    lru = replay.PolicyCache(replay.POLICIES["lru"](), 4)
    replay.replay(trace[:4], cache)
    replay.replay(trace[:4], lru)
    assert set(cache._children) == {1, 2, 5, 6}
    assert set(lru._children) == {3, 4, 5, 6}


def _write_trace(path: Path, requests: list[object]) -> None:
    import msgspec

    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in requests))


def test_main_prints_one_summary_of_every_trace_and_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    _write_trace(tmp_path / "first.jsonl", replay.synthetic("tenants", 200))
    _write_trace(tmp_path / "second.jsonl", replay.synthetic("agents", 200))
    args = ["--trace", str(tmp_path / "first.jsonl"), "--trace", str(tmp_path / "second.jsonl"),
            "--workload", "all", "--requests", "200", "--capacities", "0.05,0.25",
            "--policies", "lru,auto"]
    assert replay.main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("workload "))
    rows = [line.split() for line in lines[start + 1:] if line and not line.startswith("(")]
    workloads = ["first", "second", *replay.WORKLOADS]
    assert sorted({row[0] for row in rows}) == sorted(workloads)
    for workload in workloads:
        for share in ("5%", "25%"):
            names = [row[3] for row in rows if row[0] == workload and row[1] == share]
            assert names == ["belady", "lru", "auto"], (workload, share, names)
    lru_rows = [row for row in rows if row[3] == "lru"]
    assert all(row[6] == "1.000" for row in lru_rows)  # the /lru column of LRU itself


def test_main_refuses_a_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        replay.main(["--trace", str(tmp_path / "absent.jsonl")])


def test_plot_writes_a_png_of_the_summary(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # the 'plot' extra (in the 'test' extra too)
    png = tmp_path / "hits.png"
    args = ["--workload", "tenants", "--requests", "200", "--capacities", "0.05,0.1",
            "--policies", "lru,auto", "--plot", str(png)]
    assert replay.main(args) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize("name", sorted(replay.WORKLOADS))
def test_every_workload_has_the_same_requests_for_a_seed_and_others_for_another(
        name: str) -> None:
    generate = replay.WORKLOADS[name]
    assert generate(300) == generate(300)
    first = generate(300)
    import inspect

    seed = inspect.signature(generate).parameters["seed"].default
    assert generate(300, seed + 1) != first


def test_conversation_variants_change_the_shape_they_name() -> None:
    generate = replay.WORKLOADS["conversations"]
    plain = generate(2000)
    # the defaults give the requests the generator gave before it took these parameters
    assert plain[0] == (35, 12912, 115, list(range(25)))
    digest = hashlib.sha256(json.dumps(plain).encode()).hexdigest()
    assert digest == "b6938f512c88d334a18a013ad76d17b30b03219df22f11e63dccc9d48b0388c9"
    longer = generate(2000, follow=0.95)  # longer sessions: longer histories resent
    assert sum(len(r[3]) for r in longer) > sum(len(r[3]) for r in plain)
    assert generate(2000, document_skew=1.4) != plain


def _write(path: Path, requests: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def test_a_trace_of_other_block_sizes_is_read_at_its_own_size(tmp_path: Path) -> None:
    """Before, every trace was cut at 512 tokens a block: a trace of 16-token blocks kept
    1 id in 32 of each request, and replayed a different, much smaller workload."""
    shared = [7, 8, 9, 10]  # a 64-token system prompt in 16-token blocks
    requests = [{"timestamp": 1.5 * i, "input_length": 16 * (4 + i % 3) + 5,
                 "hash_ids": shared + [100 * i + j for j in range(i % 3)] + [100 * i + 99]}
                for i in range(6)]  # (floats as timestamps, no output_length: taken)
    trace = replay.load_trace(_write(tmp_path / "t16.jsonl", requests))
    assert {r.block_tokens for r in trace} == {16}
    cut = replay.cacheable(trace)
    assert [len(r.hash_ids) for r in cut] == [4 + i % 3 for i in range(6)]
    stats = replay.replay(cut, replay.InfiniteCache())
    assert stats.hit_blocks == 5 * 4  # the shared prompt, after its first request
    assert stats.hit_tokens == 5 * 4 * 16
    # named: taken as given
    assert {r.block_tokens for r in replay.load_trace(tmp_path / "t16.jsonl", 32)} == {32}


@pytest.mark.parametrize(("lengths", "size"), [
    ([(1024, 2), (1000, 2), (513, 2), (100, 1)], 512),   # the Mooncake traces (ceil)
    ([(1024, 2), (1100, 2), (1600, 3)], 512),            # only full blocks have ids
    ([(64, 4), (70, 5), (16, 1)], 16),
    ([(100, 4), (125, 5)], 25),                           # no power of two fits
    ([], 512),
])
def test_a_traces_block_size_is_the_one_its_lengths_and_ids_fit(
        lengths: list[tuple[int, int]], size: int) -> None:
    trace = [replay.TraceRequest(0, length, 1, list(range(n))) for length, n in lengths]
    assert trace_block_tokens(trace) == size


def test_a_trace_no_block_size_fits_or_a_bad_line_is_a_clear_error(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 100,
                                           "hash_ids": [1]},
                                          {"timestamp": 1, "input_length": 100,
                                           "hash_ids": [1, 2, 3, 4, 5]},
                                          {"timestamp": 2, "input_length": 100,
                                           "hash_ids": list(range(50))}])
    with pytest.raises(replay.TraceError, match="name the trace's block size"):
        replay.load_trace(bad)
    assert len(replay.load_trace(bad, 512)) == 3
    (tmp_path / "line.jsonl").write_text('{"timestamp": 0, "input_length": 5}\n\n'
                                         '{"timestamp": 1, "input_length": "many"}\n')
    with pytest.raises(replay.TraceError, match=r"line 3: Expected `int`"):
        replay.load_trace(tmp_path / "line.jsonl")
