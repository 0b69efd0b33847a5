"""kvstore.scheduler: pure decisions for the daemon (no sockets, files or event loop).

- ``eviction``: the order in which unpinned blocks go (LRU, S3-FIFO, ARC; soft pins).
- ``admission``: block counts for a token plan; the policy chain under pressure.
- ``queues``: transfer classes, per-tenant fair queuing, bounded concurrency.
"""
