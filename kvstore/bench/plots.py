"""PNG charts of a ``kvstore bench`` run (``--plot DIR``), drawn with matplotlib, an
optional extra (``pip install 'kvstore[plot]'``), imported only here.

- ``ratio_to_limit.png``: each measurement's share of its limit (1.0: as fast as the
  peer), bars grouped by plane, the goal marked;
- ``against_lmcache.png``: with ``--against lmcache``, how many times as fast as
  LMCache kvstore is at each measurement;
- ``lookup_latency.png``: lookup latency against chain length, beside the echo's;
- ``throughput.png``: lookups per second against concurrent clients, beside the echo's;
- ``hit_rate.png``: the replay's hit rate against capacity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.bench.harness import Results, Row

COLOURS = {"control": "#4c72b0", "arena": "#55a868", "frames": "#c44e52", "ssd": "#8172b2",
           "remote": "#ccb974", "replay": "#64b5cd", "lmcache": "#937860"}


def missing_library() -> str | None:
    """Why plotting cannot run here, or None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("matplotlib is not installed; install the plot extra: "
                "pip install 'kvstore[plot]'")
    return None


def write_plots(results: Results, folder: Path) -> list[Path]:
    """Draw every chart the run has figures for into ``folder``; the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, draw in (("ratio_to_limit", _ratios), ("against_lmcache", _lmcache),
                       ("lookup_latency", _latency), ("throughput", _throughput),
                       ("hit_rate", _hit_rate)):
        fig = draw(plt, results)
        if fig is None:
            continue
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _bars(plt: Any, rows: list[Row], title: str, xlabel: str, goals: bool) -> Any:
    """Horizontal bars of each row's share, top to bottom in the run's order."""
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.3))
    ys = list(range(len(rows)))[::-1]  # positions, not labels: two rows may share a name
    for y, r in zip(ys, rows):
        ax.barh(y, r.share, color=COLOURS.get(r.section, "#777777"))
        if goals and r.goal is not None:
            goal = 1 / r.goal if r.better == "lower" else r.goal
            ax.plot([goal, goal], [y - 0.4, y + 0.4], color="black", linewidth=1.5)
        ax.text(r.share, y, f" {r.share:.2f}", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{r.name} ({r.unit})" for r in rows], fontsize=9)
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    sections = list(dict.fromkeys(r.section for r in rows))
    if len(sections) > 1:
        handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS.get(s, "#777777"))
                   for s in sections]
        ax.legend(handles, sections, loc="lower right", fontsize=8)
    ax.set_xlim(0, max(1.2, max(r.share for r in rows) * 1.15))
    return fig


def _ratios(plt: Any, results: Results) -> Any:
    rows = [r for r in results.rows if r.section != "lmcache" and r.share == r.share]
    if not rows:
        return None
    return _bars(plt, rows, "kvstore against the limits of each plane",
                 "share of the limit (1.0 = the peer; black tick = the goal)", goals=True)


def _lmcache(plt: Any, results: Results) -> Any:
    rows = [r for r in results.rows if r.section == "lmcache" and r.share == r.share]
    if not rows:
        return None
    return _bars(plt, rows, f"kvstore against {rows[0].peer_name}",
                 "times as fast as LMCache (1.0 = as fast)", goals=False)


def _latency(plt: Any, results: Results) -> Any:
    curve = results.sweeps.get("lookup_latency")
    if not curve:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    keys = [pt["keys"] for pt in curve]
    ax.plot(keys, [pt["kvstore_us"] for pt in curve], "o-", label="kvstore lookup")
    ax.plot(keys, [pt["echo_us"] for pt in curve], "s--", label="pyzmq echo, same bytes")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("keys in the chain")
    ax.set_ylabel("round trip (µs, median)")
    ax.set_title("lookup latency against chain length")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return fig


def _throughput(plt: Any, results: Results) -> Any:
    rates = results.sweeps.get("throughput")
    if not rates:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    clients = [pt["clients"] for pt in rates]
    ax.plot(clients, [pt["kvstore_rps"] for pt in rates], "o-", label="kvstore lookups")
    ax.plot(clients, [pt["echo_rps"] for pt in rates], "s--", label="pyzmq echo")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients (one request in flight each)")
    ax.set_ylabel("requests per second")
    ax.set_title("throughput against clients")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return fig


def _hit_rate(plt: Any, results: Results) -> Any:
    hits = results.sweeps.get("hit_rate")
    if not hits:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    shares = [100 * pt["capacity_share"] for pt in hits]
    ax.plot(shares, [pt["kvstore"] for pt in hits], "o-", label="kvstore daemon")
    ax.plot(shares, [pt["policy_sim"] for pt in hits], "s--", label="same policy, simulated")
    ax.plot(shares, [pt["infinite"] for pt in hits], ":", color="grey",
            label="infinite cache")
    ax.set_xlabel("capacity (% of the trace's unique blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("hit rate against capacity (trace replay)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    return fig
