"""The export's parity gate: torch and onnxruntime must give the same answers on validation images.

Both sides see the serving preprocessing: the image goes through `Preprocess.to_uint8`; torch gets
`Preprocess.normalize` of those pixels, onnxruntime gets the pixels (it normalises inside).
Thresholds (fp32): top-1 agreement 100%, max |delta logit| <= 1e-4, rollout-map correlation >= 0.999.
int8 logits path: top-1 agreement >= 99% (its explain branch is fp32 and held to the fp32 thresholds).
The portable int8 file computes its maps in the int8 graph: top-1 agreement >= 99% on both paths, and
rollout-map correlation >= 0.99. Any logit or map that is not finite fails the gate, whatever the thresholds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve.export.preflight import run_path, split_path
from serve.runtime.classifier import OnnxClassifier
from serve.runtime.image_files import walk_image_files
from serve.runtime.images import ImageError, Preprocess, load_image
from vit.model import VisionTransformer
from vit.rollout import attention_rollout, gradient_rollout

log = logging.getLogger(__name__)

# Shapes: M sample images, H/W image, K classes, L patches.

MAX_LOGIT_DELTA = 1e-4
MIN_ROLLOUT_CORR = 0.999
MIN_INT8_AGREEMENT = 0.99
MIN_INT8_ROLLOUT_CORR = 0.99


class ParityError(RuntimeError):
    """The exported model disagrees with torch; `report` holds the numbers."""

    def __init__(self, message: str, report: dict[str, Any]):
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class Sample:
    """Validation images for the gate: pixels (M, H, W, 3) uint8, labels (M,) (-1: unknown), where they came from."""

    pixels: np.ndarray
    labels: np.ndarray
    source: str


def validation_sample(
    checkpoint: Path, class_names: list[str], preprocess: Preprocess, val_dir: Path | None = None, limit: int = 256
) -> Sample:
    """The run's validation images (`<run>/split.json`), else (or when none of them can be read) `val_dir`, else
    random images with a warning."""
    split = split_path(checkpoint)  # checked against the checkpoint's classes: `preflight.check_split`
    index = {name: i for i, name in enumerate(class_names)}
    label = lambda e: index.get(e.get("label", -1), -1) if isinstance(e.get("label"), str) else int(e.get("label", -1))
    tried: list[tuple[list[tuple[Path, int]], str]] = []  # (entries, source), in the order they are tried
    if split.is_file() and (val := json.loads(split.read_text()).get("val", [])):
        tried.append(([(run_path(e["path"], split.parent), label(e)) for e in val], str(split)))
    if val_dir is not None:  # as --val-dir was checked: linked folders followed
        tried.append(
            ([(Path(p), index.get(Path(p).parent.name, -1)) for p in walk_image_files(val_dir)[0]], str(val_dir))
        )
    if len(tried) == 2:  # said, not silently passed over
        log.warning(
            "--val-dir %s is used only if none of the run's own validation images (%s) can be read", val_dir, split
        )
    first_failure = None
    for entries, source in tried:
        pixels, labels, unreadable = _read_sample(entries, preprocess, limit)
        if pixels:
            return Sample(np.stack(pixels), np.asarray(labels), source)
        first_failure = first_failure or (unreadable and (len(unreadable), source, unreadable[0]))
    if first_failure:  # the gate would pass on noise: say so, rather than export unchecked
        n, source, first = first_failure
        fix = "restore them" + (
            ", or give --val-dir DIR, a folder of readable images per class" if val_dir is None else ""
        )
        raise ValueError(f"none of the {n} parity images of {source} could be read, the first {first}: {fix}")
    looked = ([f"{split}'s val split"] if split.is_file() else []) + ([str(val_dir)] if val_dir is not None else [])
    where = f"in {' or '.join(looked)}" if looked else "(no split.json next to the checkpoint's run, no --val-dir)"
    log.warning("no validation images found %s: the parity gate runs on 32 random images instead", where)
    H, W = preprocess.img_size
    rng = np.random.default_rng(0)
    return Sample(rng.integers(0, 256, (32, H, W, 3), dtype=np.uint8), np.full(32, -1), "random images")


def _read_sample(entries: list[tuple[Path, int]], preprocess: Preprocess, limit: int) -> tuple[list, list, list[str]]:
    """(pixels, labels, unreadable) of at most `limit` of `entries`, evenly spread (deterministic)."""
    if len(entries) > limit:
        entries = [entries[i] for i in np.linspace(0, len(entries) - 1, limit).round().astype(int)]
    pixels, labels, unreadable = [], [], []
    for p, label in entries:
        try:
            pixels.append(preprocess.to_uint8(load_image(p)))
            labels.append(label)
        except (ImageError, FileNotFoundError) as err:
            log.warning("parity sample: skipping %s (%s)", p, err)
            unreadable.append(f"{p} ({err})")
    return pixels, labels, unreadable


@torch.no_grad()
def torch_reference(
    net: VisionTransformer, pixels: np.ndarray, preprocess: Preprocess, batch_size: int = 32
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Torch on the serving preprocessing: (logits of the fused path, logits of the explicit path, rollout (M, L))."""
    query = net.rollout_query
    fast, explicit, maps = [], [], []
    for i in range(0, len(pixels), batch_size):
        x = torch.from_numpy(preprocess.normalize(pixels[i : i + batch_size]))  # (b, 3, H, W)
        fast.append(net(x).numpy())
        logits, attns = net(x, return_attn=True)
        explicit.append(logits.numpy())
        maps.append(attention_rollout(attns, num_prefix_tokens=net.num_prefix_tokens, query=query).numpy())
    return np.concatenate(fast), np.concatenate(explicit), np.concatenate(maps)


def map_correlation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation per row of two (M, L) arrays; 1 where both rows are constant."""
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean(axis=-1, keepdims=True)
    den = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    num = (a * b).sum(-1)
    return np.where(den > 1e-12, num / np.maximum(den, 1e-30), 1.0)


def gradient_rollout_correlation(
    net: VisionTransformer, clf: OnnxClassifier, pixels: np.ndarray, preprocess: Preprocess, batch_size: int = 32
) -> float:
    """Lowest per-image correlation of torch's and the file's gradient rollout, for torch's top class."""
    corr = []
    for i in range(0, len(pixels), batch_size):
        batch = pixels[i : i + batch_size]
        x = torch.from_numpy(preprocess.normalize(batch))
        t_maps, logits = gradient_rollout(net, x)
        _, o_maps = clf.gradient_rollout(batch, target=logits.argmax(-1).numpy())
        corr.append(map_correlation(t_maps.numpy(), o_maps.reshape(len(batch), -1)))
    return float(np.concatenate(corr).min())


def check(
    net: VisionTransformer,
    path: Path,
    sample: Sample,
    preprocess: Preprocess,
    int8: bool = False,
    batch_size: int = 32,
    int8_maps: bool = False,
) -> dict[str, Any]:
    """Run the gate on an exported file.

    Args:
        int8: the logits path is int8.
        int8_maps: the maps come from the int8 graph too (the portable target).

    Returns:
        The numbers (agreement, max logit deltas, min rollout correlation, accuracies).

    Raises:
        ParityError: when a threshold is missed.
    """
    clf = OnnxClassifier(path, providers=["CPUExecutionProvider"], threads=2)
    t_fast, t_explicit, t_maps = torch_reference(net, sample.pixels, preprocess, batch_size)
    o_fast, o_explain, o_maps = _onnx_outputs(clf, sample.pixels, batch_size)
    grad_corr = (
        gradient_rollout_correlation(net, clf, sample.pixels, preprocess, batch_size)
        if clf.supports_gradients
        else None
    )

    labels = sample.labels
    known = labels >= 0
    report: dict[str, Any] = {
        "images": len(sample.pixels),
        "source": sample.source,
        "precision": "int8" if int8 else "fp32",
        "top1_agreement": float((t_fast.argmax(-1) == o_fast.argmax(-1)).mean()),
        "max_logit_delta": float(np.abs(t_fast - o_fast).max()),
        "explain_max_logit_delta": float(np.abs(t_explicit - o_explain).max()),
        "min_rollout_corr": float(map_correlation(t_maps, o_maps).min()),
    }
    if grad_corr is not None:
        report["min_gradient_rollout_corr"] = grad_corr
    if known.any():
        report["torch_accuracy"] = float((t_fast.argmax(-1) == labels)[known].mean())
        report["onnx_accuracy"] = float((o_fast.argmax(-1) == labels)[known].mean())
        report["chance_accuracy"] = 1.0 / t_fast.shape[-1]
    failures = _not_finite(t_fast=t_fast, o_fast=o_fast, o_explain=o_explain, o_maps=o_maps)
    explain_agreement = float((t_explicit.argmax(-1) == o_explain.argmax(-1)).mean())
    failures += _missed(report, int8, int8_maps, explain_agreement)
    report["passed"] = not failures
    if failures:
        raise ParityError("; ".join(failures), report)
    return report


def _onnx_outputs(clf: OnnxClassifier, pixels: np.ndarray, batch_size: int) -> tuple[np.ndarray, ...]:
    """The file's fast-path logits, explain-branch logits and rollout maps (n, N) for `pixels`."""
    o_fast, o_explain, o_maps = [], [], []
    for i in range(0, len(pixels), batch_size):
        batch = pixels[i : i + batch_size]
        o_fast.append(clf.session.run(["logits"], {"pixels": batch})[0])
        logits, attns = clf.session.run(["logits", "attns"], {"pixels": batch, **clf.explain_feeds})
        o_explain.append(logits)
        o_maps.append(clf.rollout_from_attns(attns).reshape(len(batch), -1))
    return np.concatenate(o_fast), np.concatenate(o_explain), np.concatenate(o_maps)


def _missed(report: dict[str, Any], int8: bool, int8_maps: bool, explain_agreement: float) -> list[str]:
    """The thresholds the report misses, each said in one line."""
    failures = []
    if int8:
        if report["top1_agreement"] < MIN_INT8_AGREEMENT:
            failures.append(f"int8 top-1 agreement {report['top1_agreement']:.2%} < {MIN_INT8_AGREEMENT:.0%}")
    else:
        if report["top1_agreement"] < 1.0:
            failures.append(f"top-1 agreement {report['top1_agreement']:.2%} < 100%")
        if report["max_logit_delta"] > MAX_LOGIT_DELTA:
            failures.append(f"max |delta logit| {report['max_logit_delta']:.2e} > {MAX_LOGIT_DELTA:.0e}")
    if int8_maps and explain_agreement < MIN_INT8_AGREEMENT:
        failures.append(f"int8 explain top-1 agreement {explain_agreement:.2%} < {MIN_INT8_AGREEMENT:.0%}")
    if not int8_maps and report["explain_max_logit_delta"] > MAX_LOGIT_DELTA:
        failures.append(
            f"explain branch max |delta logit| {report['explain_max_logit_delta']:.2e} > {MAX_LOGIT_DELTA:.0e}"
        )
    min_corr = MIN_INT8_ROLLOUT_CORR if int8_maps else MIN_ROLLOUT_CORR
    if report["min_rollout_corr"] < min_corr:
        failures.append(f"rollout correlation {report['min_rollout_corr']:.5f} < {min_corr}")
    grad_corr = report.get("min_gradient_rollout_corr")
    if grad_corr is not None and not grad_corr >= MIN_ROLLOUT_CORR:  # NaN fails too
        failures.append(f"gradient rollout correlation {grad_corr:.5f} < {MIN_ROLLOUT_CORR}")
    return failures


def check_logits_only(
    net: VisionTransformer, model: bytes, sample: Sample, preprocess: Preprocess, int8: bool = False
) -> dict[str, Any]:
    """The gate for a logits-only file (the Triton model): top-1 agreement and max |delta logit| against torch.

    Raises:
        ParityError: when a threshold is missed or a logit is not finite.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    t_fast, _, _ = torch_reference(net, sample.pixels, preprocess)
    o_fast = np.concatenate(
        [session.run(["logits"], {"pixels": sample.pixels[i : i + 32]})[0] for i in range(0, len(sample.pixels), 32)]
    )
    agreement = float((t_fast.argmax(-1) == o_fast.argmax(-1)).mean())
    delta = float(np.abs(t_fast - o_fast).max())
    failures = _not_finite(t_fast=t_fast, o_fast=o_fast)
    if agreement < (MIN_INT8_AGREEMENT if int8 else 1.0):
        failures.append(f"logits-only model: top-1 agreement {agreement:.2%}")
    if not int8 and not delta <= MAX_LOGIT_DELTA:
        failures.append(f"logits-only model: max |delta logit| {delta:.2e} > {MAX_LOGIT_DELTA:.0e}")
    report = {"top1_agreement": agreement, "max_logit_delta": delta, "passed": not failures}
    if failures:
        raise ParityError("; ".join(failures), report)
    return report


def _not_finite(**arrays: np.ndarray) -> list[str]:
    """A failure for each array with a NaN or infinity: NaN compares false with every threshold."""
    what = {
        "t_fast": "torch's logits (the checkpoint itself)",
        "o_fast": "the file's logits",
        "o_explain": "the file's explain-path logits",
        "o_maps": "the file's rollout maps",
    }
    return [
        f"{what[name]} are not finite ({int((~np.isfinite(a)).sum())} NaN/inf values)"
        for name, a in arrays.items()
        if not np.isfinite(a).all()
    ]


def format_report(report: dict[str, Any] | None, quant: dict[str, Any] | None = None) -> str:
    """The gate's numbers as a few aligned lines for the terminal."""
    if report is None:
        return "parity gate: skipped"
    lines = [f"parity gate on {report['images']} images from {report['source']} ({report['precision']}):"]
    lines.append(f"  top-1 agreement torch vs onnxruntime  {report['top1_agreement']:.2%}")
    lines.append(f"  max |delta logit| (logits path)       {report['max_logit_delta']:.2e}")
    lines.append(f"  max |delta logit| (explain path)      {report['explain_max_logit_delta']:.2e}")
    lines.append(f"  min rollout-map correlation           {report['min_rollout_corr']:.6f}")
    if "min_gradient_rollout_corr" in report:
        lines.append(f"  min gradient-rollout correlation      {report['min_gradient_rollout_corr']:.6f}")
    if "torch_accuracy" in report:
        lines.append(
            f"  accuracy torch / onnxruntime          {report['torch_accuracy']:.2%} / {report['onnx_accuracy']:.2%}"
        )
        chance = report.get("chance_accuracy", 0.0)
        if chance and report["torch_accuracy"] < chance + 0.1 * (1.0 - chance):  # within a tenth of the way up
            lines.append(
                f"  warning: that is close to chance ({chance:.1%} for {round(1 / chance)} classes): the gate checks "
                "that the file answers like the checkpoint, not that the checkpoint was trained well; is this "
                "the checkpoint you meant?"
            )
    if quant:
        for name, r in quant["candidates"].items():
            acc = f", accuracy {r['accuracy']:.2%}" if r.get("accuracy") is not None else ""
            lines.append(
                f"  {name:<13} agreement {r['agreement']:.2%}{acc}, {r['ms_per_image']:.2f} ms/image "
                f"({r['speedup']:.2f}x fp32)"
            )
        lines.append(f"  chosen: {quant['chosen']}")
    lines.append(f"  result: {'PASSED' if report.get('passed') else 'FAILED'}")
    return "\n".join(lines)
