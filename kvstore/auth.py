"""Who a session is: tenant identity from credentials, never from a field a client sets.

Three modes, by configuration:
- no credentials configured (a single-user host): the tenant a client names in hello;
- ``auth.secret_file`` set: hello must carry a token signed with that secret
  (``kvstore token``), naming the tenant and an expiry; the tenant comes from the token;
- ``auth.curve_secret_key_file`` set: ``tcp://`` endpoints are served on a CurveZMQ socket
  and only client keys found in ``auth.curve_clients_dir`` may connect; the tenant is the
  key file's name (``acme.key`` or ``acme.laptop.key`` are tenant ``acme``).

``auth.shared_tenants`` grants namespaces of one tenant to others (a shared system
prompt, say): ``{"public" = ["acme", "globex"]}``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvstore.config import Config
from kvstore.errors import ConfigError, ForbiddenError, MalformedError

_TOKEN_VERSION = 1


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


def read_secret(path: str | Path) -> bytes:
    try:
        text = Path(path).read_text().strip()
        secret = bytes.fromhex(text)
    except OSError as exc:
        raise ConfigError(f"auth.secret_file: cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise ConfigError(f"auth.secret_file: {path} does not hold a hex secret") from None
    if len(secret) < 16:
        raise ConfigError(f"auth.secret_file: {path} holds fewer than 16 bytes")
    return secret


def write_secret(path: str | Path) -> None:
    """A fresh 32-byte secret, hex, in a file only its owner may read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class _TenantAuthenticator(ThreadAuthenticator):
    """ZAP handler: known client keys only; the user id it reports is the tenant."""

    def __init__(self, context: zmq.Context[Any], tenants: dict[bytes, str]) -> None:
        super().__init__(context)
        self.tenants = tenants

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.tenants

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.tenants[zmq.utils.z85.encode(client_public_key)]


class Auth:
    """The daemon's credential checks."""

    def __init__(self, config: Config) -> None:
        a = config.auth
        self.secret = read_secret(a.secret_file) if a.secret_file else None
        self.curve_enabled = bool(a.curve_secret_key_file)
        self.shared = {k: set(v) for k, v in a.shared_tenants.items()}
        self._config = a
        self._authenticator: _TenantAuthenticator | None = None
        if self.curve_enabled:
            self._client_keys()  # fail at start-up, not at the first connection

    def tenant_of(self, asked: str, token: str, curve_tenant: str | None) -> str:
        """The tenant of a hello, from its credentials."""
        if curve_tenant is not None:
            tenant = curve_tenant
        elif self.secret is not None:
            if not token:
                raise ForbiddenError("this daemon requires a token in hello (kvstore token)")
            tenant = verify_token(self.secret, token)
        else:
            if not asked:
                raise MalformedError("hello needs a tenant")
            return asked
        if asked and asked != tenant:
            raise ForbiddenError(f"the credentials are for tenant {tenant!r}, not {asked!r}")
        return tenant

    def may_open(self, session_tenant: str, namespace_tenant: str) -> bool:
        return (namespace_tenant == session_tenant
                or session_tenant in self.shared.get(namespace_tenant, ()))

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

    def make_curve_server(self, context: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CurveZMQ server that lets in known client keys only."""
        path = self._config.curve_secret_key_file
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"auth.curve_secret_key_file: cannot load {path}: {exc}") from None
        if secret is None:
            raise ConfigError(f"auth.curve_secret_key_file: {path} holds no secret key")
        self._authenticator = _TenantAuthenticator(context, self._client_keys())
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", self._authenticator)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
