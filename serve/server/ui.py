"""The Gradio UI: drop an image, see the class, where the transformer looked, and whether to trust it.

`build_ui(classifier, engine, settings)` returns the `gr.Blocks`; `serve.server.app.build_app` mounts it
at `/`. Every model call goes through the engine, so it runs on the batcher's thread.

Endpoints for `gradio_client` (``Client(url).predict(..., api_name=...)``):

    /classify          (image, head_fusion, discard_ratio, block_start, block_stop, opacity, colormap)
                       -> (top-k label dict, rollout overlay, deletion score text, the model's input crop)
    /attention         (image, block, head, opacity, colormap) -> (CLS attention overlay, deletion score text)
    /gradient_rollout  (image, class label, opacity, colormap) -> (gradient rollout overlay, deletion score text)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gradio as gr
import matplotlib
import numpy as np
from PIL import Image

from serve.runtime.faithfulness import DeletionScore, deletion_score, mean_fill
from serve.runtime.images import IMAGE_SUFFIXES, ImageError, load_image

log = logging.getLogger(__name__)

COLORMAPS = ("inferno", "jet", "viridis", "magma", "turbo")
NO_GRADIENTS = "this model file has no gradient graph (vit-export --no-gradients); re-export it without that flag"
DISPLAY_SIZE = 256  # the input crop is tiny for small models: show it large enough to see


def mean_fill_of(classifier) -> np.ndarray:
    """The colour of a deleted patch for this model: its normalisation mean, in 0-255."""
    return mean_fill(classifier.preprocess.mean)


def render_overlay(
    pixels: np.ndarray, grid: np.ndarray, opacity: float = 0.5, colormap: str = "inferno", size: int = DISPLAY_SIZE
) -> np.ndarray:
    """Blend a relevance grid over the image.

    Args:
        pixels: (H, W, 3) uint8, the model's input crop.
        grid: (Gh, Gw) relevance, any scale (stretched to its own min-max range here).
        opacity: weight of the heat map, 0 (image only) to 1 (map only).
        colormap: a matplotlib colormap name.
        size: longer side of the result in pixels.

    Returns:
        (h, w, 3) uint8.
    """
    H, W, _ = pixels.shape
    scale = size / max(H, W)
    w, h = max(1, round(W * scale)), max(1, round(H * scale))
    base = np.asarray(Image.fromarray(pixels).resize((w, h), Image.Resampling.BICUBIC), np.float32)  # (h, w, 3)
    g = np.asarray(grid, np.float32)
    span = float(g.max() - g.min())
    g = (g - g.min()) / span if span > 1e-8 else np.zeros_like(g)  # min-max: the contrast within this map
    heat = np.asarray(Image.fromarray(g).resize((w, h), Image.Resampling.BILINEAR), np.float32)  # (h, w)
    rgb = matplotlib.colormaps[colormap](np.clip(heat, 0.0, 1.0))[..., :3] * 255.0  # (h, w, 3)
    return np.clip((1.0 - opacity) * base + opacity * rgb, 0, 255).astype(np.uint8)


def explain_pixels(
    classifier, pixels: np.ndarray, head_fusion: str, discard_ratio: float, blocks, fill, settings
) -> dict[str, Any]:
    """Rollout map and deletion score of one image. Runs on the batcher's thread, so it does the model's
    work only: the caller renders the overlay (`render_overlay`) in its own colours.

    Returns:
        {"probs": (K,), "grid": (Gh, Gw), "deletion": DeletionScore}.
    """
    probs, maps = classifier.rollout(pixels[None], head_fusion=head_fusion, discard_ratio=discard_ratio, blocks=blocks)
    grid = np.asarray(maps[0], np.float32)  # (Gh, Gw)
    return _with_deletion(classifier, pixels, probs[0], grid, fill, settings)


def _with_deletion(classifier, pixels, probs, grid, fill, settings, target=None) -> dict[str, Any]:
    score = deletion_score(
        classifier.predict_pixels,
        pixels,
        grid,
        fill,
        target=int(np.argmax(probs)) if target is None else target,
        steps=settings.deletion_steps,
        chunk=settings.max_batch_size,
    )
    return {"probs": np.asarray(probs), "grid": grid, "deletion": score}


def cls_attention(classifier, pixels: np.ndarray, block: int, head: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw attention of one block and head: the CLS query's row over the patches, as a grid.

    Returns:
        (probs (K,), grid (Gh, Gw)); for models read out by the patch mean (no CLS token), the mean
        over the patch queries.
    """
    probs, attns = classifier.attentions(pixels[None])  # attns (depth, 1, nh, N, N)
    P, (Gh, Gw) = classifier.num_prefix_tokens, classifier.grid_size
    a = np.asarray(attns[block, 0, head])  # (N, N)
    row = a[0, P:] if classifier.rollout_query == "cls" else a[P:, P:].mean(axis=0)  # (L,)
    return probs[0], row.reshape(Gh, Gw)


def deletion_text(score: DeletionScore, labels) -> str:
    verdict = (
        "**faithful**: removing the highlighted patches hurts the prediction faster than removing random ones"
        if score.faithful
        else "**not better than random**: treat this map with suspicion"
    )
    return (
        f"Deletion score for *{labels[score.target]}* (area under the probability curve as patches are removed; "
        f"lower is better): map **{score.auc_map:.3f}** vs random order **{score.auc_random:.3f}**. {verdict}."
    )


def example_files(folder: str | Path, per_class: int = 1, limit: int = 6) -> list[str]:
    """A few sample images, one per class folder, when the sample data exists."""
    root = Path(folder)
    if not str(folder) or not root.is_dir():
        return []
    found: list[str] = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(f for f in sub.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)[:per_class]
        found += [str(f) for f in files]
        if len(found) >= limit:
            break
    return found[:limit]


def build_ui(classifier, engine, settings) -> gr.Blocks:
    """The Gradio Blocks of the demo (see the module docstring for its api_names)."""
    labels = list(classifier.labels)
    depth, nh = classifier.depth, classifier.num_heads
    fill = mean_fill_of(classifier)
    grads = bool(getattr(classifier, "supports_gradients", False))

    def pixels_of(path: str | None) -> np.ndarray:
        if not path:
            raise gr.Error("upload, paste or take a picture first")
        try:
            return classifier.preprocess.to_uint8(load_image(path, max_pixels=settings.max_pixels))
        except ImageError as e:
            raise gr.Error(str(e)) from None

    def as_label(probs) -> dict[str, float]:
        return {labels[i]: float(p) for i, p in enumerate(np.asarray(probs))}

    def classify(path, head_fusion, discard_ratio, block_start, block_stop, opacity, colormap):
        pixels = pixels_of(path)
        start, stop = int(block_start), int(block_stop)
        if not 0 <= start < stop <= depth:
            raise gr.Error(f"the block range must satisfy 0 <= first < last <= {depth}; got {start} to {stop}")
        blocks = None if (start, stop) == (0, depth) else (start, stop)
        ex = engine.run_sync(
            explain_pixels, classifier, pixels, head_fusion, float(discard_ratio), blocks, fill, settings
        )
        overlay = render_overlay(pixels, ex["grid"], float(opacity), colormap)
        seen_big = render_overlay(pixels, ex["grid"], 0.0)  # the input crop at display size
        last = (pixels, ex["grid"])  # kept in the page's state: restyling needs no model call
        return as_label(ex["probs"]), overlay, deletion_text(ex["deletion"], labels), seen_big, last

    def reclassify(path, *controls):
        if not path:
            return [gr.update()] * 5  # a control moved before any upload: nothing to redo
        return classify(path, *controls)

    def restyle(last, opacity, colormap):
        if last is None:
            return gr.update()
        pixels, grid = last
        return render_overlay(pixels, grid, float(opacity), colormap)

    def attention(path, block, head, opacity, colormap):
        pixels = pixels_of(path)
        b, h = int(block), int(head)
        if not (0 <= b < depth and 0 <= h < nh):
            raise gr.Error(f"block must be in 0..{depth - 1} and head in 0..{nh - 1}")

        def run():
            probs, grid = cls_attention(classifier, pixels, b, h)
            return _with_deletion(classifier, pixels, probs, grid, fill, settings)

        ex = engine.run_sync(run)
        return render_overlay(pixels, ex["grid"], float(opacity), colormap), deletion_text(ex["deletion"], labels)

    def gradient(path, label, opacity, colormap):
        if not grads:
            raise gr.Error(NO_GRADIENTS)
        pixels = pixels_of(path)
        target = labels.index(label) if label in labels else None

        def run():
            probs, maps = classifier.gradient_rollout(pixels[None], target=target)
            return _with_deletion(classifier, pixels, probs[0], np.asarray(maps[0], np.float32), fill, settings, target)

        ex = engine.run_sync(run)
        return render_overlay(pixels, ex["grid"], float(opacity), colormap), deletion_text(ex["deletion"], labels)

    with gr.Blocks(title=f"vitscope: {classifier.name}") as demo:
        gr.Markdown(
            f"# vitscope: where did the transformer look?\n"
            f"Model **{classifier.name}** (version {classifier.version}), {len(labels)} classes: "
            f"{', '.join(labels[:20])}{' ...' if len(labels) > 20 else ''}. "
            f"Uploads up to {settings.max_bytes // (1024 * 1024)} MiB."
        )
        with gr.Row(equal_height=True):
            image = gr.Image(
                type="filepath",
                image_mode=None,
                sources=["upload", "clipboard", "webcam"],
                label="Image (upload, paste or webcam)",
                height=300,
            )
            seen = gr.Image(type="numpy", label="What the model sees", interactive=False, height=300)
            overlay = gr.Image(
                type="numpy", label="Attention rollout", interactive=False, elem_id="overlay", height=300
            )
        with gr.Row():
            label = gr.Label(num_top_classes=min(settings.top_k, len(labels)), label="Prediction", elem_id="label")
            faith = gr.Markdown(elem_id="faithfulness")
        with gr.Row():
            fusion = gr.Radio(["mean", "max", "min"], value="mean", label="Head fusion")
            discard = gr.Slider(0.0, 0.95, value=0.0, step=0.05, label="Discard ratio (lowest attentions dropped)")
            opacity = gr.Slider(0.0, 1.0, value=0.5, step=0.05, label="Overlay opacity")
            cmap = gr.Dropdown(list(COLORMAPS), value=COLORMAPS[0], label="Colormap")
        with gr.Row():
            first = gr.Slider(0, depth - 1, value=0, step=1, label="First block")
            last_block = gr.Slider(1, depth, value=depth, step=1, label="Last block (exclusive)")
        run_btn = gr.Button("Classify and explain", variant="primary")
        inputs = [image, fusion, discard, first, last_block, opacity, cmap]
        last_explained = gr.State(None)
        outputs = [label, overlay, faith, seen, last_explained]
        run_btn.click(classify, inputs, outputs, api_name="classify")
        image.change(reclassify, inputs, outputs, api_name=False)
        for control in (opacity, cmap):
            control.change(restyle, [last_explained, opacity, cmap], overlay, api_name=False, show_progress="hidden")
        fusion.change(reclassify, inputs, outputs, api_name=False)
        for slider in (discard, first, last_block):
            slider.release(reclassify, inputs, outputs, api_name=False)

        with gr.Tab("Raw attention (per block, per head)"):
            with gr.Row():
                blk = gr.Slider(0, depth - 1, value=depth - 1, step=1, label="Block")
                head = gr.Slider(0, nh - 1, value=0, step=1, label="Head")
            query = "the CLS token's" if classifier.rollout_query == "cls" else "the patches' mean"
            attn_btn = gr.Button(f"Show {query} attention")
            with gr.Row():
                attn_img = gr.Image(type="numpy", label=f"{query.capitalize()} attention, this head", interactive=False)
                attn_faith = gr.Markdown()
            attn_btn.click(attention, [image, blk, head, opacity, cmap], [attn_img, attn_faith], api_name="attention")

        with gr.Tab("Gradient rollout"):
            why = "" if grads else f" (off: {NO_GRADIENTS})"
            target = gr.Dropdown(labels, value=labels[0], label=f"Class to explain{why}", interactive=grads)
            grad_btn = gr.Button("Gradient rollout for this class", interactive=grads)
            with gr.Row():
                grad_img = gr.Image(type="numpy", label="Gradient rollout", interactive=False)
                grad_faith = gr.Markdown()
            grad_btn.click(
                gradient, [image, target, opacity, cmap], [grad_img, grad_faith], api_name="gradient_rollout"
            )

        with gr.Tab("Model"):
            gr.JSON(_jsonable(getattr(classifier, "metadata", {})), label="Model metadata")

        examples = example_files(settings.examples_dir)
        if examples:
            gr.Examples(examples, inputs=[image], label="Sample images")
    return demo


def _jsonable(meta: Any) -> Any:
    if isinstance(meta, dict):
        return {str(k): _jsonable(v) for k, v in meta.items()}
    if isinstance(meta, (list, tuple)):
        return [_jsonable(v) for v in meta]
    if isinstance(meta, (str, int, float, bool)) or meta is None:
        return meta
    return str(meta)
