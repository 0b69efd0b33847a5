"""kvstore: a tiered, identity-keyed, refcounted store for LLM KV-cache blocks."""

from kvstore.aclient import AsyncClient
from kvstore.client import Client
from kvstore.client_core import BatchResult, LookupResult, PlanItem, PrefetchResult
from kvstore.client_wire import CurveKeys
from kvstore.identity import Identity

__all__ = ["AsyncClient", "BatchResult", "Client", "CurveKeys", "Identity", "LookupResult",
           "PlanItem", "PrefetchResult"]
__version__ = "0.1.0"
