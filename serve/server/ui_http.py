"""HTTP-level limits of the Gradio UI's routes, as ASGI middleware (no gradio import)."""

from __future__ import annotations

import json

from serve.server.errors import ERROR_STATUS

FORM_OVERHEAD = 64 * 1024  # multipart boundaries and headers around the file itself


class CallErrorsAre422:
    """ASGI middleware: Gradio's direct call routes (`/gradio_api/run/<name>`, `/gradio_api/api/<name>`)
    answer 500 for any failed call, a malformed one included (too few inputs, a value of the wrong type).
    Our handlers raise `gr.Error` for every input they refuse, so a failed call is the caller's to fix: 422,
    with Gradio's message in our error body. (Queued calls report failures in their event stream.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(("/gradio_api/run/", "/gradio_api/api/")):
            return await self.app(scope, receive, send)
        failed = False

        async def send_422(message):
            nonlocal failed
            if message["type"] == "http.response.start" and message["status"] == 500:
                failed = True
                return
            if not failed:
                return await send(message)
            if not message.get("more_body"):
                try:
                    said = json.loads(message.get("body", b"") or b"{}").get("error")
                except (ValueError, AttributeError):
                    said = None
                await _send_error(send, "bad_request", f"the call failed: {said or 'check its inputs'}")

        await self.app(scope, receive, send_422)


class NoVersionInGradioOpenapi:
    """ASGI middleware: Gradio's own OpenAPI document (`/gradio_api/openapi.json`) gives its exact version
    as the document's version, which tells an attacker which advisories apply; it is cut to the major."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/gradio_api/openapi.json":
            return await self.app(scope, receive, send)
        # uncompressed, so that it can be read here (Gradio gzips what the client accepts gzipped)
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"accept-encoding"]}
        start, chunks = None, []

        async def rewrite(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return None
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return None
            body = b"".join(chunks)
            if start["status"] == 200:
                doc = json.loads(body)
                doc.get("info", {})["version"] = str(doc.get("info", {}).get("version", "")).split(".")[0]
                body = json.dumps(doc).encode()
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


class UploadLimit:
    """ASGI middleware: a request to Gradio's upload route must declare its length, within `max_bytes` in
    all (Gradio's own limit is per file, and one request may carry many files)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes + FORM_OVERHEAD

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/gradio_api/upload") and scope["method"] == "POST":
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if not declared.isdigit():
                return await _send_error(send, "length_required", "uploads must declare their Content-Length")
            if int(declared) > self.max_bytes:
                message = f"an upload of {int(declared):,} bytes is over the {self.max_bytes:,}-byte limit"
                return await _send_error(send, "body_too_large", message)
        await self.app(scope, receive, send)


async def _send_error(send, code: str, message: str) -> None:
    status = ERROR_STATUS[code]
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
