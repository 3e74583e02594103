"""Multipart bodies as clients send them, and the malformed ones, through python-multipart (`parse_multipart`)."""

from __future__ import annotations

import httpx
import pytest

from serve.server.errors import ApiError
from serve.server.http.uploads import MAX_FIELD_BYTES, parse_multipart

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + b"\r\n--\r\n\r\n"  # line breaks and dashes inside the data


CLIENTS = {  # (the start of the part's headers, the boundary) as each writes them
    "curl -F file=@x.png": (b"", "------------------------d74496d66958873e"),
    "Chromium's FormData": (b"", "----WebKitFormBoundary7MA4YWxkTrZu0gW"),
    "Content-Type before Content-Disposition": (b"Content-Type: image/png\r\n", "d54ad786d0e70f8810643099ea8ad0cc"),
}


def body_of(parts: list[tuple[bytes, bytes]], boundary: str = "B") -> tuple[bytes, str]:
    """A multipart body of (headers, data) parts, and its Content-Type."""
    delim = f"--{boundary}".encode()
    body = b"".join(delim + b"\r\n" + head + b"\r\n\r\n" + data + b"\r\n" for head, data in parts) + delim + b"--\r\n"
    return body, f"multipart/form-data; boundary={boundary}"


FILE = b'Content-Disposition: form-data; name="file"; filename="x.png"'


@pytest.mark.parametrize("client", ["httpx", *CLIENTS])
def test_the_bodies_real_clients_send_give_the_file(client):
    if client == "httpx":
        r = httpx.Request("POST", "http://h/", files={"file": ("x.png", IMAGE, "image/png")})
        body, ctype = r.read(), r.headers["content-type"]
    else:
        first, b = CLIENTS[client]
        head = f"--{b}\r\n".encode() + first + b'Content-Disposition: form-data; name="file"; filename="x.png"\r\n'
        head += b"" if first else b"Content-Type: image/png\r\n"
        body, ctype = head + b"\r\n" + IMAGE + f"\r\n--{b}--\r\n".encode(), f"multipart/form-data; boundary={b}"
    assert parse_multipart(body, ctype) == (IMAGE, {})


def test_text_fields_come_back_beside_the_file():
    body, ctype = body_of([(b'Content-Disposition: form-data; name="top_k"', b"3"), (FILE, IMAGE)])
    assert parse_multipart(body, ctype) == (IMAGE, {"top_k": "3"})


@pytest.mark.parametrize(
    "parts, ctype, says",
    [
        ([(FILE, IMAGE)], "multipart/form-data", "no boundary"),
        ([(b'Content-Disposition: form-data; name="fil"; filename="x.png"', IMAGE)], None, "named 'file'"),
        ([(b'Content-Disposition: form-data; name="file"', IMAGE)], None, "named 'file'"),  # a text field
        ([(FILE, IMAGE), (FILE, IMAGE)], None, "one file"),
        ([(b"Content-Disposition: form-data", IMAGE)], None, "no name"),
        ([(b'Content-Disposition: form-data; name="t"', b"a" * (MAX_FIELD_BYTES + 1)), (FILE, IMAGE)], None, "over"),
        ([(FILE + b"\r\nX-Pad: " + b"a" * 5000, IMAGE)], None, "cannot be parsed"),  # a header over 4 KiB
    ],
)
def test_malformed_bodies_are_refused_with_a_reason(parts, ctype, says):
    body, own = body_of(parts)
    with pytest.raises(ApiError, match=says) as err:
        parse_multipart(body, ctype or own)
    assert err.value.code == "bad_request"
