"""A benchmark's figures measured in fresh processes, alternated with another checkout's.

A script defines ``figures()`` (one round's figures, importing kvstore from the checkout
on ``sys.path``) and hands it to ``main``: each round runs the script again with
``--one`` in a fresh process per checkout, the checkouts alternated so that a noisy
machine hits both alike, and the table gives each figure's median over the rounds and,
with ``--against``, this checkout's median over the other's (below 1: this one is
smaller).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable


def child(script: str, root: str) -> dict[str, float]:
    """A round of ``script`` in a fresh process importing the checkout at ``root``."""
    here = os.path.dirname(os.path.abspath(script))
    tests = os.path.join(os.path.dirname(here), "tests")  # (kvtest)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, tests])}
    done = subprocess.run([sys.executable, script, "--one"], env=env, cwd=root,
                          capture_output=True, text=True, check=True)
    figs: dict[str, float] = json.loads(done.stdout)
    return figs


def main(script: str, description: str, figures: Callable[[], dict[str, float]]) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--against", metavar="ROOT", help="another checkout, alternated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(figures()))
        return 0
    roots = {"this": os.path.dirname(os.path.dirname(os.path.abspath(script)))}
    if args.against:
        roots["other"] = os.path.abspath(args.against)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    for _ in range(args.rounds):
        for name, root in roots.items():
            runs[name].append(child(script, root))
    names = list(runs["this"][0])
    print(f"{'figure':30} " + " ".join(f"{n:>10}" for n in roots)
          + ("      ratio" if args.against else ""))
    for fig in names:
        meds = {n: statistics.median(r[fig] for r in runs[n]) for n in roots}
        line = f"{fig:30} " + " ".join(f"{meds[n]:10.3f}" for n in roots)
        if args.against:
            line += f" {meds['this'] / meds['other']:10.3f}"
        print(line)
    return 0
