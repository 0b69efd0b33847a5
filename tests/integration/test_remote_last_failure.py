"""Why the remote tier is down, in stats and in ``kvstore stats``: a real daemon, a real
redis-server killed under it.  Before, stats said only ``healthy: false``; the reason
was in the daemon's log alone."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from kvtest import make_identity
from redis_servers import RedisServer

from kvstore import Client

IDENT = make_identity()


def test_stats_say_which_call_failed_and_how_long_ago(
        daemon_factory: Any, fresh_redis_server: RedisServer) -> None:
    redis = fresh_redis_server
    d = daemon_factory(extra=["--remote", redis.url, "--remote-write-policy", "write-through"],
                       env={"KVSTORE_REMOTE_TIMEOUT_S": "1",
                            "KVSTORE_REMOTE_UNHEALTHY_SECONDS": "600"})
    with Client(d.endpoint, tenant="acme") as c:
        ns = c.namespace(IDENT)
        keys = ns.keys(range(2 * IDENT.block_tokens))
        ns.put(keys, [bytes(IDENT.block_bytes)] * len(keys))
        deadline = time.monotonic() + 20
        while c.stats()["remote"]["writes"] < len(keys):
            assert time.monotonic() < deadline, c.stats()["remote"]
            time.sleep(0.05)
        assert c.stats()["remote"]["last_failure"] is None  # (none yet)
        redis.kill()
        more = ns.keys(range(100, 100 + 2 * IDENT.block_tokens))
        ns.put(more, [bytes(IDENT.block_bytes)] * len(more))  # its send fails
        deadline = time.monotonic() + 20
        while c.stats()["remote"]["healthy"]:
            assert time.monotonic() < deadline, "the outage was never noticed"
            time.sleep(0.05)
        failure = c.stats()["remote"]["last_failure"]
        assert failure is not None and failure["call"] and ":" in failure["error"], failure
        assert 0 <= failure["seconds_ago"] < 60 and failure["skipped_for_seconds"] > 500
        assert redis.url.split("//")[-1] not in str(failure)  # (no address: the log's)
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--endpoint", d.endpoint],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("remote "))
    assert "UNHEALTHY (" in line and failure["call"] in line, line
