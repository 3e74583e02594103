"""Multipart bodies: the one-file shortcut (`only_file`) against python-multipart (`parse_parts`)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from serve.server.errors import ApiError
from serve.server.http.uploads import only_file, parse_multipart, parse_parts

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + b"\r\n--\r\n\r\n"  # line breaks and dashes inside the data


def full_parse(body: bytes, boundary: bytes):
    try:
        return parse_parts(body, boundary)
    except ApiError as e:
        return e.code


CLIENTS = {  # (the start of the part's headers, the boundary) as each writes them
    "curl -F file=@x.png": (b"", "------------------------d74496d66958873e"),
    "Chromium's FormData": (b"", "----WebKitFormBoundary7MA4YWxkTrZu0gW"),
    "Content-Type before Content-Disposition": (b"Content-Type: image/png\r\n", "d54ad786d0e70f8810643099ea8ad0cc"),
}


@pytest.mark.parametrize("client", ["httpx", *CLIENTS])
def test_the_bodies_real_clients_send_take_the_shortcut_and_parse_alike(client):
    if client == "httpx":
        r = httpx.Request("POST", "http://h/", files={"file": ("x.png", IMAGE, "image/png")})
        body, ctype = r.read(), r.headers["content-type"]
    else:
        first, b = CLIENTS[client]
        head = f"--{b}\r\n".encode() + first + b'Content-Disposition: form-data; name="file"; filename="x.png"\r\n'
        head += b"" if first else b"Content-Type: image/png\r\n"
        body, ctype = head + b"\r\n" + IMAGE + f"\r\n--{b}--\r\n".encode(), f"multipart/form-data; boundary={b}"
    boundary = ctype.split("boundary=")[1].encode()
    assert only_file(body, boundary) == IMAGE
    assert parse_multipart(body, ctype) == parse_parts(body, boundary) == (IMAGE, {})


TOKEN = st.text("abcXYZ019-_'.", min_size=1, max_size=12)
DISPOSITIONS = st.sampled_from([
    b'form-data; name="file"; filename="x.png"', b'form-data; name="file"', b'form-data; name="top_k"',
    b"form-data; name=file; filename=x.png", b'form-data; filename="x.png"; name="file"', b"", b"form-data",
    b'form-data; name="file"; filename="a\\"b.png"', b'form-data; name="fil"; filename="x.png"',
    b'form-data; name="file"; filename="' + b"a" * 5000 + b'.png"',
])  # fmt: skip
NAMES = st.sampled_from([b"Content-Disposition: ", b"content-disposition:"])
DISPOSITION = st.builds(bytes.__add__, NAMES, DISPOSITIONS)
OTHER_HEADERS = [
    b"Content-Type: image/png",
    b"X-Extra:  spaced ",
    b"Content-Type: text/plain; charset=utf-8",
    b"X-Pad: " + b"a" * 1017,
    b"X-Pad: " + b"a" * 5000,
]  # python-multipart refuses a header over 4 KiB
BAD_HEADERS = [b"Bad Header: x", b": empty name", b"NoColon", b""]
# mostly bodies the shortcut takes (the well-formed choice weighted), so that the comparison runs on many of them
HEADERS = st.lists(st.one_of(DISPOSITION, DISPOSITION, st.sampled_from(OTHER_HEADERS + BAD_HEADERS)), max_size=6)
PIECES = [b"x", b"\r\n", b"--", b"\r\n--", b"BOUNDARY", b"\r\n\r\n", b"\0\xff"]
PREAMBLES, HEAD_ENDS, CLOSES = (
    [b""] * 4 + [b"\r\n", b"junk\r\n"],
    [b"\r\n\r\n"] * 4 + [b"\r\n", b""],
    [b"\r\n"] * 3 + [b""],
)


@settings(max_examples=1000, deadline=None, database=None, derandomize=True)  # the same bodies on every run
@given(
    boundary=TOKEN.map(str.encode),
    headers=HEADERS,
    data=st.lists(st.sampled_from(PIECES), max_size=6),
    extra_part=st.booleans(),
    ends=st.tuples(st.sampled_from(PREAMBLES), st.sampled_from(HEAD_ENDS)),
    close=st.sampled_from(CLOSES),
    epilogue=st.sampled_from([b"", b"\r\n", b"\r\n\r\n", b"tail", b"\r\n--"]),
)
# two bodies random ones rarely reach: the file under another field's name; no line break before the delimiter
@example(
    b"B", [b'Content-Disposition: form-data; name="fil"; filename="x.png"'], [], False, (b"", b"\r\n\r\n"), b"\r\n", b""
)
@example(
    b"B", [b'Content-Disposition: form-data; name="file"; filename="x.png"'], [], False, (b"", b"\r\n\r\n"), b"", b""
)
def test_whatever_the_shortcut_returns_python_multipart_returns_too(
    boundary, headers, data, extra_part, ends, close, epilogue
):
    delim, (preamble, head_end) = b"--" + boundary, ends
    payload = b"".join(delim if d == b"BOUNDARY" else d for d in data)
    body = preamble + delim + b"\r\n" + b"\r\n".join(headers) + head_end + payload
    if extra_part:
        body += b"\r\n" + delim + b'\r\nContent-Disposition: form-data; name="top_k"\r\n\r\n3'
    body += close + delim + b"--" + epilogue
    shortcut = only_file(body, boundary)
    if shortcut is not None:
        assert full_parse(body, boundary) == (shortcut, {})
