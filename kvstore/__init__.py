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
from collections.abc import Sequence
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


class _Beside:
    """Finds ``kvstore.<sub>`` in the folder ``<sub>`` beside this ``kvstore/``, and
    its modules there only (one missing there is missing, not taken from an installed
    checkout's folder)."""

    subpackages = ("scheduler", "tiers", "kernels", "plugins")

    @classmethod
    def find_spec(cls, fullname: str, path: Sequence[str] | None = None,
                  target: object = None) -> ModuleSpec | None:
        parts = fullname.split(".")
        if len(parts) < 2 or parts[0] != "kvstore" or parts[1] not in cls.subpackages:
            return None
        where = [str(_ROOT)] if len(parts) == 2 else list(path or ())
        spec = PathFinder.find_spec(fullname, where)
        if spec is None and len(parts) > 2:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return spec


def _source_checkout() -> bool:
    """kvstore/ in kvstore's own source tree (its pyproject beside, the subpackages'
    folders beside, none inside), not an installed copy among an application's files."""
    project = _ROOT / "pyproject.toml"
    return (project.is_file() and (_ROOT / "scheduler" / "__init__.py").is_file()
            and not (_ROOT / "kvstore" / "scheduler").exists()
            and 'name = "kvstore"' in project.read_text(errors="replace"))


if _source_checkout():
    sys.meta_path[:] = [f for f in sys.meta_path  # (a reload's: one finder, not two)
                        if getattr(f, "__qualname__", None) != "_Beside"
                        or getattr(f, "__module__", None) != __name__]
    sys.meta_path.insert(0, _Beside)

# (first: a SIGHUP while the daemon imports and starts is then noted, not fatal)
from kvstore.start_signals import hold_if_daemon

hold_if_daemon()

from kvstore.aclient import AsyncClient
from kvstore.client import Client
from kvstore.client_core import BatchResult, LookupResult, PlanItem, PrefetchResult
from kvstore.client_wire import CurveKeys
from kvstore.identity import Identity

__all__ = ["AsyncClient", "BatchResult", "Client", "CurveKeys", "Identity", "LookupResult",
           "PlanItem", "PrefetchResult"]
__version__ = "0.1.0"
