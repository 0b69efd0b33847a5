"""Engine integrations: kvstore under vLLM, LMCache and SGLang.

Each module imports its engine at the top, so it is importable only where that engine
is installed; nothing in the rest of kvstore imports them.

- ``kvstore.integrations.vllm`` — ``KVStoreConnector``, a vLLM KV connector
  (``kv_connector="KVStoreConnector"``,
  ``kv_connector_module_path="kvstore.integrations.vllm"``).
- ``kvstore.integrations.lmcache`` — ``KVStoreL2Adapter``, an LMCache L2 adapter
  (``{"type": "plugin", "module_path": "kvstore.integrations.lmcache",
  "class_name": "KVStoreL2Adapter", "adapter_params": {...}}``).
- ``kvstore.integrations.sglang`` — ``KVStoreHiCacheStorage``, an SGLang HiCache
  storage backend (``--hicache-storage-backend dynamic`` with
  ``{"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
  "class_name": "KVStoreHiCacheStorage"}`` in the backend's extra config).

All three take the daemon's ``endpoint``, the ``tenant`` and the ``token`` from their
engine's configuration, falling back to ``KVSTORE_ENDPOINT``, ``KVSTORE_TENANT`` and
``KVSTORE_TOKEN``.
"""
