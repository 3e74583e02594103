"""HTTP-level limits of the Gradio UI's routes, as ASGI middleware (no gradio import)."""

from __future__ import annotations

import json
import logging
import os
import time

from serve.runtime.temp_dirs import LOCK
from serve.server.http.errors import send_error
from serve.server.settings import UI_CALL_RESULT_BYTES, UI_FORM_OVERHEAD

log = logging.getLogger(__name__)


# Gradio's routes that make a call: direct (`run`, `api`), queued (`call`, with its event stream) and the
# browser's own (`queue/join`, `queue/data`); and its upload route
CALL_ROUTES = ("/gradio_api/run/", "/gradio_api/api/", "/gradio_api/call/", "/gradio_api/queue/")
UPLOAD_ROUTE = "/gradio_api/upload"
# Gradio's routes that write what they are sent to $TMPDIR, outside the UI's folder and its limit, for components
# the page has none of (a microphone or webcam recording)
UNUSED_ROUTES = ("/gradio_api/process_recording",)
BODY_METHODS = ("POST", "PUT", "PATCH")


class UiCallErrorsAsJson:
    """ASGI middleware: Gradio answers 500 for any call it cannot make, a malformed one included: too few
    inputs or a value of the wrong type (direct calls), a missing argument, an unknown endpoint name or
    function index (queued calls, whose 500 is plain text). Our handlers raise `gr.Error` for every input
    they refuse, so a failed call is the caller's to fix: 422, with Gradio's reason in our error body. (A
    queued call that fails later reports it in its event stream.) An upload with a form field where a file
    should be fails the same way, and gets 400, Gradio's own status for a malformed upload.

    Gradio's event streams raise after their last event when the event or session is unknown, which would
    cut the stream off mid-chunk: such an error is logged and the stream ends cleanly instead."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith((*CALL_ROUTES, UPLOAD_ROUTE)):
            return await self.app(scope, receive, send)
        started = ended = failed = gone = False
        said = []  # the body of Gradio's 500

        async def receive_watching():
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def watch(message):
            nonlocal started, ended, failed
            if message["type"] == "http.response.start" and message["status"] == 500:
                failed = True
            elif failed:
                said.append(message.get("body", b""))
            else:
                started = True
                ended = message["type"] == "http.response.body" and not message.get("more_body")
                await send(message)

        try:
            await self.app(scope, receive_watching, watch)
        except Exception as e:
            if gone:
                raise  # the client left, and the parser failed for it: RequestRecord logs one line, 499
            if not started:
                log.info("%s failed with %s: %s", path, type(e).__name__, e)
                return await _refuse(send, path, f"{type(e).__name__}: {e}")
            why = e.__cause__ or e  # Starlette wraps what the stream raised: "response already started"
            level = logging.INFO if getattr(why, "status_code", 500) < 500 else logging.ERROR
            log.log(level, "%s ended its answer with %s: %s", path, type(why).__name__, why)
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if failed:
            await _refuse(send, path, _reason_in(b"".join(said)))


def _reason_in(body: bytes) -> str:
    """Gradio's reason for a failed call: the `error` of its JSON body, if it gives one."""
    try:
        return str(json.loads(body)["error"] or "check its inputs")
    except (ValueError, TypeError, KeyError):
        return "check its inputs"


async def _refuse(send, path: str, reason: str) -> None:
    if path.startswith(UPLOAD_ROUTE):
        fix = "send only files, each as a form part named `files` with a filename"
        return await send_error(send, "bad_upload", f"the upload failed ({reason}): {fix}")
    await send_error(send, "bad_request", f"the call failed: {reason}")


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
    """ASGI middleware: every request with a body to Gradio's routes (its upload route, and the call and queue
    routes, whose JSON Gradio reads whole) must declare its length, within `max_bytes` in all (Gradio's own limit
    is per uploaded file, and one request may carry many files; its JSON routes have none); and an upload or a call
    that would take the UI's `folder` past `folder_bytes` is refused (507) until older files are deleted. A call
    is let through with room for its results (`UI_CALL_RESULT_BYTES`), which are written after the check."""

    def __init__(
        self, app, max_bytes: int, folder: str | None = None, folder_bytes: int | None = None, stale_s: float = 3600
    ):
        self.app, self.max_bytes = app, max_bytes + UI_FORM_OVERHEAD
        self.folder, self.folder_bytes, self.stale_s = folder, folder_bytes, stale_s

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(UNUSED_ROUTES):
            return await send_error(send, "not_found", f"no route {scope['path']!r}: the UI takes no recordings")
        if scope["type"] == "http" and scope["path"].startswith("/gradio_api/") and scope["method"] in BODY_METHODS:
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if not (declared.isascii() and declared.isdigit()):
                return await send_error(send, "length_required", "requests to the UI must declare their Content-Length")
            if int(declared) > self.max_bytes:
                message = (
                    f"a request of {int(declared):,} bytes is over the {self.max_bytes:,}-byte limit (--max-bytes)"
                )
                return await send_error(send, "body_too_large", message)
            if self.folder and self.folder_bytes and scope["path"].startswith((UPLOAD_ROUTE, *CALL_ROUTES)):
                # an upload's files and a call's results (and its data: URL images) both go to the folder; one walk
                # per request: the UI's requests are few beside the API's
                used = folder_size(self.folder, self.stale_s)
                results = 0 if scope["path"] == UPLOAD_ROUTE else UI_CALL_RESULT_BYTES
                if used + int(declared) + results > self.folder_bytes:
                    message = (
                        f"the UI's upload folder holds {used:,} bytes, and this request would take it past "
                        f"{self.folder_bytes:,} (--ui-cache-bytes): retry once older files go (--ui-cache-s)"
                    )
                    return await send_error(send, "insufficient_storage", message)
        await self.app(scope, receive, send)


def folder_size(folder: str, stale_s: float | None = None) -> int:
    """The bytes of the files under `folder` (files deleted while it is walked count as none). With `stale_s`, the
    files directly in `folder` unchanged for that long go first: the partial files of uploads whose client left
    mid-body, which Gradio's own clean-up (of the files it finished, in their hash folders) never removes."""
    total, now = 0, time.time()
    for top, _, files in os.walk(folder):
        for name in files:
            try:
                st = os.stat(path := os.path.join(top, name), follow_symlinks=False)
                stale = stale_s is not None and top == folder and now - st.st_mtime > stale_s
                if stale and name != LOCK:  # the server's own lock, as old as the server (`temp_dirs`)
                    os.unlink(path)
                    continue
                total += st.st_size
            except OSError:
                continue
    return total
