"""``kvstore bench``: the daemon measured side by side with the limits it is built on
(a bare pyzmq echo, memcpy, raw pyzmq frames, raw O_DIRECT, redis-py), and with LMCache.

``kvstore.bench.command`` is the command; ``kvstore.bench.report`` documents its JSON.
"""
