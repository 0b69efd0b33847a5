"""The ``kvstore`` command: serve, ping, stats, config, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError, KVStoreError
from kvstore.identity import tenant_problem

if TYPE_CHECKING:
    from kvstore.config import Config
    from kvstore.identity import Identity

# the longest a token may be good for: a token cannot be revoked short of changing the
# daemon's secret (and with it every tenant's tokens)
MAX_TOKEN_TTL = 366 * 86400.0
# ZeroMQ's PLAIN handshake carries a token's tenant as the user name, of 255 bytes at most
_MAX_PLAIN_USER_BYTES = 255


def _number(what: str, *, zero: bool = False,
            most: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number above 0 (or 0 too, where ``zero``) and at most
    ``most``.  A timeout of nan failed deep in the client and a negative one waited for
    ever; a token's ttl of nan or inf was a traceback, a negative one an expired token."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {what}") from None
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)
                and value <= most):
            low = "0 or more" if zero else "more than 0"
            high = f", at most {most:.0f}" if math.isfinite(most) else ""
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of {what}, "
                                             f"{low}{high}")
        return value
    return parse


_SECONDS = _number("seconds")


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    over: dict[str, Any] = {}
    if args.endpoint:
        over.setdefault("server", {})["endpoint"] = args.endpoint
    if args.extra_endpoint:
        over.setdefault("server", {})["extra_endpoints"] = args.extra_endpoint
    if args.lease is not None:
        over.setdefault("server", {})["lease_seconds"] = args.lease
    if args.log_level:
        over.setdefault("server", {})["log_level"] = args.log_level
    if args.log_format:
        over.setdefault("server", {})["log_format"] = args.log_format
    if args.ssd_path:
        over.setdefault("ssd", {})["path"] = args.ssd_path
    if args.ssd_capacity is not None:
        over.setdefault("ssd", {})["capacity"] = args.ssd_capacity
    if args.ssd_write_policy:
        over.setdefault("ssd", {})["write_policy"] = args.ssd_write_policy
    if args.remote:
        over.setdefault("remote", {})["url"] = args.remote
    if args.remote_write_policy:
        over.setdefault("remote", {})["write_policy"] = args.remote_write_policy
    if args.metrics_port is not None:
        over.setdefault("server", {})["metrics_port"] = args.metrics_port
    if args.debug_invariants:
        over.setdefault("server", {})["debug_invariants"] = True
    if args.dram_capacity:
        over.setdefault("dram", {})["capacity"] = args.dram_capacity
    if args.slab_size:
        over.setdefault("dram", {})["slab_size"] = args.slab_size
    if args.eviction_policy:
        over.setdefault("dram", {})["eviction_policy"] = args.eviction_policy
    if args.gpu_device is not None:
        over.setdefault("gpu", {})["device"] = args.gpu_device
    if args.gpu_capacity:
        over.setdefault("gpu", {})["capacity"] = args.gpu_capacity
    return over


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvstore import start_signals

    start_signals.hold()  # (done as kvstore was imported, where it ran as ``kvstore serve``)
    from kvstore.config import format_size, load_config
    from kvstore.server import Server, run_server

    config = load_config(args.config, overrides=_serve_overrides(args))
    from kvstore.logs import configure

    configure(config.server.log_level, config.server.log_format)

    def ready(server: Server) -> None:
        for endpoint in server.endpoints:
            print(f"kvstore serving on {endpoint}", flush=True)
        arenas = server.arenas.by_name if server.arenas else {}
        where = (", ".join(a.path for a in arenas.values()) if arenas
                 else "one arena per tenant, made at its first hello")
        print(f"dram tier: {format_size(config.dram_capacity)} arena(s): {where}", flush=True)
        if server.ssd is not None:
            print(f"ssd tier: {format_size(config.ssd_capacity)} in {config.ssd_path} "
                  f"({server.store.ssd_committed_slots} blocks restored)", flush=True)
        if server.gpu is not None:
            print(f"gpu tier: {server.gpu.describe()}", flush=True)
        elif config.gpu.device:
            print(f"gpu tier: off ({server.gpu_reason})", flush=True)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a core dependency
        asyncio.run(run_server(config, ready))  # pragma: no cover
    else:
        uvloop.run(run_server(config, ready, reload=lambda: load_config(
            args.config, overrides=_serve_overrides(args), reload=True)))
    return 0


def _cmd_ping(args: argparse.Namespace) -> int:
    import time

    from kvstore.client import Client

    start = time.perf_counter()
    with Client(args.endpoint, timeout=args.timeout, map_arena=False) as client:
        client.ping()
    print(f"pong from {client.endpoint} in {(time.perf_counter() - start) * 1e3:.2f} ms")
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    import time

    from kvstore.client import Client

    with Client(args.endpoint, timeout=args.timeout, map_arena=False) as client:
        stats = client.stats()
        if args.json:
            print(json.dumps(stats, indent=2, sort_keys=True))
            return 0
        if not args.watch:
            print(_shown_stats(stats, None, 0.0))
            return 0
        previous, at = stats, time.monotonic()
        try:
            while True:
                time.sleep(args.watch)
                stats, now = client.stats(), time.monotonic()
                # clear the screen and draw again, as top does
                print("\x1b[H\x1b[2J" + _shown_stats(stats, previous, now - at), flush=True)
                previous, at = stats, now
        except KeyboardInterrupt:
            return 0


def _shown_stats(stats: dict[str, Any], previous: dict[str, Any] | None, dt: float) -> str:
    """``_stats_view`` of figures from whatever answers at the endpoint, fit to print.
    Figures of another shape (a daemon of another version, or no daemon at all: anything
    may listen at a socket path) are a KVStoreError saying so, not a traceback; and the
    names in them are shown with control characters escaped, so that none can move the
    cursor, clear the screen or retitle the terminal."""
    try:
        view = _stats_view(stats, previous, dt)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
        raise KVStoreError(f"the stats from the endpoint do not have the shape this "
                           f"kvstore shows ({type(exc).__name__}: {exc}); --json prints "
                           f"them as they came") from None
    return _printable(view)


def _printable(text: str) -> str:
    """``text`` with its control characters but newlines escaped (``\\x1b``): what came
    from an endpoint (figures, an error's message) cannot drive the terminal."""
    return "".join(ch if ch == "\n" or ch.isprintable() else ch.encode("unicode_escape")
                   .decode("ascii") for ch in text)


def _stats_view(stats: dict[str, Any], previous: dict[str, Any] | None, dt: float) -> str:
    """The terminal view: a bar per tier, hit rate, and throughput since the last view."""
    from kvstore.config import format_size

    lines = []
    if "tiers" not in stats:  # credentials set, not an operator: a tenant's own figures
        return _tenant_view(stats)
    for tier, t in stats["tiers"].items():
        if "capacity" not in t:  # a tier without slots of its own (the remote store's marks)
            continue
        used = (t.get("committed", 0) + t.get("reserved", 0)) / max(t["capacity"], 1)
        bar = "#" * int(used * 40)
        hit = t.get("hits", 0) / max(t.get("lookup_keys", 0), 1)
        line = (f"{tier:6} [{bar:<40}] {used:6.1%} of {format_size(t['capacity']):>8}  "
                f"blocks={t.get('blocks', 0)} pinned={t.get('pinned_blocks', 0)} "
                f"evictions={t.get('evictions', 0)}")
        if "lookup_keys" in t:
            line += f" hit rate={hit:.1%}"
        if previous is not None and dt > 0:
            before = previous["tiers"].get(tier, {})
            rate = (t.get("commits", t.get("writes", 0))
                    - before.get("commits", before.get("writes", 0))) / dt
            line += f" {rate:,.0f} blocks/s in"
        lines.append(line)
    classes = stats.get("slab_classes", {}).get("dram", [])
    if len(classes) > 1:  # block sizes sharing a tier: the slabs each holds, its share
        lines.append("dram slabs by block size: " + ", ".join(
            f"{format_size(c['slot_bytes'])} x{c['slabs']} (share {c['share']:g})"
            for c in sorted(classes, key=lambda c: -c["slabs"])))
    lines.append(f"sessions={stats['sessions']} namespaces={stats['namespaces']} "
                 f"invariant violations={stats['invariant_violations']}")
    if "remote" in stats:
        r = stats["remote"]
        failure = r.get("last_failure")
        why = "" if r["healthy"] or not failure else (
            f" ({failure['call']}: {failure['error']}, {failure['seconds_ago']:.0f}s ago)")
        lines.append(f"remote {r['backend']}: {'healthy' if r['healthy'] else 'UNHEALTHY'}"
                     f"{why} writes={r['writes']} reads={r['reads']} errors={r['errors']}")
    return "\n".join(lines)


def _tenant_view(stats: dict[str, Any]) -> str:
    """The view of a tenant that is not one of ``auth.operators`` where credentials are
    set: the daemon leaves out its whole figures (``verbs.DAEMON_WIDE``) and names only
    the tenants whose namespaces this one may open."""
    from kvstore.config import format_size

    lines = [f"sessions={stats.get('sessions', 0)} namespaces={stats.get('namespaces', 0)}"]
    for key, tier in (("tenant_dram_bytes", "dram"), ("ssd_tenant_bytes", "ssd")):
        held = stats.get(key) or {}
        lines.append(f"{tier:6} held: " + (", ".join(
            f"{name} {format_size(nbytes)}" for name, nbytes in sorted(held.items()))
            or "nothing"))
    lines.append("(the daemon's own figures are shown to its auth.operators only)")
    return "\n".join(lines)


# an identity's JSON is well under this (its text fields hold 512 characters at most)
_MAX_IDENTITY_BYTES = 64 << 10


def _read_identity(text: str) -> Identity | None:
    """``--identity``: JSON, or ``@FILE`` holding it; None (said on stderr) if invalid."""
    import msgspec

    from kvstore.identity import Identity

    if text.startswith("@"):
        from kvstore.files import read_regular_file

        path = text[1:]
        try:
            # (a FIFO is read as it comes: ``--identity @<(...)`` is a shell's way to pass one)
            raw, _ = read_regular_file(path, "--identity", _MAX_IDENTITY_BYTES, streams=True)
            text = raw.decode("utf-8")
        except ConfigError as exc:
            print(f"kvstore: {exc}", file=sys.stderr)
            return None
        except UnicodeDecodeError as exc:
            print(f"kvstore: --identity: {path} is not UTF-8 text: {exc.reason} at byte "
                  f"{exc.start}", file=sys.stderr)
            return None
    try:
        return msgspec.json.decode(text, type=Identity)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"kvstore: --identity is not a valid identity: {exc}", file=sys.stderr)
        return None


def _cmd_drop(args: argparse.Namespace) -> int:
    from kvstore.client import Client

    identity = _read_identity(args.identity)
    if identity is None:
        return 2
    with Client(args.endpoint, timeout=args.timeout, tenant=identity.tenant,
                map_arena=False) as client:
        dropped = client.namespace(identity).drop()
    print(f"dropped {dropped} blocks of namespace {identity.namespace_id.hex()}")
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    import dataclasses

    from kvstore.keys import chain_keys
    from kvstore.router import format_routes, read_tokens, route

    identity = _read_identity(args.identity)
    if identity is None:
        return 2
    tokens = read_tokens(args.tokens)
    keys = chain_keys(identity.namespace_id, tokens, identity.block_tokens)
    endpoints = [e for part in args.endpoints for e in part.split(",") if e]
    results = route(keys, endpoints, deadline=args.deadline, prefill_rate=args.prefill_rate,
                    tokens=len(tokens), block_tokens=identity.block_tokens,
                    tenant=identity.tenant)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], default=str, indent=2))
    else:
        print(format_routes(results, len(keys)))
    if not any(r.answered for r in results):  # (no route: a script must not take one)
        print(f"kvstore: route: no daemon answered (none within {args.deadline:g}s, or "
              f"each refused: see above)", file=sys.stderr)
        return 1
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from kvstore.config import load_config

    config = load_config(args.file)
    if args.action == "check":
        print(f"{args.file or 'defaults'}: ok")
        if args.file:
            from kvstore.config_paths import resolved_paths

            for line in resolved_paths(args.file):
                print(f"  {line}")
    else:
        print(config_to_toml(config), end="")
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    import os

    if args.secret:
        from kvstore.auth import write_secret

        try:
            write_secret(args.secret)
        except FileExistsError:
            print(f"kvstore: {args.secret} exists; not overwriting it", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"kvstore: cannot write {args.secret}: {exc.strerror}", file=sys.stderr)
            return 1
        print(f"secret written to {args.secret} (mode 0600): for auth.secret_file "
              "(tokens) or remote.tag_secret_file (the daemons' tag secret)")
        return 0
    if not args.dir or not args.name:
        print("kvstore: keygen needs DIR and --name (or --secret FILE)", file=sys.stderr)
        return 2
    why = _key_name_problem(args.name)
    if why is not None:
        print(f"kvstore: --name {args.name!r} {why}", file=sys.stderr)
        return 2
    import zmq.auth

    try:
        os.makedirs(args.dir, mode=0o700, exist_ok=True)
        public, secret = zmq.auth.create_certificates(args.dir, args.name)
        os.chmod(secret, 0o600)
    except OSError as exc:
        print(f"kvstore: cannot write the key pair in {args.dir}: {exc.strerror}",
              file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


def _key_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a key pair (None if it can).  Its files are NAME.key and
    NAME.key_secret in DIR, so it is a file name, no path (``../x`` wrote outside DIR);
    and the daemon reads a client key's tenant from the name up to its first dot
    (``acme.laptop.key`` is tenant acme: ``Auth._client_keys``), which must be a tenant
    name."""
    if "/" in name:
        return "is a path; give a file name (a tenant, as acme or acme.laptop)"
    why = tenant_problem(name.split(".")[0])
    if why is not None:
        return f"names no tenant: its part before the first '.' {why}"
    return None


def _cmd_token(args: argparse.Namespace) -> int:
    from kvstore.auth import issue_token, read_secret
    # a token the daemon would refuse at every hello is refused here instead
    why = tenant_problem(args.tenant)
    if why is None and len(args.tenant.encode()) > _MAX_PLAIN_USER_BYTES:
        why = (f"is longer than {_MAX_PLAIN_USER_BYTES} bytes (a token's tenant is "
               f"ZeroMQ's PLAIN user name in the handshake)")
    if why is not None:
        print(f"kvstore: --tenant {args.tenant!r} {why}", file=sys.stderr)
        return 2
    print(issue_token(read_secret(args.secret_file), args.tenant, args.ttl))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore", description="A tiered store for LLM KV-cache blocks.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon (embedded defaults without --config)")
    serve.add_argument("--config", help="TOML configuration file")
    serve.add_argument("--endpoint", help="ipc://PATH or tcp://HOST:PORT to bind "
                       "(default: $KVSTORE_ENDPOINT or ipc:// in the runtime directory)")
    serve.add_argument("--extra-endpoint", action="append", metavar="URL",
                       help="another endpoint to bind as well (repeatable)")
    serve.add_argument("--dram-capacity", metavar="SIZE", help="DRAM arena size, e.g. 256MiB")
    serve.add_argument("--slab-size", metavar="SIZE", help="slab size, e.g. 64MiB")
    serve.add_argument("--eviction-policy", metavar="NAME",
                       help="eviction policy: auto (the default), slru, arc, s3fifo, lru or density")
    serve.add_argument("--ssd-path", metavar="DIR",
                       help="SSD tier directory (default: the user's data directory)")
    serve.add_argument("--ssd-capacity", metavar="SIZE",
                       help="SSD tier size, e.g. 64GiB; 0 runs without the tier")
    serve.add_argument("--ssd-write-policy", choices=["write-back", "write-through"],
                       help="write blocks to SSD when DRAM evicts them, or on commit")
    serve.add_argument("--remote", metavar="URL",
                       help="a remote tier shared by many daemons: redis://HOST:PORT/DB, "
                            "redis+cluster://HOST:PORT, fs:///PATH, or a plugin's URL")
    serve.add_argument("--remote-write-policy", choices=["write-back", "write-through"],
                       help="copy blocks to the remote store as they commit (write-through, "
                            "the default) or when DRAM evicts them (write-back)")
    serve.add_argument("--gpu-device", metavar="INDEX",
                       help="CUDA device for the GPU tier's pool (cpu: a host-memory pool; "
                            "default: no GPU tier)")
    serve.add_argument("--gpu-capacity", metavar="SIZE", help="GPU tier pool size, e.g. 4GiB")
    serve.add_argument("--lease", type=float, metavar="SECONDS",
                       help="lease of reservations and pins, renewed by any request or ping")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", choices=["text", "json"],
                       help="one JSON object per log line, with request ids (json)")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics on 127.0.0.1:PORT (0: off)")
    serve.add_argument("--debug-invariants", action="store_true",
                       help="check every invariant after each request (slow)")
    serve.set_defaults(func=_cmd_serve)

    for name, func, text in (("ping", _cmd_ping, "check that the daemon answers"),
                             ("stats", _cmd_stats, "show what the daemon holds")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--endpoint", help="daemon endpoint (default: $KVSTORE_ENDPOINT)")
        cmd.add_argument("--timeout", type=_SECONDS, default=5.0, help="seconds to wait")
        if name == "stats":
            cmd.add_argument("--json", action="store_true", help="machine-readable output")
            cmd.add_argument("--watch", type=_number("seconds", zero=True, most=86400.0),
                             metavar="SECONDS", default=0.0,
                             help="redraw every SECONDS, with throughput (Ctrl-C ends)")
        cmd.set_defaults(func=func)

    drop = sub.add_parser("drop-namespace", help="drop every unpinned block of a namespace")
    drop.add_argument("--identity", required=True, metavar="JSON",
                      help="the namespace's identity as JSON, or @FILE holding it")
    drop.add_argument("--endpoint", help="daemon endpoint (default: $KVSTORE_ENDPOINT)")
    drop.add_argument("--timeout", type=_SECONDS, default=5.0, help="seconds to wait")
    drop.set_defaults(func=_cmd_drop)

    keygen = sub.add_parser(
        "keygen", help="make a CurveZMQ key pair (DIR --name NAME) or a secret "
                       "(--secret FILE: tokens' or remote tags')")
    keygen.add_argument("dir", nargs="?", help="directory for NAME.key and NAME.key_secret")
    keygen.add_argument("--name", help="the key's name; for a client, its tenant")
    keygen.add_argument("--secret", metavar="FILE", help="write a 32-byte hex secret (auth.secret_file, "
                        "remote.tag_secret_file)")
    keygen.set_defaults(func=_cmd_keygen)

    token = sub.add_parser("token", help="issue a tenant token signed with the daemon's secret")
    token.add_argument("--secret-file", required=True, help="the daemon's auth.secret_file")
    token.add_argument("--tenant", required=True)
    token.add_argument("--ttl", type=_number("seconds", most=MAX_TOKEN_TTL), default=86400.0,
                       metavar="SECONDS", help="how long the token is valid (default: a "
                       "day; at most 366 days)")
    token.set_defaults(func=_cmd_token)

    rt = sub.add_parser("route", help="ask daemons where a request's prefix is cached, "
                                      "cheapest first")
    rt.add_argument("--endpoints", required=True, nargs="+", metavar="ENDPOINT",
                    help="the daemons (one per worker or host), space or comma separated")
    rt.add_argument("--tokens", required=True, metavar="FILE",
                    help="the request's token ids: a JSON list, or integers split by "
                         "spaces, commas or lines ('-': standard input)")
    rt.add_argument("--identity", required=True, metavar="JSON",
                    help="the model's identity as JSON, or @FILE holding it")
    rt.add_argument("--prefill-rate", type=_number("tokens a second"), default=10_000.0,
                    metavar="TOKENS",
                    help="tokens a second a worker prefills (default 10000)")
    rt.add_argument("--deadline", type=_SECONDS, default=0.5, metavar="SECONDS",
                    help="a daemon that has not answered by then ranks last (default 0.5)")
    rt.add_argument("--json", action="store_true", help="machine-readable output")
    rt.set_defaults(func=_cmd_route)

    config = sub.add_parser("config", help="check or show the configuration")
    config.add_argument("action", choices=["check", "show"])
    config.add_argument("file", nargs="?", help="TOML file (show: defaults if omitted)")
    config.set_defaults(func=_cmd_config)

    from kvstore.bench.command import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        print(f"kvstore: configuration error: {_printable(str(exc))}", file=sys.stderr)
        return 2
    except KVStoreError as exc:  # (its message may be an endpoint's: ``_printable``)
        print(f"kvstore: {_printable(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


def config_to_toml(config: Config) -> str:
    """The effective configuration as TOML text (for `config show`)."""
    import msgspec

    from kvstore.config import SECTIONS

    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        values = msgspec.structs.asdict(getattr(config, section))
        if section == "server" and not values["endpoint"]:
            values["endpoint"] = config.endpoint
        if section == "ssd":  # the directory it uses: the default's, "~" expanded
            values["path"] = str(config.ssd_path)
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
