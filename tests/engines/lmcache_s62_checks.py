"""Run in the LMCache environment: kvstore's L2 adapter made as LMCache makes it from
its command line (``--l2-adapter`` JSON, LMCache's plugin factory), with adapter
parameters of the wrong type or range (argv[1] the daemon's endpoint, argv[2] the
tenant).  Prints, as JSON, what each start met: the error, or "started"."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

BAD = ({"tenant": 5}, {"tenant": ["a"]}, {"endpoint": 5}, {"token": ["x"]},
       {"model_revision": ["r"]}, {"timeout": float("nan")}, {"timeout": float("inf")},
       {"timeout": True}, {"timeout": 2.5})


def start(endpoint: str, tenant: str, params: dict[str, Any]) -> str:
    """What LMCache's start meets with these adapter parameters."""
    adapter = {"type": "plugin", "module_path": "kvstore.integrations.lmcache",
               "class_name": "KVStoreL2Adapter",
               "adapter_params": {"endpoint": endpoint, "tenant": tenant,
                                  "object_bytes": 4096, **params}}
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", json.dumps(adapter)])
    try:
        config = parse_args_to_l2_adapters_config(args).adapters[0]
        create_l2_adapter_from_registry(config).close()
    except Exception as exc:  # what LMCache's start would raise
        return f"{type(exc).__name__}: {exc}"
    return "started"


def main() -> None:
    endpoint, tenant = sys.argv[1], sys.argv[2]
    print(json.dumps({json.dumps(p): start(endpoint, tenant, p) for p in BAD}))


if __name__ == "__main__":
    main()
