"""KServe v2 tensors on the wire: an infer request's JSON (and binary) body -> pixels, logits -> the response body.

Both JSON tensors and the binary tensor data extension (Triton's `extension_binary_data.md`, which
`tritonclient` uses by default) are read and written:

    request:  Inference-Header-Content-Length: N   (the JSON header is the first N bytes of the body)
              {"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [B, H, W, 3],
                           "parameters": {"binary_data_size": B*H*W*3}}],
               "outputs": [{"name": "logits", "parameters": {"binary_data": true}}]}  + B*H*W*3 raw bytes
    response: the same header names the length of the JSON part; each binary output carries
              "parameters": {"binary_data_size": n} instead of "data", its bytes follow the JSON in order.

Datatypes are strict: UINT8 data are JSON integers 0..255 (not strings, booleans or floats), and a
binary tensor holds exactly `shape`'s number of elements.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from serve.server.engine import judge_rows
from serve.server.errors import ApiError, echo

# Shapes: B batch, H/W image, K classes.

HEADER_LENGTH = "Inference-Header-Content-Length"
DTYPES = {"UINT8": np.dtype(np.uint8), "FP32": np.dtype("<f4")}  # KServe datatype -> little-endian numpy
ONNX_DATATYPES = {"tensor(uint8)": "UINT8", "tensor(float)": "FP32"}  # onnxruntime's type names -> KServe
INPUT, OUTPUT, PROBS = "pixels", "logits", "probs"  # the graph's input and logits output; probs is ours
TRUST_OUTPUTS = ("in_set", "unknown", "ood_score")  # ours too, from the file's calibration
MAX_ID_CHARS = 1024  # a request's `id`, echoed in its answer


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model as KServe v2 describes it: name, datatype and shape (-1: any batch size)."""

    name: str
    datatype: str
    shape: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class InferRequest:
    """A checked infer request.

    Attributes:
        pixels: (B, H, W, 3) uint8.
        outputs: the outputs to return, in order, each with whether it goes back as binary data.
        id: the request's id, echoed in the response (None when it has none).
        coverage: the request parameter `coverage` (prediction sets), None when it has none.
    """

    pixels: np.ndarray
    outputs: list[tuple[str, bool]]
    id: str | None
    coverage: float | None = None


def bad(message: str) -> ApiError:
    return ApiError("bad_request", message)


def read_json(data: bytes, what: str) -> Any:
    """JSON, or a 422 that says why not (a nesting too deep for the parser is a client error, not a crash)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise bad(f"the {what} is nested too deeply to be a tensor request; send flat data") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the {what} is not valid JSON ({e})") from None


def split_body(body: bytes, header_length: str | None) -> tuple[Any, bytes]:
    """The JSON header and the binary data after it (`header_length` is the header's byte count, or None
    when the whole body is JSON)."""
    if header_length is None:
        return read_json(body, "request body"), b""
    # at most 18 digits after leading zeros: no body is 10**18 bytes, and int() refuses over 4,300 digits
    digits = re.fullmatch(r"\s*0*([0-9]{1,18})\s*", header_length)
    n = int(digits[1]) if digits else -1
    if not 0 <= n <= len(body):
        raise bad(f"{HEADER_LENGTH} must be the JSON header's byte length (at most {len(body)}), got {header_length!r}")
    return read_json(body[:n], "JSON header"), body[n:]


def parse_infer_request(
    body: bytes, header_length: str | None, pixels: TensorSpec, outputs: list[str], max_images: int
) -> InferRequest:
    """An infer request -> checked pixels and requested outputs, or an `ApiError` saying what does not fit.

    Args:
        body: the request body.
        header_length: the `Inference-Header-Content-Length` header, when the body carries binary data.
        pixels: the model's input (its shape's first dimension is the batch).
        outputs: the output names a request may ask for; the first is the default.
        max_images: the most images in one request.
    """
    head, binary = split_body(body, header_length)
    if not isinstance(head, dict) or not isinstance(head.get("inputs"), list):
        example = {"name": pixels.name, "datatype": pixels.datatype, "shape": ["B", "..."], "data": ["..."]}
        raise bad(f"send a JSON object {json.dumps({'inputs': [example]})}")
    check_inputs([t.get("name") if isinstance(t, dict) else None for t in head["inputs"]], pixels)
    tensor = head["inputs"][0]
    shape = check_shape(tensor.get("shape"), pixels, max_images)
    if tensor.get("datatype") != pixels.datatype:
        raise bad(f"input {pixels.name!r} must have datatype {pixels.datatype}, got {tensor.get('datatype')!r}")
    refuse_input_extensions(tensor.get("parameters"))
    size = binary_size(tensor)
    if size is None:
        arr = json_tensor(tensor.get("data"), shape, pixels)
    elif size != len(binary):
        raise bad(f"binary_data_size of {pixels.name!r} is {size}, but {len(binary)} bytes follow the JSON header")
    else:
        arr = binary_tensor(binary, shape, pixels)
    params = head.get("parameters") or {}
    default_binary = bool_param(params, "binary_data_output")
    wanted = head.get("outputs")
    if wanted is None:
        chosen = [(outputs[0], default_binary)]
    elif isinstance(wanted, list) and wanted:
        chosen = [requested_output(o, outputs, default_binary) for o in wanted[: len(outputs) + 1]]
        once_each([name for name, _ in chosen])  # more entries than outputs: a repeat among the first ones
    else:
        raise bad('"outputs" must be a non-empty list of {"name": ...}; leave it out for the default output')
    req_id = head.get("id")
    check_request_id(None if req_id is None else str(req_id))
    return InferRequest(arr, chosen, None if req_id is None else str(req_id), coverage_param(params))


def coverage_param(params: dict) -> float | None:
    """The request parameter `coverage` (None without one); a value that is not a number is refused."""
    coverage = params.get("coverage")
    if coverage is not None and (isinstance(coverage, bool) or not isinstance(coverage, (int, float))):
        raise bad(f'the parameter "coverage" must be a number such as 0.95, got {echo(coverage)}')
    return coverage


def check_trust_request(classifier, req: InferRequest) -> None:
    """422 unless the file can answer the calibration outputs and the coverage the request asks for."""
    names = {n for n, _ in req.outputs}
    try:
        classifier.check_coverage(req.coverage)
    except ValueError as e:
        raise ApiError("bad_request", str(e)) from None
    asked = sorted(names & set(TRUST_OUTPUTS))
    if asked and not classifier.calibrated:
        raise ApiError("bad_request", f"{classifier.path.name} carries no calibration: it has no {asked} outputs")
    if "in_set" in names and req.coverage is None:
        raise ApiError("bad_request", 'the output "in_set" needs the request parameter "coverage", e.g. 0.95')


def output_tensors(classifier, rows: np.ndarray, req: InferRequest) -> list[tuple[str, np.ndarray, bool]]:
    """The outputs `req` asked for, from its images' (B,) records of `forward_rows`, in its order: (name, FP32
    tensor, whether it goes back as binary data). `logits`, `probs`, and from the file's calibration `unknown`
    (B,), `ood_score` (B,) and, at the request's coverage, `in_set` (B, K): 1 where the class is in the set."""
    by_name = {OUTPUT: rows["logits"], PROBS: rows["probs"]}
    if any(n in TRUST_OUTPUTS for n, _ in req.outputs):
        a = judge_rows(classifier, rows, req.coverage)
        by_name |= {"unknown": a.unknown.astype(np.float32), "ood_score": a.ood_scores.astype(np.float32)}
        if a.sets is not None:
            in_set = np.zeros(a.logits.shape, np.float32)
            for i, members in enumerate(a.sets):
                in_set[i, members] = 1.0
            by_name["in_set"] = in_set
    return [(n, by_name[n], binary) for n, binary in req.outputs]


def check_inputs(names: list, pixels: TensorSpec) -> None:
    """The request's input names are the model's one input, or `ApiError("bad_request")` naming them."""
    if names != [pixels.name]:
        got = echo(names)
        raise bad(f"this model takes one input, {pixels.name!r} ({pixels.datatype} {pixels.shape}), got inputs {got}")


def check_shape(shape: Any, spec: TensorSpec, max_images: int) -> list[int]:
    want = [f"1..{max_images}" if d == -1 else d for d in spec.shape]
    ok = isinstance(shape, list) and len(shape) == len(spec.shape) and all(type(d) is int for d in shape)
    if not ok or not 1 <= shape[0] <= max_images or shape[1:] != spec.shape[1:]:
        raise bad(
            f"input {spec.name!r} must have shape [{', '.join(map(str, want))}] "
            f"(split larger batches into several requests), got {echo(shape)}"
        )
    return shape


def check_request_id(request_id: str | None) -> None:
    """A request's `id`, echoed in its answer, is at most `MAX_ID_CHARS` long: a longer one made a large answer
    out of a small request (over gRPC, one its client's 4 MiB limit refused after the inference)."""
    if request_id is not None and len(request_id) > MAX_ID_CHARS:
        raise bad(f'the request "id" is {len(request_id)} characters; send one of at most {MAX_ID_CHARS}')


def binary_size(tensor: dict) -> int | None:
    """The tensor's `binary_data_size` parameter (None: its data are JSON)."""
    params = tensor.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad('"parameters" must be an object')
    size = params.get("binary_data_size")
    if size is None:
        return None
    if type(size) is not int or size < 0 or "data" in tensor:
        raise bad("binary_data_size must be a byte count, and a binary tensor has no JSON 'data'")
    return size


def binary_tensor(data: bytes, shape: list[int], spec: TensorSpec) -> np.ndarray:
    dtype = DTYPES[spec.datatype]
    count = int(np.prod(shape))
    if len(data) != count * dtype.itemsize:
        need = count * dtype.itemsize
        raise bad(f"{spec.name!r} of shape {shape} is {need} bytes of {spec.datatype}, got {len(data)} bytes")
    return np.frombuffer(data, dtype).reshape(shape)


def json_tensor(data: Any, shape: list[int], spec: TensorSpec) -> np.ndarray:
    """JSON data (flat, or nested at most as deep as `shape`) -> an array; UINT8 takes only integers 0..255."""
    flat = data
    for _ in range(len(shape) - 1):  # iterative, so no nesting can exhaust the stack
        if not isinstance(flat, list) or not any(isinstance(x, list) for x in flat):
            break
        if not all(isinstance(x, list) for x in flat):
            raise bad(f"the data of {spec.name!r} mix numbers and lists; send a flat list in row-major order")
        flat = list(chain.from_iterable(flat))
    count = int(np.prod(shape))
    if not isinstance(flat, list) or len(flat) != count:
        raise bad(f"the data of {spec.name!r} must hold {count} numbers for shape {shape}, flat or nested as the shape")
    if spec.datatype == "UINT8":
        if not all(type(x) is int and 0 <= x <= 255 for x in flat):  # bool is not int here; "255" and 0.7 fail too
            raise bad(f"{spec.name!r} is UINT8: its data must be JSON integers 0..255 (no strings, booleans or floats)")
        return np.array(flat, np.uint8).reshape(shape)
    if not all(type(x) in (int, float) for x in flat):
        raise bad(f"{spec.name!r} is {spec.datatype}: its data must be JSON numbers")
    return np.array(flat, DTYPES[spec.datatype]).reshape(shape)


def bool_param(params: Any, key: str) -> bool:
    if not isinstance(params, dict):
        raise bad('"parameters" must be an object')
    value = params.get(key, False)
    if type(value) is not bool:
        raise bad(f"parameter {key!r} must be true or false, got {value!r}")
    return value


def requested_output(out: Any, allowed: list[str], default_binary: bool) -> tuple[str, bool]:
    name = out.get("name") if isinstance(out, dict) else None
    if name not in allowed:
        raise bad(f"unknown output {name!r}; this model's outputs are {', '.join(map(repr, allowed))}")
    params = out.get("parameters")
    params = {} if params is None else params  # null: none
    if not isinstance(params, dict):
        raise bad('the "parameters" of an output must be an object')
    refuse_extensions(params)
    return name, bool_param(params, "binary_data") if "binary_data" in params else default_binary


def refuse_extensions(params: dict[str, Any]) -> None:
    """422 when a requested output's parameters ask for a Triton extension this server does not do, whose client
    would read the answer wrongly: classification (tritonclient's `class_count`: it would read the raw tensor as
    its top classes) and shared memory (it would read its region, never written). gRPC checks here too.
    """
    if params.get("classification"):
        raise bad("the classification extension is not supported; use /v1/classify?top_k=... for top classes")
    if "shared_memory_region" in params:
        raise bad("shared memory is not supported: leave out the output's shared_memory_region and read the answer")


def refuse_input_extensions(params: Any) -> None:
    """422 when the input's parameters name a shared-memory region (Triton's extension): its pixels are not in the
    request, and a count of the values that are would not say why. gRPC checks here too."""
    if isinstance(params, dict) and "shared_memory_region" in params:
        raise bad("shared memory is not supported: send the pixels in the request, not in a shared_memory_region")


def once_each(names: list[str]) -> None:
    """422 when an output is asked for twice, as Triton refuses it ("already exists in request"): each copy
    would be answered in full, and a small request could ask for a gigabyte of answer."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise bad(f"output {name!r} is requested more than once; ask for each output once")
        seen.add(name)


def encode_infer_response(head: dict[str, Any], tensors: list[tuple[str, np.ndarray, bool]]) -> tuple[bytes, dict]:
    """The response body and its headers: JSON, followed by the binary outputs' bytes if any.

    Args:
        head: model_name, model_version and id, as the response's JSON carries them.
        tensors: (name, FP32 array, binary) per output, in the requested order.
    """
    outputs, chunks = [], []
    for name, arr, binary in tensors:
        out: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(arr.shape)}
        if binary:
            chunk = np.ascontiguousarray(arr, DTYPES["FP32"]).tobytes()
            out["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            out["data"] = arr.astype(np.float32).ravel().tolist()
        outputs.append(out)
    header = json.dumps({**head, "outputs": outputs}, separators=(",", ":")).encode()
    if not chunks:
        return header, {"content-type": "application/json"}
    return header + b"".join(chunks), {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


def tensor_specs(classifier) -> tuple[TensorSpec, TensorSpec]:
    """The graph's `pixels` input and `logits` output, read from the onnxruntime session (the batch: -1)."""
    H, W = classifier.input_size
    K = len(classifier.labels)
    graph = {t.name: t for t in (*classifier.session.get_inputs(), *classifier.session.get_outputs())}
    for name in (INPUT, OUTPUT):
        if name not in graph or graph[name].type not in ONNX_DATATYPES:
            raise ValueError(f"{classifier.path} has no {name!r} tensor of a known type; export it with vit-export")
    pixels = TensorSpec(INPUT, ONNX_DATATYPES[graph[INPUT].type], [-1, H, W, 3])
    logits = TensorSpec(OUTPUT, ONNX_DATATYPES[graph[OUTPUT].type], [-1, K])
    return pixels, logits
