"""ModelInferRequest -> a checked `InferRequest`; the outputs it asked for -> ModelInferResponse.

The tensors are the ones the KServe v2 HTTP routes speak (`serve.server.api.v2`): the input `pixels`,
UINT8 [B, H, W, 3], sent as `raw_input_contents` (what `tritonclient.grpc` sends) or as `uint_contents`;
the outputs `logits` (the default) and `probs`, FP32 [B, K], and from a calibrated file `unknown` and
`ood_score` [B] and, with the request parameter `coverage` (a `double_param`, as tritonclient sends 0.95),
`in_set` [B, K], always answered as `raw_output_contents` (which every Triton and KServe client reads). Shapes,
sizes, the parameters and the outputs' parameters (Triton's classification extension is refused) are checked by
the same functions as over HTTP, so both answer a request that does not fit with the same message.
"""

from __future__ import annotations

import numpy as np

from serve.server.api.tensors import (
    DTYPES,
    OUTPUT,
    PROBS,
    TRUST_OUTPUTS,
    InferRequest,
    TensorSpec,
    bad,
    binary_tensor,
    check_inputs,
    check_request_id,
    check_shape,
    coverage_param,
    once_each,
    refuse_extensions,
    refuse_input_extensions,
)
from serve.server.grpc import grpc_predict_v2_pb2 as pb

# Shapes: B batch, H/W image, K classes.

CONVERT_SLICE = 1 << 16  # typed values converted at a time (`uint_values`)
OUTPUTS = (OUTPUT, PROBS, *TRUST_OUTPUTS)  # what a request may ask for, as over HTTP; the first is the default


def parse_infer(
    request: pb.ModelInferRequest, pixels: TensorSpec, max_images: int, typed: np.ndarray | None = None
) -> InferRequest:
    """The request's (B, H, W, 3) uint8 pixels, the outputs it wants (all answered as raw contents) and its
    `coverage` parameter, as HTTP's `parse_infer_request` reads them, or `ApiError("bad_request")`.

    Args:
        request: the decoded message.
        pixels: the model's input (its shape's first dimension is the batch).
        max_images: the most images in one request.
        typed: `uint_values` of the request's `typed_values`, converted beforehand (None: converted here).
    """
    check_inputs([t.name for t in request.inputs], pixels)
    check_request_id(request.id)
    tensor = request.inputs[0]
    shape = check_shape(list(tensor.shape), pixels, max_images)
    if tensor.datatype != pixels.datatype:
        raise bad(f"input {pixels.name!r} must have datatype {pixels.datatype}, got {tensor.datatype!r}")
    refuse_input_extensions(parameter_values(tensor.parameters))
    raw = request.raw_input_contents
    if raw:
        if len(raw) != 1:
            raise bad(f"raw_input_contents must hold one entry per input (1), got {len(raw)}")
        if tensor.HasField("contents"):
            raise bad("send the tensor either as raw_input_contents or as contents, not both")
        arr = binary_tensor(raw[0], shape, pixels)
    else:
        other = [f.name for f, _ in tensor.contents.ListFields() if f.name != "uint_contents"]
        if other:  # read as none at all, and refused for a count of 0
            raise bad(f"UINT8 pixels go in raw_input_contents or in contents.uint_contents, not in {other[0]}")
        arr = uint_tensor(tensor.contents.uint_contents if typed is None else typed, shape, pixels)
    asked = request.outputs[: len(OUTPUTS) + 1]
    wanted = [o.name for o in asked] or [OUTPUTS[0]]
    unknown = [n for n in wanted if n not in OUTPUTS]
    if unknown:
        raise bad(f"unknown output {unknown[0]!r}; this model's outputs are {', '.join(map(repr, OUTPUTS))}")
    for o in asked:  # refused as over HTTP, not answered with the raw tensor
        refuse_extensions(parameter_values(o.parameters))
    once_each(wanted)  # more entries than outputs: a repeat among the first ones
    coverage = coverage_param(parameter_values(request.parameters))
    return InferRequest(arr, [(name, True) for name in wanted], request.id or None, coverage)


def parameter_values(parameters) -> dict:
    """A message's `parameters` map -> {name: its bool, int, float or string value}, as JSON parameters read."""
    return {k: getattr(p, which) for k, p in parameters.items() if (which := p.WhichOneof("parameter_choice"))}


def typed_values(request: pb.ModelInferRequest):
    """The first input's `uint_contents` when the pixels come as typed values, not as raw bytes (None: they don't)."""
    if request.raw_input_contents or not request.inputs:
        return None
    return request.inputs[0].contents.uint_contents or None


def uint_values(values) -> np.ndarray:
    """`uint_contents` (the protocol's repeated uint32) -> a flat uint32 array, a slice at a time: between two
    slices the interpreter can hand the GIL to another thread (one `np.asarray` of the field holds it to the end,
    a long pause for a large batch), and slices are faster too."""
    arr = np.empty(len(values), np.uint32)
    for start in range(0, len(values), CONVERT_SLICE):
        arr[start : start + CONVERT_SLICE] = values[start : start + CONVERT_SLICE]
    return arr


def uint_tensor(values, shape: list[int], spec: TensorSpec) -> np.ndarray:
    """UINT8 data sent as `uint_contents` (or `uint_values` of them) -> an array; values over 255 fail."""
    count = int(np.prod(shape))
    if len(values) != count:
        raise bad(f"{spec.name!r} of shape {shape} needs {count} values in raw_input_contents or uint_contents, "
                  f"got {len(values)}")  # fmt: skip
    arr = values if isinstance(values, np.ndarray) else uint_values(values)
    if arr.size and arr.max() > 255:
        raise bad(f"{spec.name!r} is UINT8: its values must be 0..255")
    return arr.astype(np.uint8).reshape(shape)


def infer_response(model_name: str, version: str, request_id: str, outputs: list[tuple[str, np.ndarray]]):
    """The ModelInferResponse of FP32 outputs, in the order given, as raw little-endian bytes."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=version, id=request_id)
    for name, arr in outputs:
        response.outputs.add(name=name, datatype="FP32", shape=arr.shape)
        response.raw_output_contents.append(np.ascontiguousarray(arr, DTYPES["FP32"]).tobytes())
    return response


def metadata_response(name: str, versions: list[str], pixels: TensorSpec, logits: TensorSpec):
    """The ModelMetadataResponse: the versions that may be asked for, and the graph's own tensors, as Triton
    serving the same file shows them."""
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=name,
        versions=versions,
        platform="onnxruntime_onnx",
        inputs=[tensor(name=pixels.name, datatype=pixels.datatype, shape=pixels.shape)],
        outputs=[tensor(name=logits.name, datatype=logits.datatype, shape=logits.shape)],
    )
