"""How far can the exported file's scores, sets and unknown verdicts be trusted?

Exports each run's best.ckpt (calibrated on its calibration split) and scores it on images the calibration never
saw: ECE and NLL before and after calibration; coverage and set size of LAC and APS sets; the AUROC of each
unknown-input score against digits, noise and photo crops, and against other photos cropped at every side from 28
to 224 px (scikit-image's; and the open-set model's 2 held-out classes).

    .venv/bin/python -m benchmarks.trust --fmnist runs/fmnist-bench --openset runs/fmnist8 --sample runs/sample
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits, load_sample_images
from sklearn.metrics import roc_auc_score

from benchmarks.common import Result, add_results_option, previous
from serve.export.cli import export_onnx
from serve.runtime import calibration as cal
from serve.runtime.classifier import OnnxClassifier
from serve.runtime.images import load_image

COVERAGES = (0.90, 0.95)
# Unknown inputs at any size: crops of scikit-image's photos (none of them in `far_ood`) at each of these sides,
# which the classifier resizes to its input as it does any image
CROP_SIDES = (28, 32, 48, 64, 96, 128, 224)
SKIMAGE_PHOTOS = ("astronaut", "camera", "chelsea", "coffee", "rocket", "clock", "coins", "moon", "grass", "brick")
HELD_OUT = ("ankle_boot", "bag")  # the open-set model's unseen classes (data/fmnist8 links the other 8)
MODELS = ("fmnist", "fmnist8", "digits sample")  # the order of the tables' rows


def pixels_of(clf: OnnxClassifier, paths) -> np.ndarray:
    return np.stack([clf.prepare(load_image(p)) for p in paths])


def folder_images(root: Path, classes: list[str]) -> tuple[list[Path], np.ndarray]:
    paths, labels = [], []
    for y, c in enumerate(classes):
        found = sorted((root / c).glob("*.png"))
        paths += found
        labels += [y] * len(found)
    return paths, np.asarray(labels)


def far_ood(clf: OnnxClassifier, n: int = 600, seed: int = 0) -> dict[str, np.ndarray]:
    """Digits scaled to the model's size, uniform noise, and crops of scikit-learn's two sample photos."""
    rng = np.random.default_rng(seed)
    H, W = clf.input_size
    digits = (load_digits().images[:n] * (255 / 16)).astype(np.uint8)
    digits = [Image.fromarray(d, "L").convert("RGB").resize((W, H), Image.BICUBIC) for d in digits]
    noise = rng.integers(0, 256, (n, H, W, 3), dtype=np.uint8)
    photos = load_sample_images().images
    crops = [square_crop(p, int(rng.integers(48, 200)), rng) for p in photos for _ in range(n // 2)]
    return {"digits": pixels_of(clf, digits), "noise": noise, "photos": pixels_of(clf, crops)}


def square_crop(photo: np.ndarray, side: int, rng: np.random.Generator) -> np.ndarray:
    """A `side` x `side` crop of (H, W, 3) `photo` at a random place."""
    y, x = int(rng.integers(0, photo.shape[0] - side)), int(rng.integers(0, photo.shape[1] - side))
    return np.ascontiguousarray(photo[y : y + side, x : x + side])


def photos_at_any_size(clf: OnnxClassifier, per_photo: int = 40, seed: int = 1) -> dict[str, np.ndarray]:
    """Square crops of scikit-image's sample photos at each side of `CROP_SIDES`: one set per side."""
    try:
        import skimage.data
    except ImportError as e:
        raise SystemExit("benchmarks.trust: the photos at any size need scikit-image (pip install scikit-image)") from e
    rng = np.random.default_rng(seed)
    photos = [getattr(skimage.data, name)() for name in SKIMAGE_PHOTOS]
    photos = [np.stack([p] * 3, -1) if p.ndim == 2 else p for p in photos]  # (H, W, 3) uint8
    return {
        f"other photos, {side}-px crops": pixels_of(
            clf, [square_crop(p, side, rng) for p in photos for _ in range(per_photo)]
        )  # fmt: skip
        for side in CROP_SIDES
    }


class Scored:
    """One exported file's logits and features for any pixels, and the three OOD scores it can give."""

    def __init__(self, clf: OnnxClassifier):
        self.clf, self.T = clf, clf.trust.temperature

    def outputs(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = [self.clf.session.run(["logits", "features"], {"pixels": pixels[i : i + 500]}) for i in
               range(0, len(pixels), 500)]  # fmt: skip
        return np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])

    def logits(self, pixels: np.ndarray) -> np.ndarray:
        return self.outputs(pixels)[0]

    def ood(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        """Each score's (n,) values, and "verdict": the file's own unknown verdict (its score and threshold)."""
        logits, features = self.outputs(pixels)
        probs = self.clf.probabilities(logits)
        g = self.clf.trust.gaussian
        if not g:  # a file that scores with energy or max-softmax: fit the Gaussian here, on its calibration split
            raise ValueError("export with --ood-score mahalanobis (the default) to compare the three scores")
        scores = {k: cal.ood_score(k, probs, logits, self.T, features=features, **g) for k in cal.OOD_SCORES}
        scores["verdict"] = self.clf.judge(logits, features).unknown
        return scores


def coverage_rows(calib_logits, calib_labels, calibrate, test_logits, test_labels) -> list[dict]:
    """Coverage and mean set size at each target, for each method, marginal and class-conditional."""
    cp, tp = calibrate(calib_logits), calibrate(test_logits)
    rows = []
    for method in cal.CONFORMAL_METHODS:
        true = cal.conformal_scores(cp, method)[np.arange(len(calib_labels)), calib_labels]
        test_scores = cal.conformal_scores(tp, method)
        for cc in (False, True):
            for target in COVERAGES:
                if cc:
                    try:
                        q = np.array([cal.conformal_threshold(np.sort(true[calib_labels == k]), target) for k in
                                      range(cp.shape[1])])  # fmt: skip
                    except ValueError:  # too few images per class for this coverage: the file refuses it too
                        continue
                else:
                    q = np.full(cp.shape[1], cal.conformal_threshold(np.sort(true), target))
                inside = test_scores <= q[None]
                rows.append({
                    "method": method + (" class-cond." if cc else ""),
                    "target": target,
                    "coverage": round(float(inside[np.arange(len(test_labels)), test_labels].mean()), 4),
                    "mean_set_size": round(float(inside.sum(1).mean()), 3),
                    "empty_sets": round(float((inside.sum(1) == 0).mean()), 4),
                })  # fmt: skip
    return rows


def evaluate(name: str, ckpt: Path, test_root: Path, classes: list[str], workdir: Path, ood_sets: bool) -> dict:
    model = workdir / f"{name}.onnx"
    export_onnx(ckpt, model, gradients=False)
    clf = OnnxClassifier(model)
    split = json.loads((ckpt.resolve().parent.parent / "split.json").read_text())
    calib_pixels = pixels_of(clf, [e["path"] for e in split["calib"]])
    calib_labels = np.array([e["label"] for e in split["calib"]])
    if test_root is None:  # the run's own validation split
        paths, labels = [e["path"] for e in split["val"]], np.array([e["label"] for e in split["val"]])
    else:
        paths, labels = folder_images(test_root, classes)
    s = Scored(clf)
    test_pixels = pixels_of(clf, paths)
    logits = s.logits(test_pixels)
    raw, probs = cal.softmax(logits), clf.probabilities(logits)
    out = {
        "model": name,
        "calibration_images": len(calib_labels),
        "test_images": len(labels),
        "temperature": round(s.T, 4),
        "accuracy": round(float((probs.argmax(1) == labels).mean()), 4),
        "ece_before": round(cal.ece(raw, labels), 4),
        "ece_after": round(cal.ece(probs, labels), 4),
        "nll_before": round(cal.nll(raw, labels), 4),
        "nll_after": round(cal.nll(probs, labels), 4),
        "ood_score": clf.trust.ood_kind,
        "confidence_map": clf.trust.confidence_map is not None,
        "ece_temperature_only": round(cal.ece(cal.softmax(logits, s.T), labels), 4),
        "sets": coverage_rows(s.logits(calib_pixels), calib_labels, clf.probabilities, logits, labels),
        "resplit_coverage": resplit_coverage(s.logits(calib_pixels), calib_labels, logits, labels, clf.probabilities),
    }
    file_sets = clf.assess(test_pixels[:2000], 0.95).sets  # the file's own sets, as served
    hits = [y in st for y, st in zip(labels[:2000], file_sets, strict=True)]
    out["file_coverage_0.95_first_2000"] = round(float(np.mean(hits)), 4)
    known = s.ood(test_pixels)
    out["unknown_rate_test"] = round(float(known["verdict"].mean()), 4)
    if ood_sets:
        out["ood"] = []
        for set_name, px in (far_ood(clf) | photos_at_any_size(clf)).items():
            other = s.ood(px)
            out["ood"].append({"ood_set": set_name, "images": len(px), **auroc(known, other)})
    return out


def auroc(known: dict, other: dict) -> dict:
    """AUROC of each score, and the share of the other images the file's verdict calls unknown."""
    y = lambda k: np.r_[np.zeros(len(known[k])), np.ones(len(other[k]))]
    out = {k: round(float(roc_auc_score(y(k), np.r_[known[k], other[k]])), 4) for k in cal.OOD_SCORES}
    return {**out, "called_unknown": round(float(other["verdict"].mean()), 4)}


def resplit_coverage(calib_logits, calib_labels, test_logits, test_labels, calibrate, trials=100) -> list[dict]:
    """The guarantee is over calibration sets: pool calibration and test images, re-split them at random into
    sets of the same sizes `trials` times, and report the mean coverage of LAC sets (the file's method)."""
    logits, labels = np.concatenate([calib_logits, test_logits]), np.concatenate([calib_labels, test_labels])
    scores = cal.conformal_scores(calibrate(logits), "lac")
    n, rng, rows = len(calib_labels), np.random.default_rng(0), []
    for target in COVERAGES:
        cover, size = [], []
        for _ in range(trials):
            order = rng.permutation(len(labels))
            c, t = order[:n], order[n:]
            q = cal.conformal_threshold(np.sort(scores[c, labels[c]]), target)
            inside = scores[t] <= q
            cover.append(inside[np.arange(len(t)), labels[t]].mean())
            size.append(inside.sum(1).mean())
        rows.append({
            "target": target,
            "trials": trials,
            "coverage": round(float(np.mean(cover)), 4),
            "coverage_sd": round(float(np.std(cover)), 4),
            "mean_set_size": round(float(np.mean(size)), 3),
        })  # fmt: skip
    return rows


def open_set(ckpt: Path, fmnist_val: Path, workdir: Path) -> dict:
    """The 8-class model: its 8 classes' test images against the 2 held-out classes' test images."""
    split = json.loads((ckpt.resolve().parent.parent / "split.json").read_text())
    classes = split["classes"]
    r = evaluate("fmnist8", ckpt, fmnist_val, classes, workdir, ood_sets=False)
    clf = OnnxClassifier(workdir / "fmnist8.onnx")
    s = Scored(clf)
    known = s.ood(pixels_of(clf, folder_images(fmnist_val, classes)[0]))
    held = s.ood(pixels_of(clf, folder_images(fmnist_val, list(HELD_OUT))[0]))
    r["open_set"] = {"held_out": list(HELD_OUT), "images": len(held["energy"]), **auroc(known, held)}
    return r


def by_target(items: list[dict], keys: tuple[str, ...]) -> list:
    """`keys`' values at each of `COVERAGES`, key by key; None where an item has no such target."""
    by = {item["target"]: item for item in items}
    return [by[c][k] if c in by else None for k in keys for c in COVERAGES]


def tables(result: Result, rows: list[dict]) -> None:
    """The rows of every model as the result's tables: calibration, sets, re-split sets, unknown inputs, sources."""
    pct = "{:.2%}"
    ece = ("accuracy", "ECE before", "ECE, temperature alone", "ECE after")
    t = result.table(["model", "test images", *ece[:1], "T", *ece[1:], "NLL before", "NLL after"],
                     formats={c: pct for c in ece} | {"NLL before": "{:.3f}", "NLL after": "{:.3f}"})  # fmt: skip
    for r in rows:
        ece_values = (r["ece_before"], r.get("ece_temperature_only", r["ece_after"]), r["ece_after"])
        nll = (r["nll_before"], r["nll_after"])
        t.add(r["model"], r["test_images"], r["accuracy"], r["temperature"], *ece_values, *nll)
    at = lambda name: [f"{name} at {c:.2f}" for c in COVERAGES]  # one column per target, side by side
    shares = lambda cols: {c: "{:.2f}" if "size" in c else pct for c in cols}
    cols = [*at("coverage"), *at("mean set size"), *at("empty sets")]
    t = result.table(["model", "sets", *cols], formats=shares(cols))
    for r in rows:
        for method in dict.fromkeys(s["method"] for s in r["sets"]):
            t.add(r["model"], method, *by_target([s for s in r["sets"] if s["method"] == method],
                                                 ("coverage", "mean_set_size", "empty_sets")))  # fmt: skip
    cols = [*at("mean coverage"), *at("sd"), *at("mean set size")]
    t = result.table(["model", "sets", "trials", *cols], formats=shares(cols))
    for r in rows:
        if resplit := r.get("resplit_coverage"):
            values = by_target(resplit, ("coverage", "coverage_sd", "mean_set_size"))
            t.add(r["model"], "lac, calibration and test re-split", resplit[0]["trials"], *values)
    scores = ["AUROC max-softmax", "AUROC energy", "AUROC Mahalanobis"]
    t = result.table(["model", "out-of-distribution images", "n", *scores, "called unknown by the file"],
                     formats={c: "{:.4f}" for c in scores} | {"called unknown by the file": pct})  # fmt: skip
    for r in rows:
        t.add(r["model"], "(its own test images)", r["test_images"], None, None, None, r["unknown_rate_test"])
    for r in rows:
        held = [{"ood_set": "2 held-out classes", **r["open_set"]}] if "open_set" in r else []
        for o in r.get("ood", []) + held:
            t.add(r["model"], o["ood_set"], o["images"], o["max_softmax"], o["energy"], o["mahalanobis"],
                  o["called_unknown"])  # fmt: skip
    t = result.table(["model", "measured", "command"], "Where each model's rows come from")
    for r in rows:
        t.add(r["model"], r["date"][:10], f"`{r['command']}`")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fmnist", type=Path, help="a run trained on data/fmnist (10 classes)")
    p.add_argument("--openset", type=Path, help="a run trained on data/fmnist8 (8 classes)")
    p.add_argument("--sample", type=Path, help="a run trained with configs/sample.yaml")
    p.add_argument("--fmnist-data", type=Path, default=Path("data/fmnist"))
    args = add_results_option(p).parse_args()
    result = Result("trust", packages=("onnxruntime", "scikit-learn"), results=args.results)
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.fmnist:
            classes = json.loads((args.fmnist / "split.json").read_text())["classes"]
            r = evaluate("fmnist", args.fmnist / "checkpoints" / "best.ckpt", args.fmnist_data / "val", classes, work,
                         ood_sets=True)  # fmt: skip
            measured.append(r)
        if args.openset:
            measured.append(open_set(args.openset / "checkpoints" / "best.ckpt", args.fmnist_data / "val", work))
        if args.sample:
            measured.append(evaluate("digits sample", args.sample / "checkpoints" / "best.ckpt", None, [], work, False))
    for r in measured:
        r.update(date=result.header["date"], command=result.header["command"])
    # each model's rows are replaced by its latest run; the others stay (the models train at different times)
    old = (previous("trust", args.results) or {}).get("data", {}).get("rows", [])
    mine = {r["model"] for r in measured}
    rows = sorted([r for r in old if r["model"] not in mine] + measured, key=lambda r: MODELS.index(r["model"]))
    tables(result, rows)
    result.data = {"rows": rows}
    result.finish()


if __name__ == "__main__":
    main()
