"""kvstore.scheduler: pure decisions for the daemon (no sockets, files or event loop).

- ``eviction``: the order in which unpinned blocks go (LRU, S3-FIFO, ARC, SLRU, and
  ``auto``, the default: a duel of them; soft pins).
- ``policy``: the interface every eviction order implements.
- ``density``: hit density (after LHD): victims by the hits per space-time a block's
  class and age are expected to earn, learned online with ghost history.
- ``dueling``: several orders over the same blocks, victims by the one whose miniature
  cache hits most lately.
- ``admission``: block counts for a token plan; the policy chain under pressure.
- ``queues``: transfer classes, per-tenant fair queuing, bounded concurrency.
"""
