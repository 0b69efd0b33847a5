"""kvstore's LMCache L2 adapter, made by LMCache's plugin factory from its command line,
refuses adapter parameters of the wrong type or range, naming the parameter
(lmcache_s62_checks.py, in the LMCache environment, against a real daemon).

Before: a tenant of 5 failed at the first request with "bad request header: Expected
`str`, got `int`", an endpoint of 5 with an AttributeError, a timeout of NaN or
Infinity with float conversion errors (none naming the parameter); a timeout of true
was taken as one second, and a token or model revision given as a list as its str().
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from daemon_proc import DaemonProcess
from engine_envs import HERE, ROOT, last_json, run_in_env


def test_adapter_parameters_of_the_wrong_type_are_refused_by_name(
        daemon_factory: Callable[..., DaemonProcess]) -> None:
    daemon = daemon_factory()
    proc = run_in_env("lmcache", [str(HERE / "lmcache_s62_checks.py"), daemon.endpoint,
                                  f"lmcache-{uuid.uuid4().hex[:8]}"],
                      timeout=120, PYTHONPATH=str(ROOT))
    out = last_json(proc.stdout)
    for params, key in (('{"tenant": ["a"]}', "tenant"), ('{"endpoint": 5}', "endpoint"),
                        ('{"token": ["x"]}', "token"),
                        ('{"model_revision": ["r"]}', "model_revision"),
                        ('{"timeout": NaN}', "timeout"), ('{"timeout": Infinity}', "timeout"),
                        ('{"timeout": true}', "timeout")):
        assert out[params].startswith("ConfigError:") and f"'{key}'" in out[params], out
    # a whole number where a name goes is taken as its text, as the other engines' do
    assert out['{"tenant": 5}'] == "started", out
    assert out['{"timeout": 2.5}'] == "started", out
