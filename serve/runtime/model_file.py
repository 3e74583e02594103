"""Checks on an untrusted .onnx file before onnxruntime sees it, in pure Python (no onnx, no torch).

An ONNX file is a protobuf message. We walk its wire format just far enough to find tensors that
point at external data files (a model that would read other files from disk when loaded) and to
say clearly when the file is truncated or not an ONNX model at all, instead of a protobuf traceback.
Nothing is unpickled: protobuf is plain data. The metadata helpers at the end read what onnxruntime found.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Field numbers from onnx.proto (stable since IR version 3).
_MODEL_GRAPH, _MODEL_METADATA, _MODEL_FUNCTIONS = 7, 14, 25
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15
_FUNCTION_NODE = 7
_NODE_ATTRIBUTE = 5
_ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE, _ATTR_SPARSES = 5, 6, 10, 11, 22, 23
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


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
        ModelFileError: empty, truncated, not ONNX, or with external data references.
    """
    path = Path(path)
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
        raise ModelFileError(
            f"{name} is truncated or not an ONNX file ({e}); export it again with vit-export"
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


def _check_graph(data: memoryview) -> None:
    for f, v in _fields(data):
        if f == _GRAPH_INITIALIZER:
            _check_tensor(v)
        elif f == _GRAPH_SPARSE_INITIALIZER:
            _check_sparse(v)
        elif f == _GRAPH_NODE:
            _check_node(v)


def _check_node(data: memoryview) -> None:
    for f, v in _fields(data):
        if f != _NODE_ATTRIBUTE:
            continue
        for af, av in _fields(v):
            if af in (_ATTR_T, _ATTR_TENSORS):
                _check_tensor(av)
            elif af in (_ATTR_G, _ATTR_GRAPHS):
                _check_graph(av)
            elif af in (_ATTR_SPARSE, _ATTR_SPARSES):
                _check_sparse(av)


def static_dims(shape: list | None, start: int, stop: int) -> list[int] | None:
    """shape[start:stop] when those dimensions are fixed numbers (None when the graph leaves any open)."""
    dims = list(shape or [])[start:stop]
    return dims if len(dims) == stop - start and all(isinstance(d, int) for d in dims) else None


def class_names_of(value: Any, path: Path) -> list[str]:
    """The metadata's class names: a JSON list of strings, never a bare string read one label per character."""
    if not isinstance(value, list) or not value or not all(isinstance(c, (str, int)) for c in value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(
            f"{path} has invalid class_names metadata {shown}: expected a JSON list of names, "
            'e.g. ["cat", "dog"]; export the checkpoint again with vit-export'
        )
    return [str(c) for c in value]


def parse_metadata(raw: dict[str, str]) -> dict[str, Any]:
    """`metadata_props` as written by `vit-export`: JSON values parsed, plain strings kept as they are."""

    def parse(value: str) -> Any:
        try:
            return json.loads(value)
        except ValueError:
            return value

    return {k: parse(v) for k, v in raw.items()}
