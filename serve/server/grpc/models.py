"""Which model answers a request: a name and an optional version -> the classifier and the engine that batches for it.

The gRPC service asks a `Models` for every request, so that a server of many models (a model repository)
plugs in its own lookup; `OneModel` is the server of one file, as `vit-serve model.onnx` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from serve.server.api.tensors import TensorSpec, tensor_specs
from serve.server.engine import Engine
from serve.server.errors import ApiError
from serve.server.repository.repository import ModelRepository, UnknownModel


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
        held: a context in which a call counts as in flight on this version (a repository drains a swapped-out
            version only once its calls are done).
    """

    name: str
    version: str
    classifier: object
    engine: Engine
    pixels: TensorSpec
    logits: TensorSpec
    held: Callable[[], AbstractContextManager] = nullcontext

    @classmethod
    def of(cls, classifier, engine: Engine) -> ServedModel:
        pixels, logits = tensor_specs(classifier)
        return cls(classifier.name, str(classifier.version), classifier, engine, pixels, logits)


class Models(Protocol):
    """What the gRPC service needs to know about the models a server holds."""

    def get(self, name: str, version: str = "") -> ServedModel:
        """The model `name` at `version` ("": the server's choice), or `ApiError("not_found")` saying what exists."""
        ...

    def hold(self, name: str, version: str = "") -> AbstractContextManager[ServedModel]:
        """`get`, counted in flight while the block runs (a swapped-out version drains only once it is done)."""
        ...

    def versions(self, name: str) -> list[str]:
        """The versions of `name` served now, as HTTP's model metadata lists them."""
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

    @contextmanager
    def hold(self, name: str, version: str = "") -> Iterator[ServedModel]:
        yield self.get(name, version)  # one model, never swapped: nothing drains under a call

    def versions(self, name: str) -> list[str]:
        return [self.model.version] if name == self.model.name else []

    def ready(self) -> bool:
        return self.model.engine.ready


class RepositoryModels:
    """The `Models` of a model repository (`serve.server.repository`): each call goes to the version it
    resolves to now, so a swap takes new gRPC calls at once, as it does HTTP ones."""

    def __init__(self, repository: ModelRepository):
        self.repository = repository

    def get(self, name: str, version: str = "") -> ServedModel:
        return self._served(self._resolve(name, version or None))

    @contextmanager
    def hold(self, name: str, version: str = "") -> Iterator[ServedModel]:
        with self.repository.hold(name, version or None, self._resolve) as served:
            yield self._served(served)

    def _resolve(self, name: str | None, version: str | None):
        try:
            return self.repository.resolve(name, version)
        except UnknownModel as e:
            raise ApiError("not_found", str(e)) from None

    def _served(self, served) -> ServedModel:
        if served.specs is None:  # read once per version, and kept on it for HTTP's v2 routes too
            served.specs = tensor_specs(served.classifier)
        pixels, logits = served.specs
        return ServedModel(served.name, served.version, served.classifier, served.engine, pixels, logits, served.held)

    def versions(self, name: str) -> list[str]:
        return sorted(self.repository.serving.get(name, {}))

    def ready(self) -> bool:
        return self.repository.ready
