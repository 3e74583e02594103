"""Who may ask, for every transport: the API key a client sent (HTTP headers or gRPC metadata), checked in
constant time, and the request IDs that tie a request's answer, log line and payload record together.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import itertools
import os
import re
from collections.abc import Iterable

SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
# How to send the key, in each transport's words: a refusal tells the client what to do in the terms it uses
HTTP_KEY_HINT = (
    "send it as 'Authorization: Bearer <key>' or 'X-API-Key: <key>' (in a browser, as the password of the login prompt)"
)
GRPC_KEY_HINT = "send it in the call's metadata as 'authorization: Bearer <key>' or 'x-api-key: <key>'"
KEY_HEADERS = (b"x-api-key", b"authorization")


def key_of(headers: dict[bytes, bytes]) -> str | None:
    """The key a client sent: `Authorization: Bearer <key>`, `X-API-Key: <key>`, or HTTP Basic's password
    (what a browser sends for the UI after its login prompt). gRPC metadata arrives as the same lower-case
    names."""
    if b"x-api-key" in headers:
        return headers[b"x-api-key"].decode("latin-1").strip()
    scheme, _, value = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


def key_refusal(expected: bytes, headers: Iterable[tuple[bytes, bytes]], hint: str) -> str | None:
    """Why a request with these headers may not pass (no key, a wrong one, a key header sent twice), or None when
    it may. Of two copies of a header, no one is the client's key: a proxy that adds its own may put it first.

    Args:
        expected: the server's key, UTF-8 (empty: no key needed).
        headers: the request's headers or metadata as (name, value) pairs, lower-case names.
        hint: how to send the key in the caller's transport (`HTTP_KEY_HINT`, `GRPC_KEY_HINT`), added to the refusal.
    """
    if not expected:
        return None
    sent: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in KEY_HEADERS:
            if name in sent:
                return f"{name.decode()!r} sent twice: {hint}"
            sent[name] = value
    key = key_of(sent)
    if key is not None and hmac.compare_digest(key.encode("utf-8"), expected):
        return None
    return f"{'no API key' if key is None else 'a wrong API key'}: {hint}"


class RequestIds:
    """A request's ID: the client's own when it is sane, else a new one as long as a UUID's hex, made without a
    system call per request (a random prefix and a counter)."""

    def __init__(self):
        self.prefix, self.count = os.urandom(10).hex(), itertools.count()

    def __call__(self, given: str = "") -> str:
        return given if given and SANE_REQUEST_ID.fullmatch(given) else f"{self.prefix}{next(self.count):012x}"
