"""Does the rollout point at the object? The pointing game on digits placed in clutter.

Each digit is shrunk and pasted at a random place among random strokes and dots; a map hits when the centre of
its highest patch lies inside the digit's box. Canvases and boxes.json are written to `--out` for checking by eye.

    .venv/bin/python -m benchmarks.pointing_game artifacts/sample.onnx [--n 300] [--out runs/pointing_game]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from benchmarks.common import Result, add_results_option
from serve.runtime.classifier import OnnxClassifier


def make_canvas(
    digit: Image.Image, size: tuple[int, int], scale: float, clutter: int, rng: np.random.Generator
) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """An (H, W, 3) uint8 canvas of `size` with `clutter` grey strokes and dots and the digit (dark ink on white,
    `scale` of the canvas side) at a random place, and the tight box of its ink (x0, y0, x1, y1), end-exclusive."""
    H, W = size
    h, w = max(4, round(H * scale)), max(4, round(W * scale))
    ink = np.asarray(digit.convert("L").resize((w, h), Image.Resampling.BILINEAR))  # (h, w)
    canvas = Image.new("L", (W, H), 255)
    draw = ImageDraw.Draw(canvas)
    for _ in range(clutter):
        gray = int(rng.integers(110, 210))
        if rng.random() < 0.5:
            x0, y0 = rng.integers(0, W), rng.integers(0, H)
            dx, dy = rng.integers(-W // 4, W // 4 + 1), rng.integers(-H // 4, H // 4 + 1)
            draw.line([(int(x0), int(y0)), (int(x0 + dx), int(y0 + dy))], fill=gray, width=int(rng.integers(1, 3)))
        else:
            x0, y0, r = int(rng.integers(0, W)), int(rng.integers(0, H)), int(rng.integers(1, 3))
            draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r], fill=gray)
    x, y = int(rng.integers(0, W - w + 1)), int(rng.integers(0, H - h + 1))
    a = np.asarray(canvas).copy()
    a[y : y + h, x : x + w] = np.minimum(a[y : y + h, x : x + w], ink)  # ink over clutter
    rows, cols = np.nonzero(ink < 200)
    box = (
        (x, y, x + w, y + h)
        if rows.size == 0
        else (x + cols.min(), y + rows.min(), x + cols.max() + 1, y + rows.max() + 1)
    )
    return np.repeat(a[..., None], 3, axis=-1), tuple(int(v) for v in box)


def patch_centres(grid: tuple[int, int], size: tuple[int, int]) -> np.ndarray:
    """(L, 2) (x, y) centres of the patches, row-major."""
    (Gh, Gw), (H, W) = grid, size
    ys, xs = np.meshgrid((np.arange(Gh) + 0.5) * H / Gh, (np.arange(Gw) + 0.5) * W / Gw, indexing="ij")
    return np.stack([xs.ravel(), ys.ravel()], axis=1)


def inside(points: np.ndarray, box) -> np.ndarray:
    x0, y0, x1, y1 = box
    return (points[:, 0] >= x0) & (points[:, 0] < x1) & (points[:, 1] >= y0) & (points[:, 1] < y1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="the .onnx file (e.g. artifacts/sample.onnx)")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="class folders of digit images")
    p.add_argument("--n", type=int, default=300, help="canvases")
    p.add_argument("--scale", type=float, default=0.5, help="digit side as a fraction of the canvas side")
    p.add_argument("--clutter", type=int, default=10, help="random strokes and dots per canvas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/pointing_game"), help="where canvases and boxes go")
    args = add_results_option(p).parse_args(argv)

    files = sorted(args.data.glob("*/*.png"))
    if not files:
        print(f"no images under {args.data}; run vit-sample-data --out {args.data} first", file=sys.stderr)
        return 2
    clf = OnnxClassifier(args.model)
    rng = np.random.default_rng(args.seed)
    picks = rng.choice(len(files), size=min(args.n, len(files)), replace=False)
    args.out.mkdir(parents=True, exist_ok=True)
    centres = patch_centres(clf.grid_size, clf.input_size)
    centre_patch = int(np.argmin(((centres - np.array(clf.input_size[::-1]) / 2) ** 2).sum(axis=1)))

    methods = ["rollout (mean)", "rollout (max, discard 0.9)", "last block CLS attention (mean of heads)"]
    hits = {m: [] for m in methods + ["centre patch"]}
    random_rate, correct, records = [], 0, []
    for i, idx in enumerate(picks):
        path = files[idx]
        canvas, box = make_canvas(Image.open(path), clf.input_size, args.scale, args.clutter, rng)
        name = f"{i:04d}.png"
        Image.fromarray(canvas).save(args.out / name)
        records.append({"file": name, "source": str(path), "label": path.parent.name, "box_xyxy": box})
        batch = canvas[None]
        probs, mean_map = clf.rollout(batch, head_fusion="mean")
        _, max_map = clf.rollout(batch, head_fusion="max", discard_ratio=0.9)
        _, attns = clf.attentions(batch)
        last = np.mean([cls_attention_from(attns, clf, h) for h in range(clf.num_heads)], axis=0)
        correct += clf.labels[int(probs[0].argmax())] == path.parent.name
        in_box = inside(centres, box)
        for m, grid in zip(methods, (mean_map[0], max_map[0], last), strict=True):
            hits[m].append(bool(in_box[int(np.argmax(grid))]))
        hits["centre patch"].append(bool(in_box[centre_patch]))
        random_rate.append(float(in_box.mean()))
    (args.out / "boxes.json").write_text(json.dumps(records, indent=1))

    n = len(picks)
    setting = {"model": str(args.model), "canvases": n, "canvas": f"{clf.input_size[0]} x {clf.input_size[1]}"}
    setting |= {"digit scale": args.scale, "clutter marks": args.clutter, "seed": args.seed}
    result = Result("pointing_game", setting, packages=("onnxruntime",), results=args.results)
    table = result.table(["map", "pointing game hit rate"], formats={"pointing game hit rate": "{:.1%}"})
    for m, h in hits.items():
        table.add(m, float(np.mean(h)))
    table.add("random patch (expected)", float(np.mean(random_rate)))
    table.notes.append(
        f"classification accuracy on the canvases: {correct / n:.1%} (the model was trained on centred digits)"
    )
    table.notes.append(f"Canvases and boxes: {args.out}/ (boxes.json, x0 y0 x1 y1 in pixels, end-exclusive)")
    result.finish()
    return 0


def cls_attention_from(attns: np.ndarray, clf: OnnxClassifier, head: int) -> np.ndarray:
    """(Gh, Gw) CLS-row attention of the last block and one head, from `attentions` output."""
    P, (Gh, Gw) = clf.num_prefix_tokens, clf.grid_size
    a = attns[-1, 0, head]  # (N, N)
    row = a[0, P:] if P > 0 else a[P:, P:].mean(axis=0)
    return row.reshape(Gh, Gw)


if __name__ == "__main__":
    raise SystemExit(main())
