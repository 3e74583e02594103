"""Who may ask: the Host allow-list (Starlette's `TrustedHostMiddleware`) and the API key, as ASGI layers.

A page on another site that rebinds its DNS name to 127.0.0.1 sends its own name as the Host, so it gets 400
and never reaches the API or the UI; the Host is checked first, so such a page never gets the key's login
prompt either. When the server has an API key, every other request must carry it (checked in constant time,
`serve.server.auth.key_refusal`). Health routes answer without either check: load balancers and orchestrators
probe them by IP and without the key, so they answer their status alone, and tell more (the default model's
name and version) only to a client that sent the key (`authorized`).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.middleware.trustedhost import TrustedHostMiddleware

from serve.server.auth import HTTP_KEY_HINT, key_refusal
from serve.server.http.errors import send_error

HEALTH_PATHS = ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")
API_PREFIXES = ("/v1", "/v2", "/metrics", "/openapi.json", "/docs", "/redoc")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
AUTHORIZED = "authorized"  # the key in scope["state"]: whether the request may see more than a status


def allowed_hosts_of(setting: str, bind_host: str) -> frozenset[str] | None:
    """The Host names to accept: `setting` (comma-separated; "*" for any) or the bind host and loopback.

    Returns:
        Lower-case names without ports or brackets, or None for any host.
    """
    names = [h.strip().lower() for h in setting.split(",") if h.strip()]
    if "*" in names:
        return None
    if not names:
        names = [bind_host.lower(), *LOOPBACK_HOSTS]
    return frozenset(h.strip("[]") for h in names if h not in ("0.0.0.0", "::", ""))


def authorized(scope) -> bool:
    """Whether `ApiKeyCheck` let this request through with the key (or the server needs none)."""
    return bool(scope.get("state", {}).get(AUTHORIZED, False))


class HostAllowList(TrustedHostMiddleware):
    """Starlette's `TrustedHostMiddleware` over `allowed_hosts` (None: any), with two changes: the health paths
    pass without a check, and a refusal is our JSON 400 (`bad_host`) that says which flag admits the name.

    Args:
        app: the ASGI app to wrap.
        allowed_hosts: names as `allowed_hosts_of` gives them.
    """

    def __init__(self, app, allowed_hosts: frozenset[str] | None):
        # Starlette compares IPv6 literals in their brackets, as the Host header carries them
        names = ["*"] if allowed_hosts is None else [f"[{h}]" if ":" in h else h for h in allowed_hosts]
        super().__init__(self._through, names, www_redirect=False)
        self.inner = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in HEALTH_PATHS:
            return await self.inner(scope, receive, send)
        hosts = sum(name == b"host" for name, _ in scope["headers"])
        if hosts > 1:  # RFC 9112: a 400, as nginx answers
            return await _Refusal(scope, send).refuse("the request has more than one Host header: send one")
        if not hosts:  # mandatory in HTTP/1.1 only; no browser (so no DNS-rebinding page) leaves it out
            if scope.get("http_version") == "1.0":
                return await self.inner(scope, receive, send)
            return await _Refusal(scope, send).refuse("the request has no Host header, which HTTP/1.1 requires")
        await super().__call__(scope, receive, _Refusal(scope, send))

    async def _through(self, scope, receive, send: _Refusal) -> None:
        """What the library calls for an allowed Host: the app, with the client's own `send`."""
        await self.inner(scope, receive, send.send)


class _Refusal:
    """The `send` Starlette answers a refused Host through: its plain-text 400 becomes our JSON one (and a
    websocket's close, 1008)."""

    def __init__(self, scope, send):
        self.scope, self.send = scope, send

    async def __call__(self, message) -> None:
        if not message["type"].endswith("http.response.start"):
            return  # the library's body: ours went out with the start
        given = next((value for name, value in self.scope["headers"] if name == b"host"), b"").decode("latin-1")
        try:
            host = urlsplit("//" + given).hostname or given
        except ValueError:
            host = given
        await self.refuse(
            f"Host {host!r} is not served here; start vit-serve with --allowed-hosts {host or 'NAME'} "
            "if this name is meant to reach it"
        )

    async def refuse(self, message: str) -> None:
        if self.scope["type"] == "websocket":
            return await self.send({"type": "websocket.close", "code": 1008})
        await send_error(self.send, "bad_host", message)


class ApiKeyCheck:
    """ASGI middleware: with an `api_key`, a request without it gets 401 and a challenge (Bearer for the API,
    HTTP Basic for the UI, so that a browser asks for it); the health paths pass, marked `authorized` or not.

    Args:
        app: the ASGI app to wrap.
        api_key: the key clients must send (empty: no key needed).
    """

    def __init__(self, app, api_key: str = ""):
        self.app, self.api_key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        refused = key_refusal(self.api_key, scope["headers"], HTTP_KEY_HINT)
        path = scope["path"]
        if refused is None or path in HEALTH_PATHS:
            scope.setdefault("state", {})[AUTHORIZED] = refused is None
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # none of ours; refused like any request
            return await send({"type": "websocket.close", "code": 1008})
        api = path.startswith(API_PREFIXES)
        challenge = 'Bearer realm="vitscope"' if api else 'Basic realm="vitscope", charset="UTF-8"'
        await send_error(send, "unauthorized", refused, {"WWW-Authenticate": challenge})
