"""Who may use the dashboard, and what every response carries to protect its pages.

- ``Credentials``: a bearer token and/or a user and password (HTTP basic auth), read from
  ``$SKIPJACK_DASHBOARD_TOKEN``, ``$SKIPJACK_DASHBOARD_USER`` and
  ``$SKIPJACK_DASHBOARD_PASSWORD``. With a token, a browser signs in with any user name and
  the token as password.
- ``Guard``, an ASGI middleware: refuses a request without valid credentials (when there
  are any) or, where told to, one whose ``Host`` header names another host than the loopback
  one it serves (a page of another site reaching ``127.0.0.1`` through a DNS name it controls:
  "DNS rebinding"); sets the CSRF cookie; adds a strict Content-Security-Policy (scripts and
  styles only from the dashboard's own files, no inline ones) and the other security headers.
- CSRF: every form carries ``csrf_token``, an HMAC of the per-browser cookie under a
  per-process secret, which is checked on every POST (so neither another site
  nor one that can set cookies on this host can forge it), together with the browser's
  ``Sec-Fetch-Site`` and ``Origin`` headers when it sends them (``csrf_refusal``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigError

CSRF_COOKIE = "skipjack_csrf"
CSRF_FIELD = "csrf_token"

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SECRET_MIN_CHARS = 12  # of a token or password


@dataclass(frozen=True)
class Credentials:
    """What a request must present: ``Authorization: Bearer <token>``, or basic auth with
    ``user`` and ``password`` (or any user name and ``token`` as the password).

    Raises:
        ConfigError: neither a token nor a user and password, or only one of those two.
    """

    token: str | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ConfigError("SKIPJACK_DASHBOARD_USER and SKIPJACK_DASHBOARD_PASSWORD: "
                              "set both, or neither")
        if not self.token and not self.password:
            raise ConfigError("dashboard credentials: give a token, or a user and password")
        for name, secret in (("SKIPJACK_DASHBOARD_TOKEN", self.token),
                             ("SKIPJACK_DASHBOARD_PASSWORD", self.password)):
            if secret is not None and (len(secret) < SECRET_MIN_CHARS or secret != secret.strip()):
                raise ConfigError(f"{name}: at least {SECRET_MIN_CHARS} characters, without "
                                  "leading or trailing white space")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Credentials | None:
        """The credentials in ``$SKIPJACK_DASHBOARD_TOKEN``, ``$SKIPJACK_DASHBOARD_USER`` and
        ``$SKIPJACK_DASHBOARD_PASSWORD`` (empty counts as unset), or None when none is set.

        Raises:
            ConfigError: a user without a password or the reverse.
        """
        token = environ.get("SKIPJACK_DASHBOARD_TOKEN") or None
        user = environ.get("SKIPJACK_DASHBOARD_USER") or None
        password = environ.get("SKIPJACK_DASHBOARD_PASSWORD") or None
        if user is not None and not user.strip():
            raise ConfigError("SKIPJACK_DASHBOARD_USER: blank")
        if token is None and user is None and password is None:
            return None
        return cls(token, user, password)

    def allow(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries these credentials."""
        if not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer":
            return self.token is not None and _same(value, self.token)
        if scheme.lower() != "basic":
            return False
        pair = basic_credentials(authorization)
        if pair is None:
            return False
        user, password = pair
        if self.token is not None and _same(password, self.token):
            return True
        return (self.user is not None and self.password is not None
                and _same(user, self.user) & _same(password, self.password))


def basic_credentials(authorization: str | None) -> tuple[str, str] | None:
    """(user, password) of an ``Authorization: Basic`` header value, or None when it is
    none or malformed."""
    scheme, _, value = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(value.strip(), validate=True).decode() \
            .partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


def _same(given: str, expected: str) -> bool:
    """Compare in constant time (for a given length of ``expected``)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def host_allowed(host_header: str, allowed: Sequence[str]) -> bool:
    """Whether a ``Host`` header (``name[:port]`` or ``[v6]:port``) names an allowed host."""
    try:
        name = urlsplit("//" + host_header).hostname
    except ValueError:
        return False
    return name is not None and name in allowed


class Guard:
    """ASGI middleware around the dashboard: authentication, the Host check, the CSRF cookie
    and the security headers (see the module's docstring).

    Args:
        app: the application it guards.
        credentials: required of every request (None: none asked for).
        allowed_hosts: the host names a request's ``Host`` header may give (None: any).
        secret: the key of the CSRF tokens (bytes; random per process when None, so the
            forms of a page rendered before a restart are refused after it: reload them).
    """

    def __init__(self, app: ASGIApp, *, credentials: Credentials | None = None,
                 allowed_hosts: Sequence[str] | None = None,
                 secret: bytes | None = None) -> None:
        self.app = app
        self.credentials = credentials
        self.allowed_hosts = allowed_hosts
        self.secret = secret or secrets.token_bytes(32)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # the dashboard has none
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if self.allowed_hosts is not None and \
                not host_allowed(headers.get("host", ""), self.allowed_hosts):
            await _plain(send, 421, "this dashboard answers only for the loopback host; "
                                    "sign-in credentials are needed for other names\n")
            return
        authorization = headers.get("authorization", "")
        try:  # header bytes were read as latin-1; credentials may be any UTF-8 text
            authorization = authorization.encode("latin-1").decode()
        except UnicodeDecodeError:
            authorization = ""
        if self.credentials is not None and not self.credentials.allow(authorization):
            await _plain(send, 401, "sign in with the dashboard's credentials\n",
                         [(b"www-authenticate", b'Basic realm="skipjack", charset="UTF-8"')])
            return
        # url_for names the dashboard's own routes, also when it is mounted in another app
        # (whose router Starlette would otherwise look names up in, from its own root)
        scope = {**scope, "router": getattr(self.app, "router", scope.get("router")),
                 "app_root_path": scope.get("root_path", "")}
        cookie = _cookie(headers.get("cookie", ""))
        new_cookie = cookie is None
        if cookie is None:
            cookie = secrets.token_urlsafe(32)
        state: dict[str, Any] = dict(scope.get("state") or {})
        scope["state"] = state
        state["csrf_cookie"] = cookie
        state["csrf_secret"] = self.secret
        path = (scope.get("root_path") or "") or "/"
        secure = "; Secure" if scope.get("scheme") == "https" else ""

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = list(SECURITY_HEADERS)
                if new_cookie:
                    extra.append((b"set-cookie", (
                        f"{CSRF_COOKIE}={cookie}; Path={path}; HttpOnly; SameSite=Lax"
                        f"{secure}").encode()))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _cookie(header: str) -> str | None:
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except Exception:  # a malformed Cookie header: treated as none
        return None
    morsel = jar.get(CSRF_COOKIE)
    value = morsel.value if morsel is not None else ""
    return value if 20 <= len(value) <= 100 else None


async def _plain(send: Send, status: int, text: str,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            *SECURITY_HEADERS, *headers]})
    await send({"type": "http.response.body", "body": text.encode()})


def csrf_token(request: Request) -> str:
    """The token the forms of a page rendered for this request carry."""
    state = request.scope.get("state", {})
    cookie: str = state.get("csrf_cookie", "")
    secret: bytes = state.get("csrf_secret", b"")
    return hmac.new(secret, cookie.encode(), hashlib.sha256).hexdigest()


def csrf_refusal(request: Request, token: object) -> str | None:
    """Why a POST is refused, or None when it carries this browser's token and comes from
    the dashboard's own pages (by ``Sec-Fetch-Site`` and ``Origin``, where the browser sends
    them)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return f"the form was sent from another site (Sec-Fetch-Site: {site})"
    origin = request.headers.get("origin")  # "null" (an opaque origin) is refused too
    host = request.headers.get("host", "")
    if origin is not None and urlsplit(origin).netloc != host:
        return (f"the form was sent from {origin}, not from this dashboard ({host}); behind "
                "a reverse proxy, pass the original Host header on")
    if not request.scope.get("state", {}).get("csrf_cookie") or not isinstance(token, str) \
            or not hmac.compare_digest(token, csrf_token(request)):
        return "the form's CSRF token is missing or wrong (reload the page and try again)"
    return None
