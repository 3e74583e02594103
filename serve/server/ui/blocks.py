"""The Gradio UI: drop an image, see the class, where the transformer looked, and whether to trust it.

`mount_ui(app, repository, classifier, settings)` mounts the `gr.Blocks` of `build_ui` at `/`. Every model
call goes through the engine, so it runs on the batcher's thread. This is the only module of the
server that imports gradio.

Endpoints for `gradio_client` (``Client(url).predict(..., api_name=...)``):

    /classify          (image, head_fusion, discard_ratio, block_start, block_stop, opacity, colormap)
    /trust             (image, coverage) -> markdown: calibrated confidence, prediction set, unknown verdict
                       -> (top-k label dict, rollout overlay, deletion score text, the model's input crop)
    /attention         (image, block, head, opacity, colormap) -> (CLS attention overlay, deletion score text)
    /gradient_rollout  (image, class label, opacity, colormap) -> (gradient rollout overlay, deletion score text)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gradio as gr
import numpy as np
from fastapi import FastAPI

from serve.runtime.faithfulness import mean_fill
from serve.runtime.images import IMAGE_SUFFIXES, ImageError, PixelBudget
from serve.runtime.rollout import HEAD_FUSIONS
from serve.server.explain import (
    COLORMAPS,
    cls_attention,
    deletion_text,
    explain_pixels,
    render_overlay,
    with_deletion,
)
from serve.server.repository.repository import UnknownModel
from serve.server.repository.version import Retired
from serve.server.ui.http import NoVersionInGradioOpenapi, UiCallErrorsAsJson, UploadLimit
from serve.server.ui.images import cached_image
from serve.server.ui.inputs import Refused, choice, share, uploads_only, whole
from serve.server.ui.metadata import page_metadata

log = logging.getLogger(__name__)

MAX_DISCARD = 0.95  # the discard ratio's slider: the rollout needs some attention left in each row
NO_GRADIENTS = "this model file has no gradient graph (vit-export --no-gradients); re-export it without that flag"
# sessions whose state Gradio keeps (its default is 10,000): each holds a copy of the page's components, ~100 kB
UI_SESSIONS = 1000


def mount_ui(app: FastAPI, repository, classifier, settings, budget: PixelBudget | None = None, models=()) -> FastAPI:
    """`app` with the UI at `/` (the API routes, added before, keep their paths); its calls go to the
    repository's default model, whose `classifier` (any version) lays the page out.

    `gr.mount_gradio_app` leaves the Blocks marked as never launched, and Gradio then skips its check of
    the file paths a client names in a call: any file the server can read could be copied into the cache
    and downloaded. Marking it launched, as `launch()` does, turns the check on: a call may name only
    files uploaded to this server's own temp folder. Paths are never allowed beyond that, and the model
    file and the server's code are blocked outright.
    """
    ui = build_ui(repository, classifier, settings, budget, models)
    ui.queue(max_size=settings.ui_queue_size, default_concurrency_limit=settings.ui_concurrency)
    blocked = [str(Path(classifier.path).resolve()), str(Path(__file__).resolve().parents[1])]  # the model, our code
    app = gr.mount_gradio_app(
        app,
        ui,
        path="/",
        max_file_size=settings.max_bytes,
        ssr_mode=False,
        allowed_paths=[],
        blocked_paths=blocked,
        run_history=False,
    )
    ui.has_launched = True  # what launch() sets: Gradio's processing_utils._check_allowed reads it
    ui.config["version"] = ui.config["version"].split(".")[0]  # gradio_client needs the major; no more
    folder, most = gr.utils.get_upload_folder(), settings.ui_cache_bytes  # the folder: GRADIO_TEMP_DIR, the server's
    app.add_middleware(UiCallErrorsAsJson, retry_after_s=settings.retry_after_s)  # within UploadLimit: Gradio's alone
    app.add_middleware(
        UploadLimit, max_bytes=settings.max_bytes, folder=folder, folder_bytes=most, stale_s=settings.ui_cache_s,
        partial_s=2 * settings.body_timeout_s,  # an upload's partial file unchanged for longer is no upload's
    )  # fmt: skip
    app.add_middleware(NoVersionInGradioOpenapi)
    return app


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


class UiActions:
    """The UI's callbacks for one model: each takes the widgets' values and returns theirs.

    Each call runs on the version the repository serves at that moment (`served`); `classifier`, one of
    the model's versions, gives the page's layout (classes, blocks, heads).
    """

    def __init__(self, repository, classifier, settings, budget: PixelBudget | None = None):
        self.repository, self.layout, self.budget = repository, classifier, budget
        self.limits = settings.request_limits()
        self.labels = list(classifier.labels)
        self.depth, self.nh = classifier.depth, classifier.num_heads
        self.fill = mean_fill(classifier.preprocess.mean)
        self.grads = bool(getattr(classifier, "supports_gradients", False))

    @contextmanager
    def held(self, model: str | None) -> Iterator[Any]:
        """The version the picked model (None: the default one) serves now, held while the block runs, as the API
        routes hold theirs: a rollout that retires it waits for the call before it stops its engine."""
        try:
            with self.repository.hold(model or None) as served:
                yield served
        except (UnknownModel, Retired) as e:
            raise Refused(str(e)) from None

    def pixels_of(self, path: str | None, classifier) -> np.ndarray:
        if not path:
            raise Refused("upload, paste or take a picture first")
        try:
            # the bytes, not the path: an error then says "upload", never where the server keeps files
            data = Path(path).read_bytes()
            return classifier.preprocess.load_pixels(data, self.limits.max_pixels, self.budget)
        except ImageError as e:
            raise Refused(str(e)) from None

    def classify(self, path, head_fusion, discard_ratio, block_start, block_stop, opacity, colormap, model=None):
        start, stop, opacity = whole(block_start, "first block"), whole(block_stop, "last block"), share(opacity)
        fusion, colormap = choice(head_fusion, HEAD_FUSIONS, "head fusion"), choice(colormap, COLORMAPS, "colormap")
        discard = share(discard_ratio, "discard ratio", MAX_DISCARD)
        if not 0 <= start < stop <= self.depth:
            raise Refused(f"the block range must satisfy 0 <= first < last <= {self.depth}; got {start} to {stop}")
        blocks = None if (start, stop) == (0, self.depth) else (start, stop)
        with self.held(model) as served:
            pixels = self.pixels_of(path, served.classifier)
            if (why := no_attention(served.classifier)) is not None:  # it classifies, and says why no overlay
                probs = served.engine.run_sync(served.classifier.predict_pixels, pixels[None])[0]
                label = {self.labels[i]: float(p) for i, p in enumerate(probs)}
                no_grid = np.zeros(served.classifier.grid_size, np.float32)
                return label, None, why, cached_image(render_overlay(pixels, no_grid, 0.0)), None
            args = (served.classifier, pixels, fusion, discard, blocks, self.fill, self.limits)
            ex = served.engine.run_sync(explain_pixels, *args)
        overlay = cached_image(render_overlay(pixels, ex["grid"], opacity, colormap))
        seen_big = cached_image(render_overlay(pixels, ex["grid"], 0.0))  # the input crop at display size
        last = (pixels, ex["grid"])  # kept in the page's state: restyling needs no model call
        label = {self.labels[i]: float(p) for i, p in enumerate(np.asarray(ex["probs"]))}
        return label, overlay, deletion_text(ex["deletion"], self.labels), seen_big, last

    def trust(self, path, coverage, model=None) -> str:
        """Calibrated confidence, the prediction set at `coverage` and the unknown verdict, each explained."""
        if not path:
            return ""
        with self.held(model) as served:
            clf = served.classifier
            pixels = self.pixels_of(path, clf)
            if not clf.calibrated:
                return (
                    "**Uncalibrated model**: scores are raw softmax; export it again with vit-export for sets and "
                    "verdicts."
                )
            try:
                answers = served.engine.run_sync(clf.assess, pixels[None], float(coverage))
            except ValueError as e:
                raise Refused(str(e)) from None
        (p,) = clf.predictions(answers, 1)
        label, prob = p[0]
        at = f"{float(coverage):.0%}"
        if p.prediction_set:
            shown = f"{', '.join(p.prediction_set)}. Sets at this coverage hold the true class {at} of the time."
        else:  # an empty set holds no class: it is one of the misses the coverage allows
            shown = f"empty: no class reaches the bar, so this set misses (at most {1 - float(coverage):.0%} do)."
        lines = [
            f"**Calibrated confidence**: {label} {prob:.1%}. Of the images given this score, about this share are "
            "right.",
            f"**Prediction set at {at}**: {shown}",
        ]
        if p.unknown:
            lines.append(
                f"**Unknown**: not one of the {len(self.labels)} classes this model knows (OOD score "
                f"{p.ood_score:.2f}): the image looks unlike its training images, so its answer is only the least "
                "bad of them."
            )
        else:
            lines.append(
                f"**Known**: the image looks like the training images (OOD score {p.ood_score:.2f}, under the "
                "threshold that accepts 95 % of them)."
            )
        return "\n\n".join(lines)

    def reclassify(self, path, *controls):
        if not path:
            return [gr.update()] * 5  # a control moved before any upload: nothing to redo
        return self.classify(path, *controls)

    def restyle(self, last, opacity, colormap):
        colormap = choice(colormap, COLORMAPS, "colormap")
        if last is None:
            return gr.update()
        pixels, grid = last
        return cached_image(render_overlay(pixels, grid, share(opacity), colormap))

    def attention(self, path, block, head, opacity, colormap, model=None):
        b, h, colormap = whole(block, "block"), whole(head, "head"), choice(colormap, COLORMAPS, "colormap")
        if not (0 <= b < self.depth and 0 <= h < self.nh):
            raise Refused(f"block must be in 0..{self.depth - 1} and head in 0..{self.nh - 1}")
        with self.held(model) as served:
            clf, pixels = served.classifier, self.pixels_of(path, served.classifier)
            if (why := no_attention(clf)) is not None:
                raise Refused(why)

            def run():
                probs, grid = cls_attention(clf, pixels, b, h)
                return with_deletion(clf, pixels, probs, grid, self.fill, self.limits)

            ex = served.engine.run_sync(run)
        return self._shown(ex, pixels, opacity, colormap)

    def gradient(self, path, label, opacity, colormap, model=None):
        colormap = choice(colormap, COLORMAPS, "colormap")
        if not self.grads:
            raise Refused(NO_GRADIENTS)
        target = self.labels.index(label) if label in self.labels else None
        with self.held(model) as served:
            clf, pixels = served.classifier, self.pixels_of(path, served.classifier)

            def run():
                probs, maps = clf.gradient_rollout(pixels[None], target=target)
                grid = np.asarray(maps[0], np.float32)
                return with_deletion(clf, pixels, probs[0], grid, self.fill, self.limits, target)

            ex = served.engine.run_sync(run)
        return self._shown(ex, pixels, opacity, colormap)

    def _shown(self, ex, pixels, opacity, colormap):
        overlay = cached_image(render_overlay(pixels, ex["grid"], share(opacity), colormap))
        return overlay, deletion_text(ex["deletion"], self.labels)


def build_ui(repository, classifier, settings, budget: PixelBudget | None = None, models=()) -> gr.Blocks:
    """The Gradio Blocks of the demo (see the module docstring for its api_names); `models` go in the picker
    (the page is laid out for `classifier`, so they should share its classes and depth)."""
    on = UiActions(repository, classifier, settings, budget)
    labels = on.labels
    # delete_cache: uploads and results older than ui_cache_s go, checked as often, and all at shutdown
    cache = (settings.ui_cache_s, settings.ui_cache_s)
    with gr.Blocks(title=f"vitscope: {classifier.name}", analytics_enabled=False, delete_cache=cache) as demo:
        demo.state_session_capacity = UI_SESSIONS
        gr.Markdown(
            f"# vitscope: where did the transformer look?\n"
            f"Model **{classifier.name}** (version {classifier.version}), {len(labels)} classes: "
            f"{', '.join(labels[:20])}{' ...' if len(labels) > 20 else ''}. "
            f"Uploads up to {settings.max_bytes // (1024 * 1024)} MiB."
        )
        picked = gr.State(None)  # per page; a State is no input of the API: gradio_client calls get the default
        if len(models) > 1:
            picker = gr.Dropdown(list(models), value=models[0], label="Model")
            picker.change(lambda name: name, picker, picked, api_name=False)
        image, opacity, cmap = _rollout_panel(on, settings, picked)
        uploads_only(demo, image, settings.max_pixels)
        _attention_tab(on, image, opacity, cmap, picked)
        _gradient_tab(on, image, opacity, cmap, picked)
        with gr.Tab("Model"):
            gr.JSON(page_metadata(getattr(classifier, "metadata", {})), label="Model metadata")
        examples = example_files(settings.examples_dir)
        if examples:
            gr.Examples(examples, inputs=[image], label="Sample images")
    for fn in demo.fns.values():  # one group: --ui-concurrency bounds the model's calls together, not each event's
        if getattr(fn.fn, "__self__", None) is on and fn.fn.__name__ != "restyle":  # a restyle only redraws
            fn.concurrency_id = "model"
    return demo


def no_attention(classifier) -> str | None:
    """Why the file cannot explain (no attention output), or None when it can."""
    try:
        classifier.check_attention()
    except ValueError as e:
        return str(e)
    return None


def _rollout_panel(on: UiActions, settings, picked):
    """The image, the prediction and the rollout overlay with its controls; returns the widgets the tabs share."""
    with gr.Row(equal_height=True):
        image = gr.Image(
            type="filepath",
            image_mode=None,
            sources=["upload", "clipboard", "webcam"],
            label="Image (upload, paste or webcam)",
            height=300,
        )
        seen = gr.Image(type="numpy", label="What the model sees", interactive=False, height=300)
        overlay = gr.Image(type="numpy", label="Attention rollout", interactive=False, elem_id="overlay", height=300)
    with gr.Row():
        label = gr.Label(num_top_classes=min(settings.top_k, len(on.labels)), label="Prediction", elem_id="label")
        with gr.Column():
            trust = gr.Markdown(elem_id="trust")
            top = on.layout.trust_summary().get("max_coverage", 0.99)
            coverage = gr.Slider(0.5, min(0.99, top), value=min(0.9, top), step=0.01, label="Coverage of the set")
        faith = gr.Markdown(elem_id="faithfulness")
    with gr.Row():
        fusion = gr.Radio(list(HEAD_FUSIONS), value=HEAD_FUSIONS[0], label="Head fusion")
        discard = gr.Slider(0.0, MAX_DISCARD, value=0.0, step=0.05, label="Discard ratio (lowest attentions dropped)")
        opacity = gr.Slider(0.0, 1.0, value=0.5, step=0.05, label="Overlay opacity")
        cmap = gr.Dropdown(list(COLORMAPS), value=COLORMAPS[0], label="Colormap")
    with gr.Row():
        first = gr.Slider(0, on.depth - 1, value=0, step=1, label="First block")
        last_block = gr.Slider(1, on.depth, value=on.depth, step=1, label="Last block (exclusive)")
    run_btn = gr.Button("Classify and explain", variant="primary")
    inputs = [image, fusion, discard, first, last_block, opacity, cmap, picked]
    last_explained = gr.State(None)
    outputs = [label, overlay, faith, seen, last_explained]
    run_btn.click(on.classify, inputs, outputs, api_name="classify")
    image.change(on.reclassify, inputs, outputs, api_name=False)
    run_btn.click(on.trust, [image, coverage, picked], trust, api_name="trust")
    image.change(on.trust, [image, coverage, picked], trust, api_name=False)
    coverage.release(on.trust, [image, coverage, picked], trust, api_name=False)
    for control in (opacity, cmap):
        control.change(on.restyle, [last_explained, opacity, cmap], overlay, api_name=False, show_progress="hidden")
    fusion.change(on.reclassify, inputs, outputs, api_name=False)
    for slider in (discard, first, last_block):
        slider.release(on.reclassify, inputs, outputs, api_name=False)
    return image, opacity, cmap


def _attention_tab(on: UiActions, image, opacity, cmap, picked) -> None:
    with gr.Tab("Raw attention (per block, per head)"):
        with gr.Row():
            blk = gr.Slider(0, on.depth - 1, value=on.depth - 1, step=1, label="Block")
            head = gr.Slider(0, on.nh - 1, value=0, step=1, label="Head")
        query = "the CLS token's" if on.layout.rollout_query == "cls" else "the patches' mean"
        attn_btn = gr.Button(f"Show {query} attention")
        with gr.Row():
            attn_img = gr.Image(type="numpy", label=f"{query.capitalize()} attention, this head", interactive=False)
            attn_faith = gr.Markdown()
        attn_btn.click(
            on.attention, [image, blk, head, opacity, cmap, picked], [attn_img, attn_faith], api_name="attention"
        )


def _gradient_tab(on: UiActions, image, opacity, cmap, picked) -> None:
    with gr.Tab("Gradient rollout"):
        why = "" if on.grads else f" (off: {NO_GRADIENTS})"
        target = gr.Dropdown(on.labels, value=on.labels[0], label=f"Class to explain{why}", interactive=on.grads)
        grad_btn = gr.Button("Gradient rollout for this class", interactive=on.grads)
        with gr.Row():
            grad_img = gr.Image(type="numpy", label="Gradient rollout", interactive=False)
            grad_faith = gr.Markdown()
        grad_btn.click(
            on.gradient, [image, target, opacity, cmap, picked], [grad_img, grad_faith], api_name="gradient_rollout"
        )
