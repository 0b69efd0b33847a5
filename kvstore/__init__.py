"""kvstore: a tiered, identity-keyed, refcounted store for LLM KV-cache blocks.

In a source checkout the subpackages ``kvstore.scheduler``, ``tiers``, ``kernels`` and
``plugins`` are folders beside ``kvstore/`` (pyproject's ``package-dir``); an editable
install maps them to its own checkout's.  A checkout run by path (``PYTHONPATH=ROOT``,
another version beside an installed one, as the benchmarks' ``--against`` do) takes
them from ``ROOT`` (``_Beside``): without it, its ``kvstore`` was its own and those four
the installed checkout's, and a comparison of two versions of the scheduler compared
one version with itself.
"""

import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


class _Beside:
    """Finds ``kvstore.<sub>`` in the folder ``<sub>`` beside this ``kvstore/``."""

    subpackages = ("scheduler", "tiers", "kernels", "plugins")

    @classmethod
    def find_spec(cls, fullname: str, path: object = None,
                  target: object = None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != "kvstore" or name not in cls.subpackages:
            return None
        return PathFinder.find_spec(fullname, [str(_ROOT)])


# a source checkout (its pyproject beside), not an installed copy among other packages
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "scheduler" / "__init__.py").is_file():
    sys.meta_path.insert(0, _Beside)

from kvstore.aclient import AsyncClient
from kvstore.client import Client
from kvstore.client_core import BatchResult, LookupResult, PlanItem, PrefetchResult
from kvstore.client_wire import CurveKeys
from kvstore.identity import Identity

__all__ = ["AsyncClient", "BatchResult", "Client", "CurveKeys", "Identity", "LookupResult",
           "PlanItem", "PrefetchResult"]
__version__ = "0.1.0"
