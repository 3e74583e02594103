"""Which model answers a request: a name and an optional version -> the classifier and the engine that batches for it.

The gRPC service asks a `Models` for every request, so that a server of many models (a model repository)
plugs in its own lookup; `OneModel` is the server of one file, as `vit-serve model.onnx` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serve.server.api.tensors import TensorSpec
from serve.server.api.v2 import tensor_specs
from serve.server.batching import Engine
from serve.server.http.errors import ApiError


@dataclass(frozen=True)
class ServedModel:
    """One loaded model version and the engine that batches its requests.

    Attributes:
        name: the model's name, as clients address it.
        version: the version being served.
        classifier: a loaded `serve.runtime.OnnxClassifier`.
        engine: its batching `Engine` (`engine.ready` says whether it takes requests).
        pixels: the graph's input, UINT8 [-1, H, W, 3].
        logits: the graph's output, FP32 [-1, K].
    """

    name: str
    version: str
    classifier: object
    engine: Engine
    pixels: TensorSpec
    logits: TensorSpec

    @classmethod
    def of(cls, classifier, engine: Engine) -> ServedModel:
        pixels, logits = tensor_specs(classifier)
        return cls(classifier.name, str(classifier.version), classifier, engine, pixels, logits)


class Models(Protocol):
    """What the gRPC service needs to know about the models a server holds."""

    def get(self, name: str, version: str = "") -> ServedModel:
        """The model `name` at `version` ("": the server's choice), or `ApiError("not_found")` saying what exists."""
        ...

    def ready(self) -> bool:
        """Whether the server takes inference requests (every model it must serve is loaded and warm)."""
        ...


class OneModel:
    """The `Models` of a server of one model file."""

    def __init__(self, model: ServedModel):
        self.model = model

    def get(self, name: str, version: str = "") -> ServedModel:
        m = self.model
        if name != m.name:
            raise ApiError("not_found", f"unknown model {name!r}; this server serves {m.name!r}")
        if version and version != m.version:
            raise ApiError("not_found", f"unknown version {version!r} of {name!r}; this server serves {m.version!r}")
        return m

    def ready(self) -> bool:
        return self.model.engine.ready
