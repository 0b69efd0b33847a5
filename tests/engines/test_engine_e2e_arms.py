"""benchmarks/engine_e2e.py's LMCache arms in the vLLM test environment, which has no
LMCache: each says why it cannot run and how to build the environment where it can
(``setup_envs.sh vllm-lmcache``, opt-in), before any engine starts."""

from __future__ import annotations

from engine_envs import ROOT, run_in_env


def test_lmcache_arms_name_the_environment_they_need() -> None:
    proc = run_in_env("vllm", [str(ROOT / "benchmarks" / "engine_e2e.py"), "--arms",
                               "lmcache,lmcache-mp", "--workloads", "zero"], timeout=300)
    reasons = {line.split()[0]: line for line in proc.stdout.splitlines()
               if "cannot run here:" in line}
    assert set(reasons) == {"lmcache", "lmcache-mp"}, proc.stdout
    for line in reasons.values():
        assert "No module named 'lmcache'" in line, line
        assert "tests/engines/setup_envs.sh vllm-lmcache" in line, line
    assert " 1/1 " not in proc.stdout, proc.stdout   # no arm's engine was started
