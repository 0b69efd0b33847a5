"""The table and the JSON document of a ``kvstore bench`` run.

The JSON document (``--json``), version 1:

- ``version``: 1; ``kvstore``: the package's version; ``daemon``: ``"started"`` (a
  daemon in a temporary directory) or the ``--endpoint`` measured; ``quick``,
  ``repeat``: how it ran; ``sections``: the sections asked for, in order.
- ``rows``: one object per measurement: ``section``, ``name``, ``unit`` (``us``,
  ``GB/s``, ``req/s`` or ``hit rate``), ``kvstore`` and ``peer`` (medians in that unit),
  ``peer_name`` (what the peer is), ``ratio`` (kvstore / peer), ``share_of_limit`` (the
  ratio turned so that 1.0 is the peer and more is better: peer / kvstore for a
  latency), ``better`` (``lower`` or ``higher``) and ``goal`` (the ratio aimed at, or
  null).
- ``sweeps``: curves, each a list of points: ``lookup_latency`` (``keys``,
  ``kvstore_us``, ``echo_us``), ``throughput`` (``clients``, ``kvstore_rps``,
  ``echo_rps``), ``hit_rate`` (``capacity_share``, ``capacity_blocks``,
  ``kvstore``, ``policy_sim``, ``infinite``).
- ``skipped``: section -> why it did not run (no redis-server, no trace, no LMCache).
- ``against``: ``{"lmcache": {...}}`` with ``--against lmcache``: LMCache's figures
  (``lookup_64_us``, ``store_<size>_gbs`` and ``load_<size>_gbs`` for sizes ``256KiB``
  and ``2MiB``, ``version``, the ``python`` that ran it) and, under ``kvstore``,
  kvstore's of the same definitions; the same pairs are in ``rows``, section
  ``lmcache``.
- ``plots``: the PNG files written with ``--plot``.
"""

from __future__ import annotations

from typing import Any

from kvstore.bench.harness import Results

VERSION = 1


def document(results: Results, *, daemon: str, quick: bool, repeat: int,
             sections: list[str], plots: list[str]) -> dict[str, Any]:
    """The run as the JSON document above."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("kvstore")
    except PackageNotFoundError:  # run from a checkout that was never installed
        mine = "unknown"
    return {"version": VERSION, "kvstore": mine, "daemon": daemon, "quick": quick,
            "repeat": repeat, "sections": sections,
            "rows": [row.to_json() for row in results.rows], "sweeps": results.sweeps,
            "skipped": results.skipped, "against": results.against, "plots": plots}


def _goal(better: str, goal: float | None) -> str:
    if goal is None:
        return ""
    return f"{'<=' if better == 'lower' else '>='} {goal:g}"


def _num(value: float) -> str:
    return f"{value:10.3f}" if abs(value) < 10 else f"{value:10.1f}"


def table(results: Results) -> str:
    """Medians and ratios, a line per measurement, then the curves and what was skipped."""
    header = (f"{'section':8} {'measure':34} {'unit':>8} {'kvstore':>10} {'peer':>10}  "
              f"{'peer is':22} {'ratio':>6}  {'goal':8}")
    lines = [header, "-" * len(header)]
    for row in results.rows:
        lines.append(f"{row.section:8} {row.name:34} {row.unit:>8} {_num(row.kvstore)} "
                     f"{_num(row.peer)}  {row.peer_name:22} {row.ratio:6.2f}  "
                     f"{_goal(row.better, row.goal):8}")
    lines.append("ratio = kvstore / peer: at most the goal for latencies (us), at least "
                 "the goal for rates")
    curve = results.sweeps.get("lookup_latency")
    if curve:
        lines.append("lookup latency by chain length (us, kvstore/echo): " + ", ".join(
            f"{int(pt['keys'])}: {pt['kvstore_us']:.0f}/{pt['echo_us']:.0f}" for pt in curve))
    rates = results.sweeps.get("throughput")
    if rates:
        lines.append("lookups/s by clients (kvstore/echo): " + ", ".join(
            f"{int(pt['clients'])}: {pt['kvstore_rps']:.0f}/{pt['echo_rps']:.0f}"
            for pt in rates))
    hits = results.sweeps.get("hit_rate")
    if hits:
        lines.append("hit rate by capacity (kvstore/policy simulated/infinite): " + ", ".join(
            f"{pt['capacity_share']:.0%}: {pt['kvstore']:.3f}/{pt['policy_sim']:.3f}/"
            f"{pt['infinite']:.3f}" for pt in hits))
    for section, why in results.skipped.items():
        lines.append(f"{section}: not run ({why})")
    return "\n".join(lines)
