"""kvstore: a tiered, identity-keyed, refcounted store for LLM KV-cache blocks."""

from kvstore.client import (
    AsyncClient,
    BatchResult,
    Client,
    CurveKeys,
    LookupResult,
    PlanItem,
    PrefetchResult,
)
from kvstore.identity import Identity

__all__ = ["AsyncClient", "BatchResult", "Client", "CurveKeys", "Identity", "LookupResult",
           "PlanItem", "PrefetchResult"]
__version__ = "0.1.0"
