"""HTTP-level limits of the Gradio UI's routes, as ASGI middleware (no gradio import)."""

from __future__ import annotations

import json
import logging
import os
import time

from anyio import to_thread

from serve.runtime.temp_dirs import LOCK
from serve.server.errors import ECHO_CHARS
from serve.server.http.errors import send_error
from serve.server.settings import UI_CALL_RESULT_BYTES, UI_FORM_OVERHEAD

log = logging.getLogger(__name__)


GRADIO_ROUTES = "/gradio_api/"
# Gradio's routes that make a call: direct (`run`, `api`), queued (`call`, with its event stream) and the
# browser's own (`queue/join`, `queue/data`); and its upload route
CALL_ROUTES = ("/gradio_api/run/", "/gradio_api/api/", "/gradio_api/call/", "/gradio_api/queue/")
UPLOAD_ROUTE = "/gradio_api/upload"
# Gradio's routes that write what they are sent to $TMPDIR, outside the UI's folder and its limit, for components
# the page has none of (a microphone or webcam recording)
UNUSED_ROUTES = ("/gradio_api/process_recording",)
BODY_METHODS = ("POST", "PUT", "PATCH")
# Gradio's own refusals on its routes, as our codes (`ERROR_STATUS`), and what the client can do about each
GRADIO_ERRORS = {
    400: ("malformed_request", "check the request against the UI's API (/gradio_api/info)"),
    401: ("unauthorized", "send the API key"),
    403: ("forbidden", "the UI serves only the files uploaded to it and the results of its calls"),
    404: ("not_found", "the UI serves only its own routes and files; see /gradio_api/info"),
    405: ("method_not_allowed", "use the method the route takes (/gradio_api/info)"),
    408: ("request_timeout", "send the whole request sooner"),
    411: ("length_required", "declare the body's Content-Length"),
    413: ("body_too_large", "send a smaller file (--max-bytes)"),
    415: ("unsupported_media_type", "send JSON to the call routes and multipart/form-data to the upload route"),
    422: ("bad_request", "check the request against the UI's API (/gradio_api/info)"),
    503: ("queue_full", "retry in a few seconds"),
}
KEPT = (b"allow", b"www-authenticate")  # the headers of Gradio's refusal that its status needs (RFC 9110)
WALK_EVERY_S = 2.0  # the UI folder is walked at most this often: in between, the check uses the last walk's figure
EMPTY_FOLDER_S = 60  # an empty subfolder this old is a hash folder whose files Gradio's clean-up deleted
FOLDER_BYTES = 4096  # a folder takes at least a block (tmpfs reports none, yet holds its inode and entries)


class UiCallErrorsAsJson:
    """ASGI middleware: Gradio answers 500 for any call it cannot make, a malformed one included: too few
    inputs or a value of the wrong type (direct calls), a missing argument, an unknown endpoint name or
    function index (queued calls, whose 500 is plain text). Our handlers raise `gr.Error` for every input
    they refuse, so a failed call is the caller's to fix: 422, with Gradio's reason in our error body. (A
    queued call that fails later reports it in its event stream.) An upload with a form field where a file
    should be fails the same way, and gets 400, Gradio's own status for a malformed upload.

    Gradio's own refusals on any of its routes (`GRADIO_ERRORS`: a full queue's 503, a file path it does not serve,
    an upload of the wrong content type, a call with missing fields) answered `{"detail": ...}`: they get our error
    body too, with Gradio's reason, the same status and, on a 503, Retry-After.

    Gradio's event streams raise after their last event when the event or session is unknown, which would
    cut the stream off mid-chunk: such an error is logged and the stream ends cleanly instead."""

    def __init__(self, app, retry_after_s: int = 1):
        self.app, self.retry_after_s = app, retry_after_s

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(GRADIO_ROUTES):
            return await self.app(scope, receive, send)
        calls = path.startswith((*CALL_ROUTES, UPLOAD_ROUTE))
        started = ended = gone = False
        failed = 0  # the status of Gradio's error answer, once it gives one we answer instead
        said, kept = [], {}  # its body; its headers that we keep (`KEPT`)

        async def receive_watching():
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def watch(message):
            nonlocal started, ended, failed
            status = message.get("status") if message["type"] == "http.response.start" else None
            if status in GRADIO_ERRORS or (status == 500 and calls):
                failed = status
                kept.update((k.decode().lower(), v.decode()) for k, v in message["headers"] if k.lower() in KEPT)
            elif failed:
                said.append(message.get("body", b""))
            else:
                started = True
                ended = message["type"] == "http.response.body" and not message.get("more_body")
                await send(message)

        try:
            await self.app(scope, receive_watching, watch)
        except Exception as e:
            if gone or not calls:
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
        if failed == 500:
            await _refuse(send, path, _reason_in(b"".join(said)))
        elif failed:
            await _refused_by_gradio(scope, send, failed, _reason_in(b"".join(said)), kept, self.retry_after_s)


def _reason_in(body: bytes) -> str:
    """Gradio's reason for a failed call: the `error` (a 500) or `detail` (a refusal) of its JSON body, if it gives
    one; FastAPI's list of invalid fields as `where: what`."""
    try:
        said = json.loads(body)
        reason = said.get("error") or said["detail"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return "check its inputs"
    if isinstance(reason, list):  # FastAPI's validation errors
        fields = [f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in reason if isinstance(e, dict)]
        reason = "; ".join(fields)
    return str(reason or "check its inputs").rstrip(".")


async def _refused_by_gradio(scope, send, status: int, reason: str, kept: dict[str, str], retry_after_s: int) -> None:
    path = scope["path"]
    if status == 400 and path.startswith(UPLOAD_ROUTE):
        return await _refuse(send, path, reason)
    code, fix = GRADIO_ERRORS[status]
    reason = reason if len(reason) <= ECHO_CHARS else reason[:ECHO_CHARS] + "…"  # it may echo a path sent
    if status == 503:
        kept["retry-after"] = str(retry_after_s)
    await send_error(send, code, f"the UI refused the request ({reason}): {fix}", kept)


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
    is let through with room for its results (`UI_CALL_RESULT_BYTES`), which are written after the check.

    The folder is walked (`folder_size`) in a worker thread, at most every `WALK_EVERY_S`: one walk per request, on
    the event loop, took 0.1 s with 11,000 entries, and the API's requests waited behind it. In between, the check
    adds what it let through since the last walk to that walk's figure, so a burst overshoots by at most what was
    still being written when a walk ran. The walk removes the partial files of uploads that failed or whose client
    left once unchanged for `partial_s` (`mount_ui`: twice --body-timeout-s, past which no upload is still being
    written; None: `stale_s`)."""

    def __init__(
        self,
        app,
        max_bytes: int,
        folder: str | None = None,
        folder_bytes: int | None = None,
        stale_s: float = 3600,
        partial_s: float | None = None,
    ):
        self.app, self.max_bytes = app, max_bytes + UI_FORM_OVERHEAD
        self.folder, self.folder_bytes, self.stale_s, self.partial_s = folder, folder_bytes, stale_s, partial_s
        self.walked = self.since = 0  # the last walk's bytes; the bytes let through since it began
        self.next_walk, self.walking = 0.0, False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(UNUSED_ROUTES):
            return await send_error(send, "not_found", f"no route {scope['path']!r}: the UI takes no recordings")
        if scope["type"] == "http" and scope["path"].startswith(GRADIO_ROUTES) and scope["method"] in BODY_METHODS:
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if not (declared.isascii() and declared.isdigit()):
                return await send_error(send, "length_required", "requests to the UI must declare their Content-Length")
            if int(declared) > self.max_bytes:
                message = (
                    f"a request of {int(declared):,} bytes is over the {self.max_bytes:,}-byte limit (--max-bytes)"
                )
                return await send_error(send, "body_too_large", message)
            if self.folder and self.folder_bytes and scope["path"].startswith((UPLOAD_ROUTE, *CALL_ROUTES)):
                # an upload's files and a call's results (and its data: URL images) both go to the folder
                results = 0 if scope["path"] == UPLOAD_ROUTE else UI_CALL_RESULT_BYTES
                used = await self.used()
                if used + int(declared) + results > self.folder_bytes:
                    message = (
                        f"the UI's upload folder holds {used:,} bytes, and this request would take it past "
                        f"{self.folder_bytes:,} (--ui-cache-bytes): retry once older files go (--ui-cache-s)"
                    )
                    return await send_error(send, "insufficient_storage", message)
                self.since += int(declared) + results
        await self.app(scope, receive, send)

    async def used(self) -> int:
        """The folder's bytes: the last walk's figure and what was let through since. Walked again in a worker
        thread once `WALK_EVERY_S` has passed, one walk at a time: requests meanwhile take the last figure."""
        if not self.walking and time.monotonic() >= self.next_walk:
            self.walking, before = True, self.since
            try:
                self.walked = await to_thread.run_sync(folder_size, self.folder, self.partial_s or self.stale_s)
                self.since -= before  # what came through while it walked may be in its figure or not: still counted
            finally:
                self.walking, self.next_walk = False, time.monotonic() + WALK_EVERY_S
        return self.walked + self.since


def folder_size(folder: str, stale_s: float | None = None) -> int:
    """The disk space taken under `folder`: the blocks allocated to its files and subfolders (an 8-byte upload
    takes a block, and its hash folder another; a file deleted while it is walked takes none). On the way go:

    - empty subfolders unchanged for `EMPTY_FOLDER_S`: Gradio's clean-up deletes the files it finished, never
      their hash folders, which piled up for the server's life;
    - with `stale_s`, the files directly in `folder` unchanged for that long: the partial files of uploads that
      failed or whose client left mid-body, which Gradio's clean-up never removes.

    The server's own lock (`temp_dirs.LOCK`) stays, as old as the server."""
    total, now = 0, time.time()
    for top, dirs, files in os.walk(folder):
        if top != folder:
            total += _subfolder_bytes(top, not dirs and not files, now)
        for name in files:
            try:
                st = os.stat(path := os.path.join(top, name), follow_symlinks=False)
                stale = stale_s is not None and top == folder and now - st.st_mtime > stale_s
                if stale and name != LOCK:
                    os.unlink(path)
                    continue
                total += max(st.st_blocks * 512, st.st_size)  # a file inlined in its inode (btrfs) has no block
            except OSError:
                continue
    return total


def _subfolder_bytes(path: str, empty: bool, now: float) -> int:
    try:
        st = os.stat(path, follow_symlinks=False)
        if empty and now - st.st_mtime > EMPTY_FOLDER_S:
            os.rmdir(path)  # refused if a file came meanwhile
            return 0
        return max(st.st_blocks * 512, FOLDER_BYTES)
    except OSError:
        return 0
