"""kvstore: a tiered, identity-keyed, refcounted store for LLM KV-cache blocks."""

from kvstore.client import AsyncClient, Client, LookupResult
from kvstore.identity import Identity

__all__ = ["AsyncClient", "Client", "Identity", "LookupResult"]
__version__ = "0.1.0"
