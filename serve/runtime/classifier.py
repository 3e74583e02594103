"""Run an exported vitscope model with onnxruntime alone: no torch, no Lightning, no side files.

    clf = OnnxClassifier("artifacts/sample.onnx")
    clf.predict(["cat.jpg", "dog.png"], top_k=3)   # [[("cat", 0.91), ...], [("dog", 0.88), ...]]
    p = clf.predict("cat.jpg", coverage=0.95)[0]   # p.prediction_set ["cat", "lynx"], p.unknown, p.ood_score
    probs, maps = clf.rollout(clf.prepare("cat.jpg")[None])   # maps (1, Gh, Gw) in [0, 1]

Probabilities are calibrated (softmax of logits / the file's temperature) when the file carries
calibration (`serve.runtime.trust`); `logits` gives the raw logits. A file exported without it loads
too: raw softmax, `calibrated` False, no prediction sets, `unknown` and `ood_score` None.

The file describes itself (`metadata_props`, see `serve.export.cli`): class names, preprocessing,
patch grid. Its input is (B, H, W, 3) uint8 pixels already resized and cropped by
`Preprocess.to_uint8`; normalisation happens inside the graph.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image

from serve.runtime import model_file as mf
from serve.runtime.calibration import ranked
from serve.runtime.images import ImageSource, PixelBudget, Preprocess, load_image
from serve.runtime.model_file import ModelFileError, metadata_value
from serve.runtime.rollout import attention_rollout, rollout_from_gradients
from serve.runtime.session import default_providers, default_threads, session_options
from serve.runtime.trust import FEATURES_OUTPUT, UNCALIBRATED, Assessment, Prediction, Trust, feature_width

# Shapes: B batch, H/W image, K classes, nh heads, N tokens, Gh/Gw patch grid, L = Gh * Gw.

FORMAT_KEY = "vitscope_format"
FORMAT_VERSION = "1"


def softmax(logits: np.ndarray) -> np.ndarray:
    """(B, K) logits -> (B, K) float32 probabilities."""
    z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class OnnxClassifier:
    """An exported vitscope model, loaded for inference.

    Args:
        path: the .onnx file written by `vit-export`.
        providers: onnxruntime execution providers; None picks TensorRT or CUDA when present, else CPU.
        threads: intra-op threads; None picks by model size (`default_threads`), 0 means every physical core.

    Raises:
        OSError: no such file (FileNotFoundError), or it cannot be read.
        ModelFileError: anything wrong with the file itself (a ValueError), with what to do.
    """

    def __init__(self, path: str | Path, providers: Sequence[str] | None = None, threads: int | None = None):
        self.path = Path(path)
        data = mf.read_model_bytes(self.path)
        self.sha256 = hashlib.sha256(data).hexdigest()  # of the bytes loaded, whatever the path holds later
        options = session_options(default_threads(mf.read_metadata(data)) if threads is None else threads)
        self.threads = options.intra_op_num_threads
        try:
            providers = [providers] if isinstance(providers, str) else list(providers or default_providers())
            self.session = ort.InferenceSession(data, options, providers=providers)
        except Exception as e:  # onnxruntime's own errors are long; keep the first line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelFileError(f"{self.path} could not be loaded by onnxruntime: {first}; {mf.AGAIN}") from None
        try:
            self._read_metadata(self.session.get_modelmeta().custom_metadata_map)
        except ModelFileError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError) as e:
            # the checks name each field they read; this net under them keeps every other surprise a file error
            why = f"{type(e).__name__}: {mf.shown(str(e))}"
            raise ModelFileError(f"{self.path} has malformed metadata ({why}); {mf.AGAIN}") from None

    def _read_metadata(self, raw: dict[str, str]) -> None:
        """Every fact the file states about itself, each checked (`ModelFileError` names the first bad one)."""
        if raw.get(FORMAT_KEY, FORMAT_VERSION) != FORMAT_VERSION:
            raise ModelFileError(
                f"{self.path} has {FORMAT_KEY} {raw[FORMAT_KEY]!r}, and this vitscope reads {FORMAT_VERSION!r}: serve "
                "it with the vitscope that exported it, or export the checkpoint again with this one's vit-export"
            )
        if FORMAT_KEY not in raw and "class_names" in raw:  # vit-export writes the format entry last
            raise ModelFileError(
                f"{self.path} was cut short: its metadata ends before the last entry vit-export writes (a copy that "
                "stopped early, or a full disk); copy it again, or export it again with vit-export"
            )
        if FORMAT_KEY not in raw:
            raise ModelFileError(
                f"{self.path} has no vitscope metadata (class names, preprocessing); "
                "export the checkpoint with vit-export to get a self-describing model"
            )
        self.metadata: dict[str, Any] = mf.parse_metadata(raw, str(self.path))
        m, path = self.metadata, self.path
        self.labels: list[str] = mf.class_names_of(m.get("class_names"), path)
        self.preprocess = metadata_value(m, "preprocess", lambda v: Preprocess.from_dict(mf.mapping(v)), path)
        self.input_size: tuple[int, int] = metadata_value(m, "input_size", mf.size_pair, path)
        self.grid_size: tuple[int, int] = metadata_value(m, "grid_size", mf.size_pair, path)
        self.num_prefix_tokens: int = metadata_value(m, "num_prefix_tokens", mf.whole(0), path)
        self.depth: int = metadata_value(m, "depth", mf.whole(0), path)
        self.num_heads: int = metadata_value(m, "num_heads", mf.whole(0), path)
        self.rollout_query: str = metadata_value(m, "rollout_query", mf.choice("cls", "mean"), path, "cls")
        self.name: str = str(m.get("variant") or path.stem)
        self.version: str = str(m.get("checkpoint_sha256", ""))[:12] or "unversioned"
        inputs = {i.name for i in (*self.session.get_inputs(), *self.session.get_overridable_initializers())}
        self.supports_gradients: bool = bool(m.get("supports_gradients")) and "target" in inputs
        # the onnxruntime target picks its explain branch with an input; the portable one always outputs attns
        self.explain_feeds: dict[str, np.ndarray] = {"explain": np.array(True)} if "explain" in inputs else {}
        self._check_metadata()
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        self.supports_attention: bool = "attns" in outputs  # a Triton repository's file has the logits path alone
        self.trust: Trust | None = Trust.from_metadata(m, len(self.labels), feature_width(outputs))
        self._fast_outputs = ["logits", FEATURES_OUTPUT] if FEATURES_OUTPUT in outputs else ["logits"]
        if self.trust is not None and self.trust.needs_features and len(self._fast_outputs) == 1:
            raise ModelFileError(f"{path} uses the Mahalanobis OOD score but has no features output; {mf.AGAIN}")

    @property
    def calibrated(self) -> bool:
        """Whether the file carries a temperature, prediction-set scores and an OOD threshold."""
        return self.trust is not None

    def trust_summary(self) -> dict[str, Any]:
        """What the file knows about its reliability, for a client (or why it knows nothing)."""
        return self.trust.summary() if self.trust is not None else dict(UNCALIBRATED)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """(B, K) logits -> (B, K) probabilities: calibrated by the file's temperature when it has one."""
        return self.trust.probabilities(logits) if self.trust is not None else softmax(logits)

    def check_coverage(self, coverage: float | None) -> None:
        """Raise ValueError, with a message for the caller, unless prediction sets can be built at `coverage`."""
        if coverage is None:
            return
        if self.trust is None:
            raise ValueError(
                f"{self.path.name} carries no calibration, so it cannot build prediction sets: export it again "
                "with vit-export from a run with a calibration split (or with --calibrate DIR)"
            )
        self.trust.check_coverage(coverage)

    def _check_metadata(self) -> None:
        """The facts the metadata repeats for clients agree with each other and with the graph."""
        m, pre, path = self.metadata, self.preprocess, self.path
        H, W = self.input_size
        P = metadata_value(m, "patch_size", mf.whole(0), path, 0)
        graph_in, graph_out = mf.graph_io(path, self.session)
        mean, std = (metadata_value(m, k, mf.numbers(3), path, list(getattr(pre, k))) for k in ("mean", "std"))
        pixels, logits_width = mf.static_dims(graph_in, 1, 3), mf.static_dims(graph_out, 1, 2)
        mf.check_consistency(
            path,
            [
                ("input_size", [H, W], "preprocess img_size", list(pre.img_size)),
                ("mean", mean, "preprocess mean", list(pre.mean)),
                ("std", std, "preprocess std", list(pre.std)),
                ("grid_size", list(self.grid_size), "input_size / patch_size", [H // P, W // P] if P else None),
                ("input_size", [H, W], "the graph's pixels input (H, W)", pixels),
                ("the number of class_names", [len(self.labels)], "the graph's logits width", logits_width),
            ],
        )

    def __repr__(self) -> str:
        return f"OnnxClassifier({str(self.path)!r}, classes={len(self.labels)}, input={self.input_size})"

    def prepare(self, source: ImageSource, budget: PixelBudget | None = None) -> np.ndarray:
        """Decode, resize and crop one image like the evaluation transform, as the server decodes an upload: an
        image over four times the model's input on each side is decoded or reduced to twice it first
        (`Preprocess.load_pixels`), and `budget` is held for the pixels while they decode.

        Returns:
            (H, W, 3) uint8.

        Raises:
            ImageError: the input is not a usable image.
        """
        if isinstance(source, (Image.Image, np.ndarray)):  # decoded already (and the caller's to close)
            return self.preprocess.to_uint8(load_image(source))
        return self.preprocess.load_pixels(source, budget=budget)

    def _check_batch(self, batch: np.ndarray) -> np.ndarray:
        batch = np.asarray(batch)
        if batch.ndim == 3:
            batch = batch[None]
        H, W = self.input_size
        if batch.dtype != np.uint8 or batch.ndim != 4 or batch.shape[1:] != (H, W, 3) or not len(batch):
            raise ValueError(
                f"expected (B, {H}, {W}, 3) uint8 pixels from prepare(), at least one image, got {batch.shape} "
                f"{batch.dtype}"
            )
        return np.ascontiguousarray(batch)

    @property
    def needs_features(self) -> bool:
        """Whether `judge` needs the pre-logit features (the file's OOD score is Mahalanobis)."""
        return self.trust is not None and self.trust.needs_features

    def run_fast(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The fast path: (logits (B, K), pre-logit features (B, D) when `judge` needs them, else None)."""
        names = self._fast_outputs if self.needs_features else ["logits"]
        out = self.session.run(names, {"pixels": self._check_batch(batch)})
        return out[0], (out[1] if len(out) > 1 else None)

    def logits(self, batch: np.ndarray) -> np.ndarray:
        """The raw logits: (B, H, W, 3) uint8 -> (B, K) float32."""
        return self.session.run(["logits"], {"pixels": self._check_batch(batch)})[0]

    def predict_pixels(self, batch: np.ndarray) -> np.ndarray:
        """The fast path: (B, H, W, 3) uint8 -> (B, K) float32 probabilities, calibrated when the file is."""
        return self.probabilities(self.logits(batch))

    def assess(self, batch: np.ndarray, coverage: float | None = None) -> Assessment:
        """Probabilities, OOD scores, unknown verdicts and (with `coverage`) prediction sets of a batch.

        Raises:
            ValueError: a coverage the file cannot honour (`check_coverage`).
        """
        self.check_coverage(coverage)
        logits, features = self.run_fast(batch)
        return self.judge(logits, features, coverage)

    def judge(
        self,
        logits: np.ndarray,
        features: np.ndarray | None = None,
        coverage: float | None = None,
        probs: np.ndarray | None = None,
        ood_scores: np.ndarray | None = None,
    ) -> Assessment:
        """`assess` on logits (B, K) (and features (B, D); (B, 0) counts as None) already computed, e.g. by a
        server's batched pass, which may hand in its calibrated `probs` (B, K) and `ood_scores` (B,) too."""
        if features is not None and features.shape[-1] == 0:
            features = None
        probs = self.probabilities(logits) if probs is None else probs
        if self.trust is None:
            return Assessment(probs, logits, None, None, None)
        scores = self.trust.ood_scores(logits, probs, features) if ood_scores is None else ood_scores
        sets = self.trust.prediction_sets(probs, coverage) if coverage is not None else None
        return Assessment(probs, logits, scores, self.trust.unknown(scores), sets)

    def predict(
        self,
        images: ImageSource | Sequence[ImageSource],
        top_k: int = 5,
        batch_size: int = 32,
        coverage: float | None = None,
    ) -> list[Prediction]:
        """Classify one image or a list of images.

        Args:
            images: one `ImageSource` (path, bytes, PIL image, uint8 array) or a list of them.
            top_k: how many classes to return per image (at most K).
            batch_size: images per onnxruntime call.
            coverage: also build each image's prediction set, holding the true class with this probability
                (e.g. 0.95); None builds none.

        Returns:
            Per image, a `Prediction`: [(label, probability), ...] sorted by probability, highest first, with
            `prediction_set`, `unknown` and `ood_score`.

        Raises:
            ValueError: a coverage outside (0, 1), finer than the calibration split allows, or asked of a file
                without calibration.
        """
        sources = list(images) if isinstance(images, (list, tuple, Iterator)) else [images]
        self.check_coverage(coverage)
        for name, value in (("top_k", top_k), ("batch_size", batch_size)):  # numpy's integers are whole numbers too
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        k, batch_size = min(int(top_k), len(self.labels)), int(batch_size)
        results = []
        for i in range(0, len(sources), batch_size):
            pixels = np.stack([self.prepare(s) for s in sources[i : i + batch_size]])
            results.extend(self.predictions(self.assess(pixels, coverage), k))
        return results

    def predictions(self, a: Assessment, k: int) -> list[Prediction]:
        """An `Assessment` as one `Prediction` per image (the k best classes, the set, the verdict)."""
        out = []
        for i, top in enumerate(self.top_k(a.probs, k)):
            labels = None if a.sets is None else [self.labels[j] for j in a.sets[i]]
            unknown = None if a.unknown is None else bool(a.unknown[i])
            score = None if a.ood_scores is None else float(a.ood_scores[i])
            out.append(Prediction(top, labels, unknown, score))
        return out

    def top_k(self, probs: np.ndarray, k: int = 5) -> list[list[tuple[str, float]]]:
        """(B, K) probabilities -> per image, the k best (label, probability), highest first."""
        rows = probs.tolist()  # plain floats: no numpy scalar per item
        return [[(self.labels[j], row[j]) for j in order] for order, row in zip(ranked(probs, k), rows, strict=True)]

    def check_attention(self) -> None:
        """ValueError unless the file has the attention output that rollouts and attention maps read."""
        if not self.supports_attention:
            raise ValueError(
                f"{self.path.name} has no attention output (a Triton repository's file, logits alone): serve the "
                ".onnx file vit-export wrote beside the repository to explain"
            )

    def attentions(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Probabilities and every block's attention maps (the explain branch, explicit softmax).

        Returns:
            (probs (B, K), attns (depth, B, nh, N, N) float32).
        """
        self.check_attention()
        logits, attns = self.session.run(
            ["logits", "attns"], {"pixels": self._check_batch(batch), **self.explain_feeds}
        )
        return self.probabilities(logits), self._counted(attns)

    def _counted(self, attns: np.ndarray) -> np.ndarray:
        """`attns`, refused when the metadata does not count its tokens (`model_file.check_token_count`)."""
        return mf.check_token_count(self.path, self.grid_size, self.num_prefix_tokens, attns)

    def rollout(
        self,
        batch: np.ndarray,
        head_fusion: str = "mean",
        discard_ratio: float = 0.0,
        blocks: tuple[int, int] | None = None,
        query: str | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Attention rollout maps for a batch.

        Args:
            batch: (B, H, W, 3) uint8 from `prepare`.
            head_fusion: "mean", "max" or "min" over heads.
            discard_ratio: share of the weakest patch links dropped per row, in [0, 1).
            blocks: (start, stop) rolls out only blocks[start:stop]; None uses all.
            query: "cls" or "mean"; None uses the model's readout (the CLS row when its head pools the CLS token).

        Returns:
            (probs (B, K), maps (B, Gh, Gw) float32, maximum 1 per image).
        """
        probs, attns = self.attentions(batch)
        return probs, self.rollout_from_attns(attns, head_fusion, discard_ratio, blocks, query)

    def rollout_from_attns(
        self,
        attns: np.ndarray,
        head_fusion: str = "mean",
        discard_ratio: float = 0.0,
        blocks: tuple[int, int] | None = None,
        query: str | None = None,
    ) -> np.ndarray:
        """Rollout maps (B, Gh, Gw) from maps returned by `attentions`; arguments as in `rollout`."""
        if blocks is not None:
            start, stop = blocks
            attns = attns[start:stop]
            if len(attns) == 0:
                raise ValueError(f"blocks={blocks} selects no block of {self.depth}")
        maps = attention_rollout(
            attns,
            head_fusion=head_fusion,
            discard_ratio=discard_ratio,
            num_prefix_tokens=self.num_prefix_tokens,
            query=query or self.rollout_query,
        )  # (B, L)
        return maps.reshape(-1, *self.grid_size)

    def gradient_rollout(
        self, batch: np.ndarray, target: int | Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Class-specific maps by gradient-weighted rollout (Chefer et al. 2021), gradients from the file.

        Args:
            batch: (B, H, W, 3) uint8.
            target: a class index for all images, one per image, or None for each image's top class.

        Returns:
            (probs (B, K), maps (B, Gh, Gw) float32, maximum 1 per image).
        """
        if not self.supports_gradients:
            raise ValueError(
                f"{self.path.name} has no gradient graph; export it again with vit-export (without --no-gradients)"
            )
        batch = self._check_batch(batch)
        B = len(batch)
        if target is None:
            target = self.predict_pixels(batch).argmax(axis=-1)
        if np.asarray(target).dtype.kind not in "iu":  # np.int64 of 2.5 is 2
            raise ValueError(f"target must be class indices (whole numbers), got {np.asarray(target).tolist()}")
        target = np.broadcast_to(np.asarray(target, dtype=np.int64), (B,)).copy()
        if target.min() < 0 or target.max() >= len(self.labels):
            raise ValueError(f"target classes must be in [0, {len(self.labels)}), got {target.tolist()}")
        logits, attns, grads = self.session.run(
            ["logits", "attns", "grads"],
            {"pixels": batch, "explain": np.array(True), "gradients": np.array(True), "target": target},
        )
        P, query = self.num_prefix_tokens, self.rollout_query
        maps = rollout_from_gradients(self._counted(attns), grads, num_prefix_tokens=P, query=query)
        return self.probabilities(logits), maps.reshape(-1, *self.grid_size)
