"""Checks on an untrusted .onnx file before onnxruntime sees it, in pure Python (no onnx, no torch).

An ONNX file is a protobuf message. We walk its wire format just far enough to find tensors that
point at external data files (a model that would read other files from disk when loaded) and to
say clearly when the file is truncated or not an ONNX model at all, instead of a protobuf traceback.
Nothing is unpickled: protobuf is plain data. The metadata helpers at the end read what onnxruntime found.

Both walks are bounded, so that no file can exhaust the interpreter's stack: subgraphs (If and Loop bodies)
nest at most `MAX_GRAPH_DEPTH` levels and a metadata value at most `MAX_METADATA_DEPTH`. Whatever is wrong
with a file, the caller sees one exception, `ModelFileError`, whose message says what and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from serve.runtime.image_files import link_loop

# Field numbers from onnx.proto (stable since IR version 3).
_MODEL_GRAPH, _MODEL_METADATA, _MODEL_FUNCTIONS = 7, 14, 25
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15
_FUNCTION_NODE = 7
_NODE_ATTRIBUTE = 5
_ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE, _ATTR_SPARSES = 5, 6, 10, 11, 22, 23
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL
# vit-export nests subgraphs two deep at most (the explain branch's If); deeper nesting only serves an attack
MAX_GRAPH_DEPTH = 32
# vit-export's metadata nests four deep (calibration -> ood -> means -> a row); JSON allows any depth
MAX_METADATA_DEPTH = 16
# the largest value vit-export writes is the Mahalanobis precision, D x D numbers as JSON text
MAX_METADATA_VALUE_CHARS = 64 << 20
MAX_METADATA_ENTRIES = 1024
AGAIN = "export it again with vit-export"
ZIP_MAGIC = b"PK\x03\x04"  # what torch.save writes (a zip archive)
T = TypeVar("T")


class ModelFileError(ValueError):
    """A model file we refuse to load; the message says why and what to do."""


def read_model_bytes(path: str | Path, max_bytes: int = 4 << 30) -> bytes:
    """Read an .onnx file and check it is a self-contained ONNX model.

    Args:
        path: the .onnx file.
        max_bytes: refuse larger files (protobuf cannot hold more than 2 GiB inline anyway).

    Returns:
        The file's bytes, ready for `onnxruntime.InferenceSession(bytes)`.

    Raises:
        FileNotFoundError: the path does not exist.
        ModelFileError: a folder, a link that loops; empty, truncated, not ONNX, or with external data references.
    """
    path = Path(path)
    if path.is_dir():
        raise ModelFileError(f"{path} is a folder, not a model file: give the .onnx file")
    if path.exists() and not path.is_file():  # reading a named pipe would wait for a writer for ever
        raise ModelFileError(f"{path} is not a regular file (a named pipe, socket or device): give the .onnx file")
    if why := link_loop(path):  # is_file says False, as for a path that is not there
        raise ModelFileError(why)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ModelFileError(f"{path} is empty (0 bytes); export a model with vit-export")
    if size > max_bytes:
        raise ModelFileError(f"{path} is {size:,} bytes, over the {max_bytes:,}-byte limit")
    data = path.read_bytes()
    check_model_bytes(data, str(path))
    return data


def check_model_bytes(data: bytes, name: str = "model") -> None:
    """Raise `ModelFileError` unless `data` parses as an ONNX model with every tensor stored inline."""
    if bytes(data[:4]) == ZIP_MAGIC:  # no protobuf starts so: field 10 and its varint, then a tag of field 0
        raise ModelFileError(
            f"{name} is a zip archive, as a PyTorch or Lightning checkpoint is, not an ONNX file: export the "
            "checkpoint first (vit-export CHECKPOINT -o model.onnx) and give the .onnx file"
        )
    try:
        fields = _fields(memoryview(data))  # views, not copies, of the large weight blobs
        graphs = [v for f, v in fields if f == _MODEL_GRAPH]
        if not graphs:
            raise ModelFileError(f"{name} is not an ONNX model (no graph found); export one with vit-export")
        for g in graphs:
            _check_graph(g)
        for f, v in fields:
            if f == _MODEL_FUNCTIONS:
                for nf, nv in _fields(v):
                    if nf == _FUNCTION_NODE:
                        _check_node(nv)
    except (_WireError, TypeError) as e:  # TypeError: a varint where a message belongs
        raise ModelFileError(f"{name} is truncated or not an ONNX file ({e}); {AGAIN}") from None
    except _TooDeep:
        raise ModelFileError(
            f"{name} has subgraphs (If or Loop bodies) nested deeper than {MAX_GRAPH_DEPTH} levels, which no "
            f"exported classifier needs; {AGAIN}"
        ) from None
    except _ExternalData:
        raise ModelFileError(
            f"{name} refers to external data files; vitscope only loads self-contained models "
            "(export with vit-export, which writes one file)"
        ) from None


def read_metadata(data: bytes) -> dict[str, str]:
    """The model's `metadata_props` as a dict, straight from the wire format (before any session exists)."""
    out = {}
    try:
        for field, value in _fields(memoryview(data)):
            if field == _MODEL_METADATA and isinstance(value, memoryview):
                entry = {f: bytes(v).decode("utf-8", "replace") for f, v in _fields(value) if isinstance(v, memoryview)}
                out[entry.get(1, "")] = entry.get(2, "")  # StringStringEntryProto: key = 1, value = 2
    except (_WireError, TypeError):
        return {}
    return out


class _WireError(Exception):
    pass


class _ExternalData(Exception):
    pass


class _TooDeep(Exception):
    pass


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(data):
            raise _WireError("unexpected end of data")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise _WireError("malformed varint")


def _fields(data: memoryview) -> list[tuple[int, memoryview | int]]:
    """One level of a protobuf message: (field number, a view for length-delimited / int otherwise)."""
    out, i, n = [], 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise _WireError("field number 0")
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = 0, i + 8
        elif wire == 2:
            length, i = _varint(data, i)
            if i + length > n:
                raise _WireError(f"field {field} runs past the end of the data")
            value, i = data[i : i + length], i + length
        elif wire == 5:
            value, i = 0, i + 4
        else:
            raise _WireError(f"unsupported wire type {wire}")
        if i > n:
            raise _WireError("unexpected end of data")
        out.append((field, value))
    return out


def _check_tensor(data: memoryview) -> None:
    for f, v in _fields(data):
        if f == _TENSOR_EXTERNAL_DATA or (f == _TENSOR_DATA_LOCATION and v == _EXTERNAL):
            raise _ExternalData


def _check_sparse(data: memoryview) -> None:
    for f, v in _fields(data):
        if f in (_SPARSE_VALUES, _SPARSE_INDICES):
            _check_tensor(v)


def _check_graph(data: memoryview, depth: int = 0) -> None:
    if depth > MAX_GRAPH_DEPTH:
        raise _TooDeep
    for f, v in _fields(data):
        if f == _GRAPH_INITIALIZER:
            _check_tensor(v)
        elif f == _GRAPH_SPARSE_INITIALIZER:
            _check_sparse(v)
        elif f == _GRAPH_NODE:
            _check_node(v, depth)


def _check_node(data: memoryview, depth: int = 0) -> None:
    for f, v in _fields(data):
        if f != _NODE_ATTRIBUTE:
            continue
        for af, av in _fields(v):
            if af in (_ATTR_T, _ATTR_TENSORS):
                _check_tensor(av)
            elif af in (_ATTR_G, _ATTR_GRAPHS):
                _check_graph(av, depth + 1)
            elif af in (_ATTR_SPARSE, _ATTR_SPARSES):
                _check_sparse(av)


def static_dims(shape: list | None, start: int, stop: int) -> list[int] | None:
    """shape[start:stop] when those dimensions are fixed numbers (None when the graph leaves any open)."""
    dims = list(shape or [])[start:stop]
    return dims if len(dims) == stop - start and all(isinstance(d, int) for d in dims) else None


def shown(value: Any, limit: int = 60) -> str:
    """A metadata value for an error message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def class_names_of(value: Any, path: Path) -> list[str]:
    """The metadata's class names: a JSON list of strings, never a bare string read one label per character."""
    names = [str(c) for c in value] if isinstance(value, list) and all(isinstance(c, (str, int)) for c in value) else []
    if not names or len(set(names)) < len(names) or not all(n.strip() for n in names):
        raise ModelFileError(
            f"{path} has invalid class_names metadata {shown(value)}: expected a JSON list of distinct names, "
            f'none empty, e.g. ["cat", "dog"]; {AGAIN}'
        )
    return names


def parse_metadata(raw: dict[str, str], name: str = "model") -> dict[str, Any]:
    """`metadata_props` as written by `vit-export`: JSON values parsed, plain strings kept as they are.

    Raises:
        ModelFileError: too many entries, a value too long, or one nested deeper than `MAX_METADATA_DEPTH`.
    """
    if len(raw) > MAX_METADATA_ENTRIES:
        raise ModelFileError(f"{name} has {len(raw):,} metadata entries, over {MAX_METADATA_ENTRIES:,}; {AGAIN}")
    out = {}
    for key, value in raw.items():
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ModelFileError(f"{name}: its {key!r} metadata is {len(value):,} characters long; {AGAIN}")
        try:
            parsed = json.loads(value)
        except RecursionError:
            parsed = _TOO_DEEP
        except ValueError:
            parsed = value
        if parsed is _TOO_DEEP or _too_deep(parsed):
            raise ModelFileError(
                f"{name}: its {key!r} metadata is nested deeper than {MAX_METADATA_DEPTH} levels, which vit-export "
                f"never writes; {AGAIN}"
            )
        out[key] = parsed
    return out


_TOO_DEEP = object()


def _too_deep(value: Any) -> bool:
    """Whether lists and dicts nest deeper than `MAX_METADATA_DEPTH` in `value` (walked without recursion)."""
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        v, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


def metadata_value(m: dict[str, Any], key: str, convert: Callable[[Any], T], path: Path, default: Any = ...) -> T:
    """`convert(m[key])`, or `default` when the key is absent and a default is given.

    Raises:
        ModelFileError: the key is missing (and required), or `convert` refused its value; the message names it.
    """
    if key not in m:
        if default is not ...:
            return default
        raise ModelFileError(f"{path} has no {key!r} metadata; {AGAIN}")
    try:
        return convert(m[key])
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise ModelFileError(f"{path} has invalid {key!r} metadata {shown(m[key])} ({e}); {AGAIN}") from None


def whole(minimum: int = 0) -> Callable[[Any], int]:
    """A converter for `metadata_value`: an integer of at least `minimum` (JSON true and 2.5 are refused)."""

    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected a whole number of at least {minimum}")
        return value

    return convert


def size_pair(value: Any) -> tuple[int, int]:
    """A converter for `metadata_value`: [H, W], two positive integers."""
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError("expected [height, width]")
    return whole(1)(value[0]), whole(1)(value[1])


def mapping(value: Any) -> dict:
    """A converter for `metadata_value`: a JSON object."""
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def choice(*options: str) -> Callable[[Any], str]:
    """A converter for `metadata_value`: one of `options`."""

    def convert(value: Any) -> str:
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return value

    return convert


def numbers(count: int) -> Callable[[Any], list[float]]:
    """A converter for `metadata_value`: a list of `count` numbers."""

    def convert(value: Any) -> list[float]:
        if not isinstance(value, list) or len(value) != count or any(isinstance(x, (bool, str)) for x in value):
            raise ValueError(f"expected a list of {count} numbers")
        return [float(x) for x in value]

    return convert


def check_consistency(path: Path, facts: list[tuple[str, Any, str, Any]]) -> None:
    """Raise `ModelFileError` unless each (name, value, other, expected) agrees (None: nothing to compare).

    The metadata repeats some facts for clients (input size, mean/std, grid): they must agree with each other
    and with the graph, or an edited file would give wrong answers instead of an error.
    """
    for name, value, other, expected in facts:
        if expected is not None and value != expected:
            raise ModelFileError(
                f"{path} has inconsistent metadata: {name} is {value} but {other} is {expected}; "
                "the file was edited after export: export the checkpoint again with vit-export"
            )


def check_token_count(path: Path, grid_size: tuple[int, int], num_prefix_tokens: int, attns: Any) -> Any:
    """`attns` (..., N, N), refused when the metadata's prefix tokens and patch grid do not count its N tokens: an
    edited file would fail in numpy's words, or draw its maps on the wrong tokens."""
    (gh, gw), P, N = grid_size, num_prefix_tokens, attns.shape[-1]
    if P + gh * gw != N:
        raise ModelFileError(
            f"{path.name}: its metadata gives {P} prefix token(s) and a {gh} x {gw} patch grid, but its attention "
            f"maps are over {N} tokens: the metadata does not describe the graph; {AGAIN}"
        )
    return attns


def graph_io(path: Path, session: Any) -> tuple[list, list]:
    """The shapes of the graph's `pixels` input (uint8) and `logits` output; `ModelFileError` when it has no such
    input or output: another graph, carrying a vitscope file's metadata."""
    pixels = next((i for i in session.get_inputs() if i.name == "pixels"), None)
    logits = next((o for o in session.get_outputs() if o.name == "logits"), None)
    if pixels is None or pixels.type != "tensor(uint8)" or logits is None:
        raise ModelFileError(
            f"{path.name} has no uint8 'pixels' input and 'logits' output, as vit-export writes them: its metadata "
            f"is another graph's; {AGAIN}"
        )
    return pixels.shape, logits.shape
