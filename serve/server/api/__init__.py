"""The API routes: /v1 (vitscope's own), KServe v2 with its tensor codecs, and the OpenAPI document."""
