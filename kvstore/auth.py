"""Who a session is: tenant identity from credentials, never from a field a client sets.

Three modes, by configuration:
- no credentials configured (a single-user host): the tenant a client names in hello;
- ``auth.secret_file`` set: hello must carry a token signed with that secret
  (``kvstore token``), naming the tenant and an expiry; the tenant comes from the token;
- ``auth.curve_secret_key_file`` set: ``tcp://`` endpoints are served on a CurveZMQ socket
  and only client keys found in ``auth.curve_clients_dir`` may connect; the tenant is the
  key file's name (``acme.key`` or ``acme.laptop.key`` are tenant ``acme``).

- ``auth.peer_tenants`` set: the tenant of a client on an ipc endpoint is the one mapped
  to its uid (by user name or uid), which the daemon reads on the side socket beside the
  endpoint (SO_PEERCRED).  Tokens work alongside.

With a token secret or peer tenants, ipc endpoints are *gated*: a client first asks the
side socket for admission (with its token, or none for its uid) and gets its tenant and a
one-time ticket, good only for a connection of its uid, or a clear refusal; it connects with them as its ZeroMQ PLAIN user name
and password, checked in the handshake (``redeem``), so a peer without credentials never
gets a message into the daemon.  The tenant of such a connection is its PLAIN user name.

With a token secret, ``tcp://`` endpoints without CurveZMQ are gated the same way: the
client's PLAIN user name is its tenant and its password its token, checked in the
handshake (``token_fits``), so a peer without a good token sends the daemon nothing.
With ``auth.peer_tenants`` alone, tcp endpoints have no credentials to check: they are
open (the daemon warns at start-up) and refuse every hello.

``auth.shared_tenants`` grants namespaces of one tenant to others (a shared system
prompt, say): ``{"public" = ["acme", "globex"]}``.  A grant is to read: a grantee looks
up, acquires and gets the owner's blocks and maps its arena read-only, but cannot write
there, evict or drop (else any grantee could plant bytes under a key the others will
load: a shared prompt's keys are known to all).  ``auth.shared_writers`` names the
grantees that may write too (``{"public" = ["acme"]}``).  What a grantee keeps pinned
there is bounded in bytes, a share of the owner's DRAM (``auth.grantee_pin_share``,
``kvstore.grant_pins``): pinned blocks cannot be evicted.

The metrics port names every tenant: with credentials set it answers only scrapes that
carry the bearer token of ``server.metrics_token_file`` (``read_metrics_token``,
``bearer_matches``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import pwd
import secrets
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvstore.config import Config
from kvstore.errors import ConfigError, ForbiddenError, MalformedError
from kvstore.files import read_regular_file

log = logging.getLogger("kvstore.auth")

# the most a secret or token file may hold (a hex secret or a token is well under it)
MAX_SECRET_FILE_BYTES = 4096

_TOKEN_VERSION = 1
TICKET_SECONDS = 10.0        # a ticket is presented at once, in the handshake that follows
_TICKETS_HELD = 4096         # tickets not yet presented, the oldest dropped beyond
TOKEN_DOMAIN = "token"       # the ZAP domain of the tcp socket gated by tokens
# the event stream's sockets, whose readers are ``events.readers`` only: on tcp by a
# CurveZMQ key or a token, on ipc by a ticket of the side socket beside the daemon's
EVENTS_DOMAIN = "events"
EVENTS_TOKEN_DOMAIN = "events-token"
EVENTS_TICKET_DOMAIN = "events-ticket"


def issue_token(secret: bytes, tenant: str, ttl_seconds: float, now: float | None = None) -> str:
    """A token for ``tenant`` that expires ``ttl_seconds`` from now."""
    expires = int((time.time() if now is None else now) + ttl_seconds)
    body = msgspec.msgpack.encode([_TOKEN_VERSION, tenant, expires])
    mac = hmac.new(secret, body, hashlib.sha256).digest()
    return _b64(body) + "." + _b64(mac)


def verify_token(secret: bytes, token: str, now: float | None = None) -> str:
    """The tenant a token names; ForbiddenError if it is forged, malformed or expired."""
    try:
        body_text, mac_text = token.split(".")
        body, mac = _unb64(body_text), _unb64(mac_text)
    except ValueError:
        raise ForbiddenError("the token is not a kvstore token") from None
    if not hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).digest()):
        raise ForbiddenError("the token's signature does not match this daemon's secret")
    try:
        version, tenant, expires = msgspec.msgpack.decode(body, type=tuple[int, str, int])
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise ForbiddenError("the token is malformed") from None
    if version != _TOKEN_VERSION or not tenant:
        raise ForbiddenError("the token is of an unknown version")
    if (time.time() if now is None else now) >= expires:
        raise ForbiddenError("the token has expired; ask for a new one")
    return tenant


def token_tenant(token: str) -> str:
    """The tenant a token names, unchecked (a client's PLAIN user name); "" if malformed."""
    try:
        body = _unb64(token.split(".")[0])
        return msgspec.msgpack.decode(body, type=tuple[int, str, int])[1]
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
        return ""


def read_secret_file(path: str | Path, setting: str) -> bytes:
    """The bytes of a secret file (``setting`` names it in errors): a regular file of at
    most ``MAX_SECRET_FILE_BYTES`` (else a device such as /dev/zero, or a FIFO, would
    hang or fill the daemon's start), opened without blocking (``read_regular_file``);
    a warning if its group or others may read it (they could use the secret)."""
    data, st = read_regular_file(path, setting, MAX_SECRET_FILE_BYTES)
    if st.st_mode & 0o077:
        log.warning("%s: %s may be read by its group or others (mode %o); "
                    "chmod 600 it", setting, path, stat.S_IMODE(st.st_mode))
    return data


def read_secret(path: str | Path, setting: str = "auth.secret_file",
                most: int | None = None) -> bytes:
    """A hex secret of at least 16 bytes (and at most ``most``) from the file ``setting``
    names: the token secret of ``auth.secret_file``, the daemons' tag secret of
    ``remote.tag_secret_file``."""
    data = read_secret_file(path, setting)
    try:
        secret = bytes.fromhex(data.decode().strip())
    except ValueError:
        raise ConfigError(f"{setting}: {path} does not hold a hex secret") from None
    if len(secret) < 16:
        raise ConfigError(f"{setting}: {path} holds {len(secret)} bytes, fewer than 16")
    if most is not None and len(secret) > most:
        raise ConfigError(f"{setting}: {path} holds {len(secret)} bytes; give 16 to {most}")
    return secret


def read_metrics_token(path: str | Path) -> bytes:
    """The bearer token scrapes of the metrics port must carry (``server.metrics_token_file``),
    surrounding whitespace stripped as Prometheus strips its ``credentials_file``;
    ConfigError if unreadable or shorter than 16 characters (guessable)."""
    token = read_secret_file(path, "server.metrics_token_file").strip()
    if len(token) < 16:
        raise ConfigError(f"server.metrics_token_file: {path} holds fewer than 16 "
                          f"characters (kvstore keygen --secret FILE writes a good one)")
    if any(c < 0x21 or c > 0x7e for c in token):
        raise ConfigError(f"server.metrics_token_file: {path} holds other than printable "
                          f"ASCII (an HTTP header carries the token)")
    return token


def bearer_matches(header: str | None, token: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (the scheme in any
    case), compared in constant time."""
    if not header:
        return False
    scheme, _, given = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # WSGI hands header values as latin-1 strings: back to the bytes that were sent
    return hmac.compare_digest(given.strip().encode("latin-1", "replace"), token)


def write_secret(path: str | Path) -> None:
    """A fresh 32-byte secret, hex, in a file only its owner may read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def peer_uids(peer_tenants: dict[str, str]) -> dict[int, str]:
    """``auth.peer_tenants`` by uid (user names looked up now); ConfigError naming an
    unknown user."""
    uids: dict[int, str] = {}
    for user, tenant in peer_tenants.items():
        if not tenant:
            raise ConfigError(f"auth.peer_tenants: user {user!r} maps to an empty tenant")
        if user.isdigit():
            uids[int(user)] = tenant
            continue
        try:
            uids[pwd.getpwnam(user).pw_uid] = tenant
        except KeyError:
            raise ConfigError(f"auth.peer_tenants: no user named {user!r} on this host"
                              ) from None
    return uids


def address_uid(address: str) -> int | None:
    """The uid in a ZeroMQ peer address of an ipc connection (``...:uid:gid:pid``, read
    with SO_PEERCRED); None for any other."""
    try:
        return int(address.rsplit(":", 3)[1]) if address.count(":") >= 3 else None
    except ValueError:
        return None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class _TenantAuthenticator(ThreadAuthenticator):
    """ZAP handler: known client keys only (CURVE), or a ticket the side socket handed out
    for the tenant named as the user (PLAIN), or on the tcp socket of ``TOKEN_DOMAIN`` a
    good token of that tenant; the user id it reports is the tenant."""

    def __init__(self, context: zmq.Context[Any], tenants: dict[bytes, str],
                 redeem: Callable[[str, str, int | None], bool],
                 token_fits: Callable[[str, str], bool], readers: frozenset[str]) -> None:
        super().__init__(context)
        self.tenants = tenants
        self.redeem = redeem
        self.token_fits = token_fits
        self.readers = readers  # the tenants that may read the event stream
        self._address = ""  # of the ZAP request being handled

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # the peer's address, for _authenticate_plain: the base class passes it no further
        # (read before the base class awaits anything, so no other request comes between)
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        tenant = self.tenants.get(key)
        return tenant is not None and (domain != EVENTS_DOMAIN or tenant in self.readers)

    def _authenticate_plain(self, domain: str, username: str,
                            password: str) -> tuple[bool, bytes]:
        if domain in (EVENTS_TOKEN_DOMAIN, EVENTS_TICKET_DOMAIN):
            if username not in self.readers:
                return False, b"not a reader of the event stream (events.readers)"
            if (self.token_fits(username, password) if domain == EVENTS_TOKEN_DOMAIN
                    else self.redeem(username, password, address_uid(self._address))):
                return True, b"OK"
            return False, b"forged, expired or another tenant's credentials"
        if domain == TOKEN_DOMAIN:
            if self.token_fits(username, password):
                return True, b"OK"
            return False, b"forged, expired or another tenant's token"
        if self.redeem(username, password, address_uid(self._address)):
            return True, b"OK"
        return False, b"unknown, used or expired ticket"

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.tenants[zmq.utils.z85.encode(client_public_key)]


class Auth:
    """The daemon's credential checks."""

    def __init__(self, config: Config) -> None:
        a = config.auth
        self.secret = read_secret(a.secret_file) if a.secret_file else None
        self.curve_enabled = bool(a.curve_secret_key_file)
        self.shared = {k: set(v) for k, v in a.shared_tenants.items()}
        self.writers = {k: set(v) for k, v in a.shared_writers.items()}
        self._config = a
        self.readers = frozenset(config.events.readers)
        # one ZAP handler a context (the event stream's sockets have one of their own)
        self._authenticators: dict[int, _TenantAuthenticator] = {}
        # the event stream's contexts: their handlers stop when the stream closes, never
        # before (a CurveZMQ socket without its handler lets any key in)
        self._events_contexts: set[int] = set()
        if self.curve_enabled:
            self._client_keys()  # fail at start-up, not at the first connection
        self.peer_tenants = peer_uids(a.peer_tenants)
        # ipc connections need a ticket in their handshake (see the module's docstring)
        self.gated = self.secret is not None or bool(self.peer_tenants)
        # ticket -> (tenant, deadline, the uid it was handed to), oldest first
        self._tickets: dict[str, tuple[str, float, int]] = {}
        # each tenant's tickets, oldest first: past ``_TICKETS_HELD`` the tenant holding
        # the most loses its oldest (one queue for all let a tenant's flood of admissions
        # drop every other tenant's ticket before its handshake presented it)
        self._tenant_tickets: dict[str, dict[str, None]] = {}
        self._tickets_lock = threading.Lock()  # the ZAP thread redeems them

    def tenant_of(self, asked: str, token: str, curve_tenant: str | None) -> str:
        """The tenant of a hello, from its credentials."""
        if curve_tenant is not None:
            tenant = curve_tenant
        elif self.secret is not None:
            if not token:
                raise ForbiddenError("this daemon requires a token in hello (kvstore token)")
            tenant = verify_token(self.secret, token)
        elif self.peer_tenants:
            raise ForbiddenError("this daemon takes the tenant from the client's uid: connect "
                                 "over its ipc endpoint, whose side socket hands out tickets")
        else:
            if not asked:
                raise MalformedError("hello needs a tenant")
            return asked
        if asked and asked != tenant:
            raise ForbiddenError(f"the credentials are for tenant {tenant!r}, not {asked!r}")
        return tenant

    def admission(self, uid: int, token: str) -> tuple[str, str]:
        """The tenant and a one-time handshake ticket for a client of ``uid`` presenting
        ``token`` ("" for none); ("", "") when ipc endpoints are not gated; ForbiddenError
        saying why the credentials are refused."""
        if not self.gated:
            return "", ""
        if token and self.secret is not None:
            tenant = verify_token(self.secret, token)
        elif self.peer_tenants:
            found = self.peer_tenants.get(uid)
            if found is None:
                raise ForbiddenError(f"uid {uid} has no tenant in auth.peer_tenants"
                                     + ("" if self.secret is None else
                                        ", and no token was given (kvstore token)"))
            tenant = found
        else:
            raise ForbiddenError("this daemon requires a token in hello (kvstore token)")
        now = time.monotonic()
        ticket = secrets.token_hex(16)
        with self._tickets_lock:
            tickets = self._tickets
            while tickets and next(iter(tickets.values()))[1] < now:
                self._forget_ticket(next(iter(tickets)))
            if len(tickets) >= _TICKETS_HELD:
                by_tenant = self._tenant_tickets
                greediest = max(by_tenant, key=lambda held: len(by_tenant[held]))
                self._forget_ticket(next(iter(by_tenant[greediest])))
            tickets[ticket] = (tenant, now + TICKET_SECONDS, uid)
            self._tenant_tickets.setdefault(tenant, {})[ticket] = None
        return tenant, ticket

    def _forget_ticket(self, ticket: str) -> tuple[str, float, int] | None:
        """Drop ``ticket`` (held under ``_tickets_lock``); what it was, if held."""
        held = self._tickets.pop(ticket, None)
        if held is not None:
            mine = self._tenant_tickets[held[0]]
            del mine[ticket]
            if not mine:
                del self._tenant_tickets[held[0]]
        return held

    def redeem(self, tenant: str, ticket: str, uid: int | None) -> bool:
        """Whether ``ticket`` was handed out for ``tenant``, to a process of ``uid`` (the
        connecting one's), and is still good; it is used up either way.  Runs on the ZAP
        thread."""
        with self._tickets_lock:
            held = self._forget_ticket(ticket)
        return (held is not None and held[0] == tenant and held[2] == uid
                and held[1] >= time.monotonic())

    def token_fits(self, tenant: str, token: str) -> bool:
        """Whether ``token`` is good and names ``tenant``.  Runs on the ZAP thread."""
        if self.secret is None:
            return False
        try:
            return verify_token(self.secret, token) == tenant
        except ForbiddenError:
            return False

    def may_open(self, session_tenant: str, namespace_tenant: str) -> bool:
        """Whether a session may open (and read) a namespace of ``namespace_tenant``."""
        return (namespace_tenant == session_tenant
                or session_tenant in self.shared.get(namespace_tenant, ())
                or session_tenant in self.writers.get(namespace_tenant, ()))

    def may_write(self, session_tenant: str, namespace_tenant: str) -> bool:
        """Whether it may also add blocks there, evict them and drop the namespace."""
        return (namespace_tenant == session_tenant
                or session_tenant in self.writers.get(namespace_tenant, ()))

    def _client_keys(self) -> dict[bytes, str]:
        directory = self._config.curve_clients_dir
        if not directory or not os.path.isdir(directory):
            raise ConfigError(
                f"auth.curve_clients_dir: {directory!r} is not a directory of client "
                f"public keys (kvstore keygen)")
        keys: dict[bytes, str] = {}
        for path in sorted(Path(directory).glob("*.key")):
            public, _ = zmq.auth.load_certificate(str(path))
            keys[public] = path.name.split(".")[0]
        return keys

    def _zap(self, context: zmq.Context[Any]) -> _TenantAuthenticator:
        """The context's one ZAP handler, started at the first socket that needs it."""
        authenticator = self._authenticators.get(id(context))
        if authenticator is None:
            keys = self._client_keys() if self.curve_enabled else {}
            authenticator = _TenantAuthenticator(context, keys, self.redeem,
                                                 self.token_fits, self.readers)
            authenticator.start()
            if self.curve_enabled:
                authenticator.configure_curve_callback("*", authenticator)
                authenticator.configure_curve_callback(EVENTS_DOMAIN, authenticator)
            self._authenticators[id(context)] = authenticator
        return authenticator

    def secure_events(self, context: zmq.Context[Any], sock: zmq.Socket[Any],
                      endpoint: str) -> None:
        """Let only ``events.readers`` into an event stream socket about to bind
        ``endpoint``, with the credentials the daemon has for it (``Config.validate``
        refused the combinations with none): on tcp a CurveZMQ key, else a token; on
        ipc a ticket of the side socket beside the daemon's ipc endpoint.  Nothing when
        the daemon takes no credentials (a single-user host): then a tcp endpoint
        reachable from other hosts is warned of, as the daemon's own are."""
        if not (self.curve_enabled or self.secret is not None or self.peer_tenants):
            if endpoint.startswith("tcp://") and not _loopback_endpoint(endpoint):
                log.warning("%s: the KV event stream takes no credentials (none are set): "
                            "any peer that reaches it reads every tenant's keys and token "
                            "ids; bind it on a loopback address or an ipc path, or set "
                            "auth.secret_file (tokens) or auth.curve_secret_key_file "
                            "(CurveZMQ) and events.readers", endpoint)
            return
        self._events_contexts.add(id(context))  # its own to release (``release``)
        if endpoint.startswith("tcp://") and self.curve_enabled:
            self.make_curve_server(context, sock)
            sock.zap_domain = EVENTS_DOMAIN.encode()
            return
        self._zap(context)
        sock.zap_domain = (EVENTS_TOKEN_DOMAIN if endpoint.startswith("tcp://")
                           else EVENTS_TICKET_DOMAIN).encode()
        sock.plain_server = True

    def make_curve_server(self, context: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CurveZMQ server that lets in known client keys only."""
        path = self._config.curve_secret_key_file
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"auth.curve_secret_key_file: cannot load {path}: {exc}") from None
        if secret is None:
            raise ConfigError(f"auth.curve_secret_key_file: {path} holds no secret key")
        self._zap(context)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def make_gated_server(self, context: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a PLAIN server that lets in only tickets from ``admission``."""
        self._zap(context)
        sock.plain_server = True

    def make_token_server(self, context: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (tcp, no CurveZMQ) a PLAIN server that lets in only a good token
        (the password) of the tenant named as the user."""
        self._zap(context)
        sock.zap_domain = TOKEN_DOMAIN.encode()
        sock.plain_server = True

    def release(self, context: zmq.Context[Any]) -> None:
        """Stop the ZAP handler of ``context`` (before it is terminated: its socket
        would hold the termination up)."""
        self._events_contexts.discard(id(context))
        authenticator = self._authenticators.pop(id(context), None)
        if authenticator is not None:
            authenticator.stop()

    def close(self) -> None:
        """Stop the ZAP handlers, but those of event stream contexts still open (their
        stream releases them as it closes its sockets)."""
        for key in [k for k in self._authenticators if k not in self._events_contexts]:
            self._authenticators.pop(key).stop()


def _loopback_endpoint(endpoint: str) -> bool:
    """Whether a tcp endpoint binds a loopback address only (``*``, an interface's name
    or a host name: no)."""
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
