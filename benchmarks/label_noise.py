"""Wrong labels: how many of the flipped labels in a Fashion-MNIST folder does `reports/label_issues.csv` list?

    vit-fashion-mnist --out data/fmnist
    nice -n 10 .venv/bin/python -m benchmarks.label_noise            # builds the folder, trains twice, reports
    .venv/bin/python -m benchmarks.label_noise --run-dir runs/label-noise  # reports a run already made

20,000 images drawn from the official training set, 10 % of them given a uniformly drawn wrong class (the
truth is kept in `truth.csv` beside the folder), trained with `configs/small_images.yaml`; `label_issues.csv`
(confident learning, `train.label_issues`) is scored against the flips, beside the plain rule: flag when the
given label's calibrated probability is under 0.1 and another class wins, and confident learning's own rule. All
read the same probabilities: the run's last (EMA) network (the one that wrote label_issues.csv at the end of the
fit) on unaugmented images, temperature fitted on the calibration split. A second run trains on the same folder
with label_issues.csv's suggestions as `--data.corrections`, and both are scored on the official test set.
Target: precision >= 0.9 and recall >= 0.9.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Result, add_results_option

REPO = Path(__file__).resolve().parents[1]


def make_noisy_folder(source: Path, out: Path, images: int, noise: float, seed: int) -> Path:
    """Copy `images` images of `source/<class>/` into `out/<class>/`, a `noise` share under a wrong class.

    Returns the truth file, `out.parent/<out.name>.truth.csv`: `file,true,given` (class names).
    """
    truth = out.parent / f"{out.name}.truth.csv"
    if truth.is_file():
        return truth
    classes = sorted(d.name for d in source.iterdir() if d.is_dir())
    files = [(f, k) for k, c in enumerate(classes) for f in sorted((source / c).glob("*.png"))]
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(files), images, replace=False)
    flipped = set(rng.choice(images, round(noise * images), replace=False).tolist())
    shutil.rmtree(out, ignore_errors=True)
    for c in classes:
        (out / c).mkdir(parents=True)
    rows = []
    for n, i in enumerate(chosen.tolist()):
        f, k = files[i]
        given = (k + int(rng.integers(1, len(classes)))) % len(classes) if n in flipped else k  # never the true one
        name = f"{k}_{f.stem}.png"  # unique across classes
        shutil.copyfile(f, out / classes[given] / name)
        rows.append((name, classes[k], classes[given]))
    with open(truth, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["file", "true", "given"])
        w.writerows(rows)
    return truth


def train(data: Path, run_dir: Path, epochs: int, corrections: Path | None = None) -> float:
    cmd = [str(Path(sys.executable).parent / "vit-train"), "fit", "--config", "configs/small_images.yaml"]
    cmd += ["--data.root", str(data), "--data.img_size", "28", "--trainer.default_root_dir", str(run_dir)]
    cmd += ["--data.corrections", str(corrections)] if corrections else []
    cmd += ["--trainer.max_epochs", str(epochs), "--trainer.enable_progress_bar", "false", "--overwrite", "true"]
    cmd += ["--model.compile", "false"]  # eager, as its figures (and the minutes beside them) were measured
    cmd += ["--model.net_args.flip_tta", "false", "--trainer.check_val_every_n_epoch", "1"]  # as they were measured
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def suggested_corrections(run_dir: Path) -> Path:
    """`run_dir/suggested_corrections.csv`: every image label_issues.csv lists, relabelled as it suggests."""
    out = run_dir / "suggested_corrections.csv"
    with open(run_dir / "reports" / "label_issues.csv") as f, open(out, "w", newline="") as g:
        w = csv.writer(g)
        w.writerow(["path", "label"])
        w.writerows((r["path"], r["suggested"]) for r in csv.DictReader(f))
    return out


def official_accuracy(run_dir: Path, test: Path) -> float:
    """Accuracy of the run's last checkpoint on the official test set (the same number of images a class)."""
    from benchmarks.long_tail import score  # torch: only once a run is there

    return float(score(run_dir, test).mean())


def scores(flagged: set[str], wrong: set[str]) -> tuple[int, float, float]:
    """(flagged images, precision, recall) of `flagged` file names against the `wrong` ones."""
    hits = len(flagged & wrong)
    return len(flagged), hits / max(len(flagged), 1), hits / max(len(wrong), 1)


def evaluate(run_dir: Path, truth: Path) -> dict:
    """Precision and recall of label_issues.csv and of the plain rule, overall and per split."""
    from train.checkpoint_format import load_network  # torch: only once a run is there
    from train.label_issues import (
        RELATIVE_FLOOR,
        baseline_issues,
        calibrated_probs,
        confident_joint_issues,
        find_label_issues,
        predict_logits,
    )

    with open(truth) as f:
        wrong = {r["file"] for r in csv.DictReader(f) if r["true"] != r["given"]}
    split = json.loads((run_dir / "split.json").read_text())
    parts = {s: [(e["path"], e["label"]) for e in split[s]] for s in ("train", "val", "calib")}
    items = [it for s in parts for it in parts[s]]
    names = np.array([Path(p).name for p, _ in items])
    labels = np.array([y for _, y in items])
    which = np.repeat(list(parts), [len(v) for v in parts.values()])  # (N,) each image's split
    net, meta = load_network(run_dir / "checkpoints" / "last.ckpt")
    logits, _ = predict_logits(net, meta["preprocess"], items, 500)  # Fashion-MNIST: every image decodes
    probs = calibrated_probs(logits, labels, which == "calib")
    methods = {
        f"label_issues.csv: given < {RELATIVE_FLOOR} x its class's mean, another wins": find_label_issues(
            probs, labels
        ),
        "confident learning's confident-joint rule": confident_joint_issues(probs, labels),
        "plain rule: given < 0.1, another wins": baseline_issues(probs, labels),
    }
    methods = {m: set(names[issues.index]) for m, issues in methods.items()}
    out = {"methods": {m: scores(f, wrong) for m, f in methods.items()}, "splits": {}}
    for s in parts:
        here = set(names[which == s])
        out["splits"][s] = {m: scores(f & here, wrong & here) for m, f in methods.items()}
    out["images"], out["wrong"] = len(items), len(wrong)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("data/fmnist/train"), help="the official training set")
    parser.add_argument("--data", type=Path, default=Path("data/fmnist_noisy"), help="the noisy folder (made once)")
    parser.add_argument("--run-dir", type=Path, default=None, help="report this finished run instead of training")
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=30, help="max_epochs (the config's: 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test", type=Path, default=Path("data/fmnist"), help="its val/ is the official test set")
    parser.add_argument(
        "--no-corrected",
        dest="corrected",
        action="store_false",
        help="skip the second run, trained with label_issues.csv's suggestions applied",
    )
    args = add_results_option(parser).parse_args()
    truth = make_noisy_folder(args.source, args.data, args.images, args.noise, args.seed)
    run_dir, wall = args.run_dir or Path("runs/label-noise"), None
    if args.run_dir is None:
        wall = train(args.data, run_dir, args.epochs)
    found = evaluate(run_dir, truth)
    fixed = run_dir.with_name(run_dir.name + "-corrected")
    if args.corrected and (args.run_dir is None or not (fixed / "checkpoints" / "last.ckpt").is_file()):
        train(args.data, fixed, args.epochs, suggested_corrections(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    setting = {"images": found["images"], "wrong labels": found["wrong"], "epochs": summary["epochs"]}
    result = Result("label_noise", setting, ("torch", "lightning"), results=args.results)
    fmt = {"precision": "{:.3f}", "recall": "{:.3f}"}
    table = result.table(["method", "flagged", "precision", "recall"], formats=fmt)
    for name, row in found["methods"].items():
        table.add(name, *row)
    per = result.table(["label_issues.csv, by split", "flagged", "precision", "recall"], formats=fmt)
    for s, methods in found["splits"].items():
        per.add(s, *next(iter(methods.values())))
    run = result.table(["run", "value"])
    run.add("official test accuracy, trained as given", f"{100 * official_accuracy(run_dir, args.test):.2f} %")
    if (fixed / "checkpoints" / "last.ckpt").is_file():
        accuracy = official_accuracy(fixed, args.test)
        run.add("official test accuracy, label_issues.csv's suggestions applied", f"{100 * accuracy:.2f} %")
    run.add("best validation accuracy (noisy labels)", f"{100 * summary['best_val_acc']:.2f} %")
    run.add("fit time", f"{summary['fit_seconds'] / 60:.1f} min")
    if wall is not None:
        run.add("command wall time", f"{wall / 60:.1f} min")
    result.notes.append(
        f"The network trained {summary['epochs']} epochs on the noisy labels; the better it tells the classes apart, "
        "the fewer clean images its own errors put on the list. The second run relabels every listed image as "
        "suggested, without a person's review."
    )
    result.data = found
    result.finish()


if __name__ == "__main__":
    main()
