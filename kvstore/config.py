"""Configuration: a TOML file, environment overrides, command-line flags, defaults.

Precedence, lowest first: embedded defaults, the TOML file, ``KVSTORE_<SECTION>_<FIELD>``
environment variables (and ``KVSTORE_ENDPOINT``), command-line flags.  Every field is
validated; an error names the field and what is allowed.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from kvstore.arena_budget import budget_slab_bytes
from kvstore.errors import ConfigError
from kvstore.config_paths import check_ipc_path, resolve_relative
from kvstore.files import check_own_directory, check_socket_directory, read_regular_file
from kvstore.scheduler.admission import SEEN_MOST
from kvstore.sizes import format_size as format_size
from kvstore.sizes import parse_size as parse_size
from kvstore.sizes import parse_size_or_share

log = logging.getLogger("kvstore.config")

def runtime_dir() -> Path:
    """Where the socket lives: $XDG_RUNTIME_DIR/kvstore, else /tmp/kvstore-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "kvstore"
    return Path("/tmp") / f"kvstore-{os.getuid()}"


def default_endpoint() -> str:
    return f"ipc://{runtime_dir() / 'kvstore.sock'}"


def endpoint_from_env() -> str:
    """The endpoint clients use unless told otherwise."""
    return os.environ.get("KVSTORE_ENDPOINT") or default_endpoint()


def client_endpoint(endpoint: str | None) -> str:
    """The endpoint a client connects to: ``endpoint``, else ``endpoint_from_env``.  The
    default's directory (``runtime_dir``: this user's, by its uid) is checked as the
    daemon checks where it binds (``check_socket_directory``): a user who made
    /tmp/kvstore-<uid> first, and bound a socket there, would read this client's hello
    and token."""
    if endpoint:
        return endpoint
    if not os.environ.get("KVSTORE_ENDPOINT") and os.path.lexists(own := runtime_dir()):
        check_socket_directory(own)
    return endpoint_from_env()


SECTIONS = ("server", "dram", "ssd", "remote", "auth", "gpu", "events")
_INT_MOST = 2**31 - 1  # the most any count may be (ZeroMQ's options are C ints)
# the shortest lease taken: a client renews it with every request, within a few ms
MIN_LEASE_SECONDS = 0.1

# The settings a SIGHUP changes in a running daemon (section, field); any other change
# needs a restart.  The reload's merge and its list of what needs a restart both come
# from this one table.
LIVE_SETTINGS: tuple[tuple[str, str], ...] = (
    ("server", "lease_seconds"),
    ("server", "max_keys_per_request"),
    ("server", "max_reservations_per_session"),
    ("server", "max_pins_per_session"),
    ("server", "log_level"),
    ("server", "log_format"),
    ("server", "debug_invariants"),
    ("server", "max_requests_per_second"),
    ("server", "max_reservations_per_tenant"),
    ("server", "max_pins_per_tenant"),
    ("server", "max_namespaces_per_session"),
    ("server", "max_namespaces_per_tenant"),
    ("server", "max_sessions_per_tenant"),
    ("server", "max_requests_per_second_per_tenant"),
    ("server", "stop_seconds"),
    ("server", "max_bytes_in_flight"),
    ("server", "max_bytes_in_flight_per_tenant"),
    ("server", "max_bytes_in_flight_total"),
    ("auth", "grantee_pin_share"),
    ("auth", "grantee_pin_total"),
    ("ssd", "admit_after"),
    ("dram", "eviction_policy"),
)


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    endpoint: str = ""
    extra_endpoints: list[str] = []
    lease_seconds: float = 30.0
    max_keys_per_request: int = 4096
    max_request_bytes: str | int = "256MiB"
    max_reservations_per_session: int = 1024
    max_pins_per_session: int = 4096
    max_namespaces_per_session: int = 1024
    log_level: str = "info"
    debug_invariants: bool = False
    metrics_port: int = 0
    # the address the metrics port binds (an IPv6 one works too)
    metrics_addr: str = "127.0.0.1"
    # A file holding the bearer token every scrape must carry (Prometheus'
    # ``authorization: credentials_file``); others get 401.  Required with credentials
    # set (auth) and a metrics port: the metrics name every tenant and count its use.
    metrics_token_file: str = ""
    log_format: str = "text"
    max_requests_per_second: float = 0.0
    max_bytes_in_flight: str | int = "1GiB"
    # replies a connection may leave unread in the daemon's send queue; past it more are
    # dropped (counted), so a client that never reads costs bounded memory
    max_unread_replies: int = 1024
    # How long a connection's handshake (ZeroMQ's greeting and, on a gated endpoint, its
    # credentials) may take before it is closed: what a peer without credentials can hold
    # there (a frame read whole, up to max_request_bytes) is held at most this long.
    handshake_seconds: float = 5.0
    # How long a stop (SIGTERM, SIGINT) may take, from the signal, before the daemon
    # exits at once (a write stuck on a stalled disk never ends); 0: no limit.  Less than
    # the systemd unit's TimeoutStopSec (90), so the daemon says what it was doing.
    stop_seconds: float = 60.0
    max_reservations_per_tenant: int = 0
    max_pins_per_tenant: int = 0
    max_namespaces_per_tenant: int = 0
    # sessions a tenant holds at once (each ~1.6 KB till its lease ends, connected or
    # not: a hello flood's bound); 0: no limit
    max_sessions_per_tenant: int = 4096
    max_requests_per_second_per_tenant: float = 0.0
    # over a tenant's sessions, and over the daemon: bytes in requests under way (a get's
    # reply till sent, a deferred put) and big replies unread; a connection's bound
    # alone let a tenant's 4096 sessions hold that much each (0: no limit)
    max_bytes_in_flight_per_tenant: str | int = "2GiB"
    max_bytes_in_flight_total: str | int = "4GiB"
    max_transfers_in_flight: int = 8
    # requests that finish later and prefetches under way in tasks (``under_way``), over
    # every session and tenant, and the keys they name (about 55 bytes a key): bounded
    # per session and per tenant too, but many tenants together held unbounded tasks; a
    # tenant holds at most its share of them (by ``tenant_weights``: ``under_way``)
    max_requests_under_way: int = 16384
    max_keys_under_way: int = 1 << 22
    tenant_weights: dict[str, float] = {}
    socket_group: str = ""  # a group (name or gid) whose members may connect


class DramConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    capacity: str | int = "1GiB"
    slab_size: str | int = "64MiB"
    directory: str = "/dev/shm"
    eviction_policy: str = "auto"
    populate: bool = True
    # true, false, or auto: an arena per tenant whenever credentials are set ([auth])
    per_tenant_arenas: bool | str = "auto"
    max_arenas: int = 64
    pressure: list[str] = msgspec.field(
        default_factory=lambda: ["evict", "demote", "defer", "reject"])
    defer_seconds: float = 0.25
    tenant_quota: str | int = 0
    # memfd, file, or auto: memfd whenever credentials or server.socket_group are set
    arena_kind: str = "auto"
    shared_arena_with_credentials: bool = False


class SsdConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: str = ""
    capacity: str | int = "4GiB"
    slab_size: str | int = "256MiB"
    write_policy: str = "write-back"
    admit_after: int = 1
    sync: str = "batch"
    direct_io: bool = True
    preallocate: bool = False


class RemoteConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    url: str = ""
    backend: str = ""
    options: dict[str, Any] = {}
    timeout_s: float = 2.0
    concurrency: int = 4
    unhealthy_seconds: float = 5.0
    write_policy: str = "write-through"
    # how often the store's generation is checked (``StorageBackend.generation``): a
    # store found to have lost what it held has the daemon forget which blocks it holds
    check_seconds: float = 1.0
    # hex, at least 16 bytes, shared by the daemons of one remote store: values are
    # tagged with it, and only values tagged with it are taken ("" : unkeyed tags)
    tag_secret_file: str = ""
    # the store's size ("64GiB"; 0: not known), which a tenant's share below is of
    capacity: str | int = 0
    # The most this daemon keeps in the store for any one tenant: a size ("8GiB"), a
    # share of ``capacity`` ("50%"), or 0 for no bound.  Past it the tenant's own oldest
    # values there are deleted first (``kvstore.remote_shares``).  A share of a capacity
    # not known bounds nothing.
    max_bytes_per_tenant: str | int = "50%"


class GpuConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    device: str = ""
    capacity: str | int = "1GiB"
    slab_size: str | int = "64MiB"


class AuthConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    secret_file: str = ""
    curve_secret_key_file: str = ""
    curve_clients_dir: str = ""
    shared_tenants: dict[str, list[str]] = {}
    # grants to write as well (reserve, put, evict, drop): a shared_tenants grant alone
    # is to read (lookup, acquire, get, prefetch); a writer may read too
    shared_writers: dict[str, list[str]] = {}
    # tenants that see the whole daemon's figures in stats (its tiers' counters, queues,
    # I/O): with credentials set, any other sees only its own tenants' (the daemon-wide
    # counters move with every tenant's requests)
    operators: list[str] = []
    peer_tenants: dict[str, str] = {}  # user name or uid -> tenant, by SO_PEERCRED
    # The most a grantee tenant (shared_tenants, shared_writers) may keep pinned of an
    # owner's namespaces (acquire and lookup_pin pins, get replies not yet sent), with
    # the prefixes those pins keep in place (eviction is leaf first), as a fraction of
    # the owner's DRAM (its arena, or its dram.tenant_quota of a shared one), over all
    # the grantee's sessions: pinned blocks cannot be evicted, so without it one
    # grantee could pin the owner's arena full.  0: grantees pin nothing, so they may
    # look up but not read (every read pins, a get until its reply is sent); 1: no
    # bound beyond the arena.  A quarter leaves the owner three quarters against any
    # one grantee, and still holds a shared system prompt many times over.
    grantee_pin_share: float = 0.25
    # The same over all of an owner's grantees together, their distinct blocks (a
    # prompt eight grantees pin counts once): else four grantees at a quarter each pin
    # the owner's arena full.  Half leaves the owner half against all of them.
    grantee_pin_total: float = 0.5


class EventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The KV event stream for routers (vLLM's format; off while ``endpoint`` is empty),
    and what a routing query reports of this daemon."""

    endpoint: str = ""          # PUB socket, e.g. tcp://*:5557 (bound)
    replay_endpoint: str = ""   # ROUTER answering "resend from sequence N" ("": none)
    topic: str = ""             # llm-d expects kv@<pod>@<model>
    # The tenants whose credentials may read the stream and ask replays (routers), when
    # the daemon takes credentials ([auth]): the stream carries every tenant's keys and
    # token ids.  On tcp they present a CurveZMQ key or a token; on ipc a ticket of the
    # side socket beside the daemon's ipc endpoint (``kvstore.client_wire.event_socket``)
    readers: list[str] = []
    encoding: str = "map"       # "map": events tagged by a "type" key; "array": positional
    buffer_steps: int = 10000   # batches kept for replay
    buffer_bytes: str | int = "256MiB"  # ... and at most this many bytes of them
    queue_batches: int = 10000  # batches queued per subscriber before drops
    # ... and about this many bytes of them: the queue's length in batches follows the
    # largest batch of the last ``queue_batches`` (ZeroMQ counts batches, not bytes: a
    # subscriber that never read held ``queue_batches`` of any size in the daemon)
    queue_bytes: str | int = "64MiB"
    group_idx: int = -1         # the KV cache group events name (-1: left out)
    data_parallel_rank: int = -1  # stamped on every batch (-1: left out)
    # How long a change waits for others to go out in the same batch (milliseconds), so
    # a busy daemon sends fewer, larger batches (0: a batch at the end of the loop turn).
    interval_ms: float = 2.0
    # A batch goes out with the first commit at least its wait (``interval_ms``, longer
    # under load) after its first change (a busy daemon: no wake of its own for it); a
    # daemon that commits nothing more sends it this long after its first change, or
    # twice the batch's wait if longer (milliseconds, at least interval_ms).  No batch
    # waits longer than max(quiet_ms, 2 * busy_interval_ms) after its first change.
    quiet_ms: float = 50.0
    # Under load, fewer and larger batches still: each batch that goes out with a commit
    # (commits keep coming) doubles the next one's wait, up to this (milliseconds, at least
    # interval_ms); a batch the quiet timer sends halves it, down to interval_ms, and a
    # batch begun after more than quiet_ms without one waits interval_ms again.  (A
    # batch costs the daemon about what a request does, however few its events.)
    busy_interval_ms: float = 50.0
    # Load bandwidth per tier (bytes a second) a routing query assumes until the daemon
    # has measured its own.
    dram_bandwidth: str | int = "20GB"
    ssd_bandwidth: str | int = "2GB"
    remote_bandwidth: str | int = "1GB"

    def validate(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("ipc://", "tcp://", "inproc://")):
                raise ConfigError(f"events.{name}: {value!r} must start with ipc://, tcp:// "
                                  f"or inproc://")
            check_ipc_path(f"events.{name}", value)
        if self.replay_endpoint and not self.endpoint:
            raise ConfigError("events.replay_endpoint: replays need events.endpoint set")
        if self.encoding not in ("map", "array"):
            raise ConfigError("events.encoding: expected 'map' (events tagged by a type "
                              "key) or 'array' (positional)")
        for name in ("buffer_steps", "queue_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"events.{name}: must be at least 1")
        for name in ("group_idx", "data_parallel_rank"):
            if getattr(self, name) < -1:
                raise ConfigError(f"events.{name}: -1 (left out) or a non-negative integer")
        if not 0 <= self.interval_ms <= 1000:
            raise ConfigError("events.interval_ms: from 0 (a batch every loop turn) to 1000")
        if not 0 <= self.quiet_ms <= 1000:
            raise ConfigError("events.quiet_ms: from 0 (interval_ms) to 1000")
        if not 0 <= self.busy_interval_ms <= 1000:
            raise ConfigError("events.busy_interval_ms: from 0 (interval_ms) to 1000")
        for name in ("dram_bandwidth", "ssd_bandwidth", "remote_bandwidth", "buffer_bytes",
                     "queue_bytes"):
            if parse_size(getattr(self, name), f"events.{name}") <= 0:
                raise ConfigError(f"events.{name}: must be a positive number of bytes")


def data_dir() -> Path:
    """$XDG_DATA_HOME/kvstore, else ~/.local/share/kvstore."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"),
                                                           ".local", "share")
    return Path(base) / "kvstore"


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    dram: DramConfig = msgspec.field(default_factory=DramConfig)
    ssd: SsdConfig = msgspec.field(default_factory=SsdConfig)
    remote: RemoteConfig = msgspec.field(default_factory=RemoteConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    gpu: GpuConfig = msgspec.field(default_factory=GpuConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)

    # -- derived, validated values ------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self.server.endpoint or default_endpoint()

    @property
    def dram_capacity(self) -> int:
        return parse_size(self.dram.capacity, "dram.capacity")

    @property
    def dram_slab_bytes(self) -> int:
        """The DRAM slab size (with per-tenant arenas, cut for their one budget)."""
        slab = parse_size(self.dram.slab_size, "dram.slab_size")
        return budget_slab_bytes(slab, self.dram_capacity) if self.tenant_arenas else slab

    @property
    def ssd_path(self) -> Path:
        # "~/..." as the README's example has it (a literal "~" directory in the cwd before)
        return Path(self.ssd.path).expanduser() if self.ssd.path else data_dir() / "ssd"

    @property
    def ssd_slab_bytes(self) -> int:
        """The slab size, shrunk to the capacity when that is smaller (4 KiB multiples)."""
        slab = parse_size(self.ssd.slab_size, "ssd.slab_size")
        capacity = parse_size(self.ssd.capacity, "ssd.capacity")
        return max(4096, min(slab, capacity) // 4096 * 4096)

    @property
    def ssd_capacity(self) -> int:
        """Whole slabs only; 0 turns the SSD tier off."""
        capacity = parse_size(self.ssd.capacity, "ssd.capacity")
        return capacity // self.ssd_slab_bytes * self.ssd_slab_bytes if capacity else 0

    @property
    def tenant_quota(self) -> int:
        """Most bytes of a shared DRAM tier one tenant may hold (0: no quota)."""
        return parse_size(self.dram.tenant_quota, "dram.tenant_quota")

    @property
    def remote_capacity(self) -> int:
        return parse_size(self.remote.capacity, "remote.capacity")

    @property
    def remote_tenant_bytes(self) -> int:
        """The bound on each tenant's bytes in the remote store (0: none)."""
        return parse_size_or_share(self.remote.max_bytes_per_tenant, self.remote_capacity,
                                   "remote.max_bytes_per_tenant", "remote.capacity")

    @property
    def gpu_capacity(self) -> int:
        return parse_size(self.gpu.capacity, "gpu.capacity")

    @property
    def gpu_slab_bytes(self) -> int:
        return parse_size(self.gpu.slab_size, "gpu.slab_size")

    def _validate_event_readers(self) -> None:
        """With credentials, the event stream is read by ``events.readers`` only, with
        credentials its endpoints can check."""
        ev, a = self.events, self.auth
        if not (ev.endpoint and self.credentials):
            return
        if not ev.readers:
            raise ConfigError(
                "events.readers: the event stream carries every tenant's keys and token "
                "ids, and credentials are set (auth); name the tenants whose credentials "
                "may read it (its routers'), e.g. readers = [\"router\"]")
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(ev, name)
            if endpoint.startswith("tcp://") and not (a.curve_secret_key_file
                                                      or a.secret_file):
                raise ConfigError(
                    f"events.{name}: a tcp stream needs credentials it can check "
                    f"(auth.secret_file or auth.curve_secret_key_file); with "
                    f"auth.peer_tenants alone, bind it on ipc://")
            if endpoint.startswith("ipc://") and not (a.secret_file or a.peer_tenants):
                raise ConfigError(
                    f"events.{name}: with CurveZMQ alone, bind the stream on tcp:// "
                    f"(served with CurveZMQ there)")
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"events.{name}: with credentials set, tcp:// or ipc://")

    def _validate_metrics_access(self) -> None:
        """With credentials, the metrics port (which names every tenant and counts its
        use) answers only scrapes with the bearer token, as the event stream answers
        only its readers: refused at start-up without one, never served open."""
        s = self.server
        if not s.metrics_addr.strip():
            raise ConfigError("server.metrics_addr: an address to bind the metrics port "
                              "on, e.g. \"127.0.0.1\" (the default) or \"::1\"")
        if s.metrics_port and self.credentials and not s.metrics_token_file:
            raise ConfigError(
                "server.metrics_token_file: the metrics port names every tenant and counts "
                "its use, and credentials are set (auth); give a file holding a token "
                "that scrapes must send as a bearer token (kvstore keygen --secret FILE "
                "writes one; Prometheus: authorization: credentials_file), or turn the "
                "port off (server.metrics_port = 0)")
        if s.metrics_port and not s.metrics_token_file and not _loopback(s.metrics_addr):
            # no credentials (one user's host): allowed, but the port is open to others
            log.warning("server.metrics_addr = %r is not a loopback address and there is "
                        "no server.metrics_token_file: anyone who can reach port %d reads "
                        "every tenant's metrics", s.metrics_addr, s.metrics_port)

    @property
    def credentials(self) -> bool:
        """Whether hello must prove a tenant (a token, a CurveZMQ key or the peer's uid)."""
        a = self.auth
        return bool(a.secret_file or a.curve_secret_key_file or a.peer_tenants)

    @property
    def named_tenants(self) -> set[str]:
        """The tenants this configuration names (weights, grants, peers, operators,
        the event stream's readers)."""
        a = self.auth
        names = {*self.server.tenant_weights, *a.operators, *a.peer_tenants.values(),
                 *self.events.readers}
        for grants in (a.shared_tenants, a.shared_writers):
            for owner, grantees in grants.items():
                names.add(owner)
                names.update(grantees)
        return names

    @property
    def tenant_arenas(self) -> bool:
        """Whether each tenant's blocks live in an arena of its own: when asked (true),
        and by default (auto) whenever credentials are set, unless a shared arena is
        explicitly allowed (``validate`` refuses false with credentials otherwise)."""
        asked = self.dram.per_tenant_arenas
        if isinstance(asked, bool):
            return asked
        return self.credentials and not self.dram.shared_arena_with_credentials

    @property
    def memfd_arenas(self) -> bool:
        """Whether arenas are anonymous memory files handed out by descriptor: when
        asked, and by default whenever credentials are set or engines of other users
        connect (``server.socket_group``: a file arena, 0600, is the daemon's user's)."""
        kind = self.dram.arena_kind
        return kind == "memfd" or (kind == "auto" and (self.credentials
                                                       or bool(self.server.socket_group)))

    def _validate_numbers(self) -> None:
        """Every count within a C int and every number finite, before the fields' own
        checks: a count of 2**64 passed them and crashed the daemon at start (a ZeroMQ
        option, an event's rank) or failed every hello (its reply could not be encoded),
        and NaN passed every check written as ``value < 0``."""
        for section in SECTIONS:
            values = getattr(self, section)
            for field, kind in type(values).__annotations__.items():
                value = getattr(values, field)
                if kind == "int" and not -_INT_MOST - 1 <= value <= _INT_MOST:
                    raise ConfigError(f"{section}.{field}: {value} is out of range (a count "
                                      f"of at most {_INT_MOST})")
                if kind == "float" and not math.isfinite(value):
                    raise ConfigError(f"{section}.{field}: {value} is not a finite number")

    @property
    def max_request_bytes(self) -> int:
        return parse_size(self.server.max_request_bytes, "server.max_request_bytes")

    def validate(self) -> Config:
        self._validate_numbers()
        for endpoint in [self.endpoint, *self.server.extra_endpoints]:
            if not endpoint.startswith(("ipc://", "tcp://")):
                raise ConfigError(
                    f"server.endpoint: {endpoint!r} must start with ipc:// or tcp://")
            check_ipc_path("server.endpoint", endpoint)
        if not self.server.lease_seconds >= MIN_LEASE_SECONDS:
            # (a lease of 1e-9 was taken: every session ended at its next request, and
            # the reaper, due every quarter lease, ran on every turn of an idle loop)
            raise ConfigError(f"server.lease_seconds: {self.server.lease_seconds:g}; give "
                              f"at least {MIN_LEASE_SECONDS:g} seconds")
        if not 0.001 <= self.server.handshake_seconds <= 3600:
            raise ConfigError("server.handshake_seconds: from 0.001 to 3600 seconds")
        if not (self.server.stop_seconds == 0 or 1 <= self.server.stop_seconds <= 86400):
            raise ConfigError("server.stop_seconds: 0 (no limit), or from 1 to 86400 seconds")
        for name in ("max_keys_per_request", "max_reservations_per_session",
                     "max_pins_per_session", "max_namespaces_per_session",
                     "max_unread_replies", "max_requests_under_way",
                     "max_keys_under_way"):
            if getattr(self.server, name) <= 0:
                raise ConfigError(f"server.{name}: must be a positive integer")
        if self.server.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(
                "server.log_level: expected one of debug, info, warning, error")
        if self.server.max_requests_per_second < 0:
            raise ConfigError("server.max_requests_per_second: 0 (no limit) or more")
        parse_size(self.server.max_bytes_in_flight, "server.max_bytes_in_flight")
        parse_size(self.server.max_bytes_in_flight_per_tenant,
                   "server.max_bytes_in_flight_per_tenant")
        parse_size(self.server.max_bytes_in_flight_total, "server.max_bytes_in_flight_total")
        tenant_rate = self.server.max_requests_per_second_per_tenant
        if tenant_rate != 0 and not tenant_rate >= 1:
            # its bucket holds one second's worth: below one request it never admits a
            # hello, shutting the tenant out
            raise ConfigError("server.max_requests_per_second_per_tenant: 0 (no limit) "
                              "or at least 1")
        for name in ("max_reservations_per_tenant", "max_pins_per_tenant",
                     "max_namespaces_per_tenant", "max_sessions_per_tenant"):
            if getattr(self.server, name) < 0:
                raise ConfigError(f"server.{name}: 0 (no limit) or a positive integer")
        if self.server.max_transfers_in_flight < 1:
            raise ConfigError("server.max_transfers_in_flight: must be at least 1")
        for tenant, weight in self.server.tenant_weights.items():
            if not weight > 0:
                raise ConfigError(
                    f"server.tenant_weights: {tenant!r} has weight {weight}; must be positive")
        if self.tenant_quota > self.dram_capacity:
            raise ConfigError("dram.tenant_quota: 0 (none), or at most the dram capacity")
        if self.server.log_format not in ("text", "json"):
            raise ConfigError("server.log_format: expected 'text' or 'json'")
        if not 0 <= self.server.metrics_port <= 65535:
            raise ConfigError("server.metrics_port: expected 0 (off) to 65535")
        self._validate_metrics_access()
        if self.max_request_bytes < 1 << 20:
            raise ConfigError("server.max_request_bytes: must be at least 1MiB")
        if self.dram_capacity < 1 << 20:
            raise ConfigError("dram.capacity: must be at least 1MiB")
        if self.dram_slab_bytes < 1 << 16:
            raise ConfigError("dram.slab_size: must be at least 64KiB")
        steps = self.dram.pressure
        if (not steps or steps[-1] != "reject" or len(set(steps)) != len(steps)
                or not set(steps) <= {"evict", "demote", "defer", "reject"}):
            raise ConfigError(
                "dram.pressure: an ordered list of distinct steps from evict, demote, defer, "
                "ending with reject")
        if self.dram.defer_seconds <= 0:
            raise ConfigError("dram.defer_seconds: must be a positive number of seconds")
        if self.dram.max_arenas < 1:
            raise ConfigError("dram.max_arenas: must be at least 1")
        if not os.path.isdir(self.dram.directory):
            raise ConfigError(f"dram.directory: {self.dram.directory!r} is not a directory")
        if not self.memfd_arenas:  # clients map the arena files there by their path
            check_own_directory(self.dram.directory, "where dram.directory keeps the arena "
                                "files clients map", "could put a file of its own in an "
                                "arena's place; use a directory of the daemon's user (or "
                                "make it sticky, chmod +t, as /dev/shm is)")
        if self.ssd_capacity:
            if self.ssd_capacity < 1 << 20:
                raise ConfigError("ssd.capacity: must be 0 (off) or at least 1MiB")
            if parse_size(self.ssd.slab_size, "ssd.slab_size") % 4096:
                raise ConfigError("ssd.slab_size: must be a multiple of 4KiB")
        if self.ssd.write_policy not in ("write-back", "write-through"):
            raise ConfigError("ssd.write_policy: expected 'write-back' or 'write-through'")
        if not 1 <= self.ssd.admit_after <= SEEN_MOST:
            raise ConfigError(f"ssd.admit_after: must be in [1, {SEEN_MOST}] (a block's "
                              f"count of commits and hits stops at {SEEN_MOST})")
        if self.ssd.sync not in ("always", "batch", "none"):
            raise ConfigError("ssd.sync: expected one of always, batch, none")
        self._validate_event_readers()
        if not 0.0 <= self.auth.grantee_pin_total <= 1.0:
            raise ConfigError("auth.grantee_pin_total: a fraction of the owner's DRAM from "
                              "0 to 1")
        if not 0.0 <= self.auth.grantee_pin_share <= 1.0:
            raise ConfigError("auth.grantee_pin_share: a fraction of the owner's DRAM from "
                              "0 (grantees pin nothing: lookups only) to 1 (no bound beyond the arena)")
        if self.auth.curve_secret_key_file and not any(
                e.startswith("tcp://") for e in [self.endpoint, *self.server.extra_endpoints]):
            raise ConfigError("auth.curve_secret_key_file: CurveZMQ secures tcp:// endpoints, "
                              "and none is configured")
        device = self.gpu.device
        if device not in ("", "cpu") and not device.isdigit():
            raise ConfigError(f"gpu.device: {device!r}; expected empty (no GPU tier), a CUDA "
                              f"device index such as 0, or cpu (a host-memory pool)")
        if self.dram.per_tenant_arenas not in (True, False, "auto"):
            raise ConfigError(f"dram.per_tenant_arenas: {self.dram.per_tenant_arenas!r}; "
                              f"expected true, false or \"auto\"")
        if (self.dram.per_tenant_arenas is False and self.credentials
                and not self.dram.shared_arena_with_credentials):
            raise ConfigError("dram.per_tenant_arenas = false would keep every tenant's "
                              "blocks in one arena that any client may read, and "
                              "credentials are set (auth); leave it unset (auto: an arena "
                              "per tenant), or set dram.shared_arena_with_credentials = true "
                              "to allow the shared arena")
        if device and self.dram.per_tenant_arenas is True:
            raise ConfigError("gpu.device: the GPU tier's one pool would be shared by every "
                              "tenant, and dram.per_tenant_arenas keeps tenants apart; use "
                              "one or the other")
        if device and self.tenant_arenas:
            raise ConfigError("gpu.device: the GPU tier's one pool and the DRAM arena are "
                              "shared by every tenant, and credentials are set (auth), which "
                              "keep each tenant in an arena of its own; set "
                              "dram.shared_arena_with_credentials = true to allow the shared "
                              "arena")
        if self.dram.arena_kind not in ("auto", "memfd", "file"):
            raise ConfigError(f"dram.arena_kind: {self.dram.arena_kind!r}; expected auto, "
                              f"memfd or file")
        if device:
            if self.gpu_capacity < 1 << 20 or self.gpu_slab_bytes < 1 << 16:
                raise ConfigError("gpu.capacity: at least 1MiB, in slabs of at least 64KiB")
        if self.remote.write_policy not in ("write-back", "write-through"):
            raise ConfigError("remote.write_policy: expected 'write-back' or 'write-through'")
        if self.remote.url and self.remote.backend:
            raise ConfigError("remote: give either url or backend, not both")
        if not self.remote.timeout_s > 0:
            raise ConfigError("remote.timeout_s: must be a positive number of seconds")
        if self.remote.concurrency < 1:
            raise ConfigError("remote.concurrency: must be at least 1")
        if self.remote.unhealthy_seconds < 0:
            raise ConfigError("remote.unhealthy_seconds: cannot be negative")
        if not 0.1 <= self.remote.check_seconds <= 3600:
            raise ConfigError("remote.check_seconds: from 0.1 to 3600 seconds")
        self.remote_tenant_bytes  # (a size, or a share of remote.capacity, both checked)
        if self.remote.write_policy == "write-back" and self.remote.options.get("ttl_s"):
            # DRAM drops a block the store holds without writing it back; one the store
            # expired meanwhile (read or written there a ttl ago, hot here since) was lost
            raise ConfigError("remote.options.ttl_s: values that expire lose blocks under "
                              "write-back (a block read from the store and kept here past "
                              "the ttl is dropped as if the store held it); leave ttl_s "
                              "out, or use write-through")
        from kvstore.scheduler.eviction import POLICIES

        if self.dram.eviction_policy not in POLICIES:
            raise ConfigError(
                f"dram.eviction_policy: {self.dram.eviction_policy!r}; expected one of "
                f"{sorted(POLICIES)}")
        self.events.validate()
        return self


def _set_path(data: dict[str, Any], section: str, field: str, value: Any) -> None:
    data.setdefault(section, {})[field] = value


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``KVSTORE_<SECTION>_<FIELD>=value`` for every known field, plus KVSTORE_ENDPOINT."""
    data: dict[str, Any] = {}
    defaults = Config()
    for section in SECTIONS:
        struct = type(getattr(defaults, section))
        prefix = f"KVSTORE_{section.upper()}_"
        fields = {prefix + field.upper(): field for field in struct.__struct_fields__}
        for name, raw in env.items():
            field = fields.get(name)
            if field is not None:
                _set_path(data, section, field, _coerce(raw, struct, field, section))
            elif name.startswith(prefix):  # a misspelt one was ignored without a word
                raise ConfigError(f"{name}: [{section}] has no such field")
    if env.get("KVSTORE_ENDPOINT") and "endpoint" not in data.get("server", {}):
        _set_path(data, "server", "endpoint", env["KVSTORE_ENDPOINT"])
    return data


def _coerce(raw: str, struct: Any, field: str, section: str) -> Any:
    default = getattr(struct(), field)
    try:
        if isinstance(default, str) and "bool" in str(struct.__annotations__.get(field)):
            words = {"1": True, "true": True, "yes": True, "on": True,
                     "0": False, "false": False, "no": False, "off": False}
            return words.get(raw.lower(), raw)  # a word such as "auto" as it is
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            try:
                return int(raw)
            except ValueError:
                if "str" in str(struct.__annotations__.get(field, "")):
                    return raw  # a size such as "16MiB"
                raise
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, list):
            return [part for part in raw.split(",") if part]
        if isinstance(default, dict):  # JSON, e.g. {"acme": 2.0}
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(raw)
            return value
    except ValueError:
        raise ConfigError(
            f"{section}.{field}: environment value {raw!r} is not a valid "
            f"{type(default).__name__}") from None
    return raw


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    reload: bool = False,
) -> Config:
    """Defaults, then the file, then the environment, then ``overrides`` (flags);
    ConfigError says why a file is unusable (and a reload on SIGHUP keeps the old).
    A pipe (``--config <(...)``, ``/dev/stdin``) is read at start-up, not on a
    ``reload``: read again, it would wait on the daemon's loop for a writer."""
    data: dict[str, Any] = {}
    if path is not None:
        raw, _ = read_regular_file(path, "config file", 1 << 20,  # (a real one: KiBs)
                                   streams=not reload)
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        except RecursionError:  # (arrays nested thousands deep: a traceback, on a SIGHUP)
            raise ConfigError(f"config file {str(path)!r} nests its values too deeply "
                              "to be a configuration") from None
        resolve_relative(data, path)  # (against its directory; not the env's, flags')
    try:
        data = _merge(data, _env_overrides(os.environ if env is None else env))
        if overrides:
            data = _merge(data, overrides)
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {_field_message(exc)}") from None
    except RecursionError:
        raise ConfigError("invalid configuration: its values nest too deeply") from None
    return config.validate()


def _field_message(exc: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.dram.capacity`"; lead with the field name.
    text = str(exc)
    match = re.search(r"at `\$\.?([^`]*)`", text)
    if match:
        return f"{match.group(1)}: {text.split(' - at ')[0]}"
    return text


def merge_live(old: Config, new: Config) -> Config:
    """The running configuration ``old`` with only its live settings taken from ``new``."""
    sections: dict[str, Any] = {}
    for section, field in LIVE_SETTINGS:
        changes = sections.setdefault(section, {})
        changes[field] = getattr(getattr(new, section), field)
    return msgspec.structs.replace(old, **{
        section: msgspec.structs.replace(getattr(old, section), **changes)
        for section, changes in sections.items()})


def restart_needed(old: Config, new: Config) -> list[str]:
    """The settings (``section.field``) that differ and are not live: they need a restart."""
    live = set(LIVE_SETTINGS)
    restart = []
    for section in SECTIONS:
        before = msgspec.structs.asdict(getattr(old, section))
        after = msgspec.structs.asdict(getattr(new, section))
        for field, value in after.items():
            if before[field] != value and (section, field) not in live:
                restart.append(f"{section}.{field}")
    return restart


def _loopback(addr: str) -> bool:
    """Whether ``addr`` (the metrics port's bind address) is reachable from this host
    only: a loopback address or ``localhost``."""
    addr = addr.strip().strip("[]")
    if addr.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False
