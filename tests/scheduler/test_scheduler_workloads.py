"""The generated workloads of benchmarks/workloads.py have the shapes their docstrings
name: bursty arrivals, histories resent in tokens, shared repository contexts with
branches, drifting popularity, tenants of different reuse, a day's shift."""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType


def _load_workloads() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "workloads.py"
    spec = importlib.util.spec_from_file_location("kvstore_benchmark_workloads", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


workloads = _load_workloads()


def _gaps_cv(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def test_bursts_keep_the_mean_rate_and_are_burstier_than_poisson() -> None:
    bursty = workloads._Bursts(random.Random(1), 400, 6.0, 40_000, 10_000)
    times = [bursty() for _ in range(20_000)]
    assert 0.85 < times[-1] / len(times) / 400 < 1.15
    assert _gaps_cv(times) > 1.3
    poisson = workloads._Bursts(random.Random(1), 400, 1.0, 40_000, 10_000)
    plain = [poisson() for _ in range(20_000)]
    assert 0.9 < _gaps_cv(plain) < 1.1


def test_a_chat_turn_resends_its_history_and_adds_only_the_blocks_it_fills() -> None:
    trace = workloads.bursty_chat(3000)
    seen: set[tuple[int, ...]] = set()
    resent = added_none = 0
    for _, input_length, _, ids in trace:
        assert input_length // 512 == len(ids) and input_length % 512
        # a later turn starts with an earlier request of its chat: longer than any
        # system prompt (6 blocks), so a block of the chat's own
        earlier = [n for n in range(7, len(ids) + 1) if tuple(ids[:n]) in seen]
        resent += bool(earlier)
        added_none += bool(earlier) and earlier[-1] == len(ids)
        seen.add(tuple(ids))
    assert resent > 0.2 * len(trace)
    assert added_none > 0.03 * len(trace)  # a short turn fills no new block
    turns = Counter(tuple(ids[:1]) for _, _, _, ids in trace)
    assert len(turns) <= 6  # every chat opens with one of 6 system prompts


def test_longer_chats_resend_longer_histories() -> None:
    plain = workloads.bursty_chat(2000)
    longer = workloads.bursty_chat(2000, turns_median=6.0)
    assert (statistics.fmean(len(r[3]) for r in longer)
            > statistics.fmean(len(r[3]) for r in plain))


def test_coding_sessions_share_a_repository_head_and_sample_sibling_branches() -> None:
    trace = workloads.coding_agents(3000)
    heads = Counter(tuple(ids[:8]) for _, _, _, ids in trace)
    assert len(heads) == 1  # tools and instructions: every request's head
    repos = {ids[8] for _, _, _, ids in trace}
    assert len(repos) <= 12
    assert statistics.fmean(len(ids) for _, _, _, ids in trace) > 40  # large contexts
    # branches: requests at the same instant from the same context, differing in tails
    at: dict[int, list[list[int]]] = {}
    for timestamp, _, _, ids in trace:
        at.setdefault(timestamp, []).append(ids)
    siblings = [group for group in at.values() if len(group) > 1
                and len({tuple(ids[:min(map(len, group)) - 2]) for ids in group}) == 1]
    assert len(siblings) > 20


def test_a_repository_that_churns_keeps_its_head_and_rewrites_its_tail() -> None:
    # one repository of 24 blocks after the 8 of tools: a version rewrites 1 to 16
    trace = workloads.coding_agents(3000, repositories=1, repo_blocks=24, churn=0.5)
    assert len({tuple(ids[:16]) for _, _, _, ids in trace}) == 1
    versions = {tuple(ids[8:32]) for _, _, _, ids in trace}
    assert len(versions) > 5  # its later files differ between versions
    assert len({tuple(ids[8:32]) for _, _, _, ids in workloads.coding_agents(
        3000, repositories=1, repo_blocks=24, churn=0.0)}) == 1


def _popular(trace: list[tuple[int, int, int, list[int]]], top: int) -> set[int]:
    """The ``top`` most asked-for blocks right after each request's app prompt."""
    counts = Counter(ids[j] for _, _, _, ids in trace for j in range(2, min(5, len(ids))))
    return {block for block, _ in counts.most_common(top)}


def test_rag_popularity_drifts_with_trending_documents_and_holds_without() -> None:
    def overlap(trending: float) -> float:
        trace = workloads.rag_drift(4000, trending=trending)
        first, last = _popular(trace[:1000], 40), _popular(trace[-1000:], 40)
        return len(first & last) / 40

    assert overlap(0.0) > 0.6
    assert overlap(0.05) < overlap(0.0) - 0.2


def test_batch_tenant_documents_are_one_time_and_its_share_follows_the_parameter() -> None:
    def one_time_share(**kwargs: float) -> float:
        trace = workloads.tenant_mix(4000, **kwargs)
        uses = Counter(block for _, _, _, ids in trace for block in set(ids))
        one_time = [ids for _, _, _, ids in trace
                    if len(ids) >= 9 and all(uses[b] == 1 for b in ids[1:])]
        # every job's documents behind one instruction (a template asked for once
        # looks one-time too)
        instruction, jobs = Counter(ids[0] for ids in one_time).most_common(1)[0]
        batch = [ids for _, _, _, ids in trace if ids[0] == instruction]
        assert len(batch) == jobs and jobs > 0.9 * len(one_time)
        return jobs / len(trace)

    assert one_time_share(batch_share=0.6, chat_share=0.2) > 2 * one_time_share(
        batch_share=0.15, chat_share=0.4)


def test_api_templates_are_reused_and_chat_turns_extend_their_history() -> None:
    trace = workloads.tenant_mix(4000)
    seen = {tuple(ids) for _, _, _, ids in trace}
    extended = sum(any(tuple(ids[:n]) in seen for n in range(4, len(ids)))
                   for _, _, _, ids in trace if len(ids) <= 30)
    assert extended > 0.2 * len(trace)


def test_the_popular_prompts_shift_to_the_other_set_and_back_over_a_day() -> None:
    trace = workloads.diurnal(4000, overlap=0.0)
    tenth = len(trace) // 10
    start = {ids[0] for _, _, _, ids in trace[:tenth]}
    noon = {ids[0] for _, _, _, ids in trace[5 * tenth - tenth // 2:5 * tenth + tenth // 2]}
    end = {ids[0] for _, _, _, ids in trace[-tenth:]}
    assert len(start & noon) < 0.2 * len(start)
    assert len(start & end) > 0.5 * len(end)
    shared = workloads.diurnal(4000, overlap=0.5)
    s_start = {ids[0] for _, _, _, ids in shared[:tenth]}
    s_noon = {ids[0] for _, _, _, ids in shared[5 * tenth - tenth // 2:5 * tenth + tenth // 2]}
    assert len(s_start & s_noon) > 2 * len(start & noon)
