"""What a file's first bytes say about it: the image formats we read (their signatures), and the phone photo
formats we do not read but name (HEIC, HEIF, AVIF), so that such a file is reported for what it is."""

from __future__ import annotations

from pathlib import Path

# Photos in formats no decoder here reads: listed with the images, so that each is reported (`unread_format`), not
# passed over in silence as a file of another kind
UNREAD_SUFFIXES = (".heic", ".heif", ".avif")
NOT_AN_IMAGE = "not an image: no JPEG, PNG, GIF, BMP, WebP or TIFF header found"
# The leading bytes of each format `serve.runtime.images` decodes; RIFF is WebP's only with WEBP at bytes 8-12
SIGNATURES = {b"\xff\xd8\xff": "JPEG", b"\x89PNG\r\n\x1a\n": "PNG", b"GIF87a": "GIF", b"GIF89a": "GIF", b"BM": "BMP"}
SIGNATURES |= {b"II*\x00": "TIFF", b"MM\x00*": "TIFF", b"RIFF": "WebP"}
# The brands (bytes 8-12, after `ftyp`) of HEIF still images and sequences (ISO/IEC 23008-12), and AVIF's: an MP4
# or a QuickTime movie is an ISO media file too, and no photo
HEIF_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"hevm", b"hevs", b"mif1", b"msf1"}
AVIF_BRANDS = {b"avif", b"avis"}


def signature_format(head: bytes) -> str | None:
    """The format we read whose signature the first bytes `head` carry, or None."""
    kind = next((kind for signature, kind in SIGNATURES.items() if head.startswith(signature)), None)
    if kind == "BMP" and head[6:10] != bytes(4):  # two letters alone: its reserved bytes, zero, tell it from text
        return None
    return None if kind == "WebP" and head[8:12] != b"WEBP" else kind


def unread_format(head: bytes) -> str | None:
    """ "HEIC or HEIF" or "AVIF" for the first bytes of such a file (an ISO media file's `ftyp` box), else None."""
    if head[4:8] != b"ftyp":
        return None
    return "AVIF" if head[8:12] in AVIF_BRANDS else "HEIC or HEIF" if head[8:12] in HEIF_BRANDS else None


def unidentified(name: str, head: bytes) -> tuple[str, str]:
    """(why, `ImageError` kind) for a file named `name` that no decoder opened, from its first bytes `head`."""
    if kind := unread_format(head):
        return f"{name} is a {kind} image, which is not read: convert it to JPEG or PNG", "unsupported"
    if kind := signature_format(head):  # the signature of one we read, and a header the decoder cannot parse
        return f"{name} is a damaged {kind} file: its header cannot be read", "corrupt"
    return f"{name} is {NOT_AN_IMAGE}", "not_an_image"


def first_bytes(path: Path, n: int = 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)
