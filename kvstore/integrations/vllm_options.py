"""The vLLM connector's ``kv_connector_extra_config``: the keys it reads, the checks of
their values made when the engine starts (a value it would misread is refused, naming
its key), and the switches it takes (``ConnectorOptions``).  No vLLM import: the checks
run, and are tested, without the engine."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.integrations.pipeline import LOAD_GBPS

logger = logging.getLogger(__name__)


def _auto_or_bool(name: str, value: Any) -> bool | None:
    """A ``kv_connector_extra_config`` switch that may also be ``"auto"`` (None)."""
    if isinstance(value, str) and value.lower() == "auto":
        return None
    try:
        return _switch(name, value)
    except ValueError:
        raise ValueError(
            f"KVStoreConnector: {name} is true, false or \"auto\", not {value!r}") from None


def _switch(name: str, value: Any) -> bool:
    """A ``kv_connector_extra_config`` switch: a JSON boolean, 0 or 1, or the text
    "true"/"false" (or "1"/"0", "yes"/"no", "on"/"off": a configuration templated as
    text, where ``bool("false")`` is True)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and (text := value.strip().lower()) in _SWITCH_TEXTS:
        return _SWITCH_TEXTS[text]
    raise ValueError(f"KVStoreConnector: {name} is true or false, not {value!r}")


_SWITCH_TEXTS = {"true": True, "1": True, "yes": True, "on": True,
                 "false": False, "0": False, "no": False, "off": False}

# kv_connector_extra_config's numbers: the least each takes, and whether that itself is
# taken (``check_values``)
_NUMBERS = {"timeout": (0.0, False), "max_pending_save_mib": (0.0, False),
            "prefill_tokens_per_s": (0.0, True), "rates_refresh_s": (0.0, True)}
_NAMES = ("tenant", "token", "model_revision")  # text, or a whole number (its text)


def check_values(extra: dict[str, Any]) -> None:
    """Refuse, naming the key, a ``kv_connector_extra_config`` value the connector would
    misread: before, a ``timeout`` of -1 was taken (a daemon that stopped answering
    hung the engine's step for good) and one of 0 made every call a miss; "10s" (or a
    ``max_pending_save_mib`` of "1GiB") raised float()'s bare error, which names no
    key; an ``endpoint`` that is not text crashed the connect thread, and the engine
    served on without a word.  A rate in ``load_gbps`` of "fast" or null raised
    float()'s bare error too, and one of NaN or ``true`` was taken; one for a tier the
    daemon has no such name for (``"DRAM"``, ``"cpu"``) was ignored without a word, the
    tier's default rate used instead (a tier meant to be declined was offered)."""
    for key, (least, least_taken) in _NUMBERS.items():
        if key in extra and not _number_from(extra[key], least, least_taken):
            bound = f">= {least:g}" if least_taken else f"> {least:g}"
            raise ConfigError(f"KVStoreConnector: kv_connector_extra_config key {key!r} "
                              f"is {extra[key]!r}: it takes a number {bound}")
    rates = extra.get("load_gbps", {})
    if "load_gbps" in extra and not (isinstance(rates, dict) and all(
            _number_from(value, 0.0, False) for value in rates.values())):
        raise ConfigError(f"KVStoreConnector: kv_connector_extra_config key 'load_gbps' "
                          f"is {rates!r}: it maps tiers to GB/s, each a number > 0")
    unknown = sorted(str(tier) for tier in rates if tier not in LOAD_GBPS)
    if unknown:
        raise ConfigError(f"KVStoreConnector: kv_connector_extra_config key 'load_gbps' "
                          f"names tiers {unknown} the daemon does not have: its tiers are "
                          f"{sorted(LOAD_GBPS)}")
    for key in ("endpoint", "model_name", *_NAMES):
        value = extra.get(key)
        if value is None or isinstance(value, str) or (
                key in _NAMES and isinstance(value, int) and not isinstance(value, bool)):
            continue
        kind = "text or a whole number" if key in _NAMES else "text"
        raise ConfigError(f"KVStoreConnector: kv_connector_extra_config key {key!r} is "
                          f"{value!r} ({type(value).__name__}): it takes {kind}")


def _number_from(value: Any, least: float, least_taken: bool) -> bool:
    """Whether ``value`` is a finite number (or its text) above ``least`` (or at it,
    where ``least_taken``); a JSON boolean is not one."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and (number > least or (number == least and least_taken))


EXTRA_KEYS = frozenset({  # every key the connector reads (ConnectorOptions' doc)
    "endpoint", "tenant", "token", "timeout", "model_name", "model_revision",
    "prefill_tokens_per_s", "load_gbps", "rates_refresh_s", "async_saves", "layerwise",
    "prefetch", "post_loads", "copy_ahead", "saves_after_step", "known_chains",
    "max_pending_save_mib"})


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's ``kv_connector_extra_config`` keys beside ``endpoint``,
    ``tenant``, ``token``, ``timeout`` (seconds per request, default 5), ``model_name``
    and ``model_revision`` (``DaemonSettings``, ``kv_groups``), ``prefill_tokens_per_s``
    and ``load_gbps`` (``LoadWorth``: blocks slower to load than to recompute are not
    offered; the daemon's measured rates replace ``load_gbps``, asked every
    ``rates_refresh_s`` seconds, default 10, 0: never):

    ``async_saves`` (default true), ``layerwise`` (true, false or ``"auto"``, the
    default: ``layerwise_fits``), ``prefetch`` (default true), ``post_loads``
    (default true: acquires sent in handle_preemptions),
    ``copy_ahead`` (default false; with ``post_loads``, host pages pinned and copied on a
    thread from then on: for hosts with a core to spare; on a loaded 2-core host it
    slowed loads, engine_e2e's kvstore-ahead arm), ``saves_after_step`` (default true:
    a step's saves start at the next step, not beside the end of the step that computed
    them, whose output they would delay; in a step that loads, once its blocks are
    copied: beside its forward, not its copy; ``SaveSender``),
    ``known_chains`` (default true: the keys of a prefix an earlier request hashed are
    taken over, found by vLLM's own sha256 block hashes; ``KnownChains``),
    ``max_pending_save_mib`` (bytes of pending saves, staged or still in vLLM's pages,
    before saves are dropped, default 1024).  A switch is a JSON boolean, 0 or 1, or
    the text "true" or "false"; anything else is refused (ValueError)."""

    async_saves: bool
    layerwise: bool | None  # None: "auto"
    prefetch: bool
    post_loads: bool
    copy_ahead: bool
    saves_after_step: bool
    known_chains: bool
    max_pending: int

    @staticmethod
    def check_keys(extra: dict[str, Any], scheduler: bool = True) -> list[str]:
        """The keys the connector does not know, with a warning naming them: a misspelled
        one was ignored without a word, its setting left at the default (a
        ``model_revison``: the checkpoint's own; a ``salt``, meant to keep one
        deployment's blocks apart: none).  Warned, not refused: a configuration shared
        with another connector's keys (or a later version's) still starts the engine.
        The scheduler's side (which offers loads) warns too of rates that judge nothing
        for want of ``prefill_tokens_per_s``."""
        unknown = sorted(set(extra) - EXTRA_KEYS)
        if unknown:
            logger.warning("KVStoreConnector: unknown kv_connector_extra_config keys %s are "
                           "ignored; it takes %s", unknown, sorted(EXTRA_KEYS))
        # Rates judge a load against its recompute only where the recompute has a rate:
        # without one every cached block is offered, whatever they say (a ``load_gbps``
        # meant to decline a slow tier's blocks was ignored without a word).
        idle = sorted({"load_gbps", "rates_refresh_s"} & set(extra))
        if scheduler and idle and not _number_from(extra.get("prefill_tokens_per_s", 0), 0.0,
                                                   False):
            logger.warning("KVStoreConnector: kv_connector_extra_config keys %s are ignored "
                           "without 'prefill_tokens_per_s' > 0 (every cached block is "
                           "offered)", idle)
        return unknown

    @classmethod
    def from_extra(cls, extra: dict[str, Any], kv_cache_config: Any) -> ConnectorOptions:
        # Loads copied ahead land before vLLM zeroes new blocks in _update_states: where
        # its cache needs that zeroing, they would be zeroed (and wrong KV served).
        zeroed = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
        def switch(name: str, default: bool) -> bool:
            return _switch(name, extra.get(name, default))

        return cls(async_saves=switch("async_saves", True),
                   layerwise=_auto_or_bool("layerwise", extra.get("layerwise", "auto")),
                   prefetch=switch("prefetch", True),
                   post_loads=switch("post_loads", True),
                   copy_ahead=switch("copy_ahead", False) and not zeroed,
                   saves_after_step=switch("saves_after_step", True),
                   known_chains=switch("known_chains", True),
                   max_pending=int(float(extra.get("max_pending_save_mib", 1024)) * (1 << 20)))
