"""The OpenAPI document, made to tell the truth: every body the server sends and every error it can answer.

FastAPI's generated document knows neither our error body (it documents 422 as `{"detail": ...}`) nor
the errors raised outside its validation (404, 405, 413, ...), thinks `/metrics` is JSON, and leaves out the plain
classify routes (`serve.server.api.v1`).
`describe(app, ...)` replaces `app.openapi` with the generated document corrected on each of those points,
with the server's upload limits in the classify routes' descriptions.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from serve.server.errors import ERROR_STATUS
from serve.server.settings import RequestLimits

ERROR = {"$ref": "#/components/schemas/Error"}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "enum": sorted(ERROR_STATUS)},
                "message": {"type": "string", "description": "what is wrong and what to do"},
            },
        }
    },
}
KSERVE_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {"type": "string", "description": "what is wrong and what to do"},
        "code": {"type": "string", "enum": sorted(ERROR_STATUS)},
    },
    "description": "the KServe v2 protocol's error body, from the /v2 routes themselves",
}
# /v2 routes answer in the protocol's shape; what stops a request before them (Host, key, limits) in ours
V2_ERROR = {"anyOf": [ERROR, {"$ref": "#/components/schemas/KServeError"}]}
WHY = {
    400: "the Host header is not served here (--allowed-hosts)",
    401: "no API key, or a wrong one",
    404: "no such model or route",
    405: "a method the path does not take (see Allow)",
    408: "the request head did not arrive in time",
    413: "the body or the image is over the limit",
    415: "not an image, or a content type that cannot carry one",
    422: "a parameter, tensor or image that cannot be used",
    431: "the request head is too large",
    500: "a fault of the server",
    503: "busy, not ready, shutting down or too many connections (see Retry-After)",
    504: "no result in time",
}
LOAD_FAILED = "; or the model failed to load (the answer gives its reason: a broken file, a bad config.pbtxt, ...)"
ONE_FILE = "; or a server of one file, which neither loads nor unloads (a repository folder does)"


def describe(app: FastAPI, limits: RequestLimits, model_name: str, auth: bool, plain: tuple[dict, dict]) -> None:
    """Make `app.openapi()` return the corrected document (built once, on first use).

    Args:
        plain: (path items, the schemas they refer to) of the plain Starlette routes, which FastAPI does not
            describe (`serve.server.api.v1.classify_openapi`).
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            paths, schemas = plain
            doc["paths"] = {**paths, **doc["paths"]}
            doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            app.openapi_schema = corrected(doc, limits, model_name, auth)
        return app.openapi_schema

    app.openapi = openapi


def corrected(doc: dict[str, Any], limits: RequestLimits, model_name: str, auth: bool) -> dict[str, Any]:
    """`doc` with /metrics as text, our error body on every error status, and the
    served model's name as the example of every `{name}`."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"], schemas["KServeError"] = ERROR_SCHEMA, KSERVE_ERROR
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]
    metrics["content"] = {"text/plain": {"schema": {"type": "string"}}}
    for path, item in doc["paths"].items():
        if path.endswith("/classify"):
            limit = f" Up to {limits.max_bytes:,} bytes and {limits.max_pixels:,} pixels."
            item["post"]["description"] = item["post"].get("description", "") + limit
        for method, op in item.items():
            op["responses"] = {**op["responses"], **error_responses(path, method, op, auth)}
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] == "name":
                    param["example"] = model_name
    return doc


def error_responses(path: str, method: str, op: dict[str, Any], auth: bool) -> dict[str, Any]:
    """The error statuses `method path` can answer, each with our error body."""
    health = path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready")
    statuses = {405, 408, 431, 500, 503}
    if not health:
        statuses |= {400} | ({401} if auth else set())
    if "{" in path:
        statuses.add(404)
    if op.get("parameters") or op.get("requestBody"):
        statuses.add(422)
    if method == "post":
        statuses |= {413, 415, 422, 504}
    schema = V2_ERROR if path.startswith("/v2/") else ERROR
    why = {**WHY, 400: WHY[400] + LOAD_FAILED + ONE_FILE} if path.endswith("/load") else WHY
    why = {**WHY, 400: WHY[400] + ONE_FILE} if path.endswith("/unload") else why
    return {
        str(s): {"description": why[s], "content": {"application/json": {"schema": schema}}} for s in sorted(statuses)
    }
