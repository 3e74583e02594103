"""What `vit-train review` shows: the run's images a person should look at, with the model's view of each.

`ReviewRun(run_dir)` reads the run directory (`checkpoints/best.ckpt`, `split.json`, `reports/`), passes the
network once over the split's images and makes four lists of `Item`s:

- likely wrong labels: `reports/label_issues.csv` (`path,given,suggested,score`), as the run wrote it;
- copies: `reports/duplicates.csv` (`group,path,kind,split,label`), one row per image of each group;
- unknown-looking images: the Mahalanobis OOD score on the network's pre-logit features (the score `vit-export`
  calibrates by default), Gaussian fitted on the training images; listed above the score that accepts 95 % of the
  held-out images (calibration split, else validation);
- the worst validation errors: validation images the network gets wrong, most confidently wrong first.

Probabilities are softmax(logits / T), T fitted on the run's calibration split (1 when it has none).
`explain(path)` gives one image's input crop, probabilities and attention-rollout overlay.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import torch
from PIL import Image

from serve.runtime import calibration as cal
from serve.runtime.image_files import link_loop
from serve.runtime.images import FILE_NAME_ERRORS, ImageError, load_image
from train.checkpoint_format import load_network
from train.corrections import load_corrections, read_corrections
from train.errors import SetupError
from train.review_store import CORRECTIONS_FILE
from vit import flip
from vit.rollout import attention_rollout

# Shapes: n images, K classes, D pre-logit feature width, H/W input crop, Gh/Gw patch grid.

log = logging.getLogger(__name__)

LISTS = ("Likely wrong labels", "Copies", "Unknown-looking images", "Worst validation errors")
CHECKPOINTS = ("best.ckpt", "last.ckpt")  # the best epoch when fit chose one, else the latest
ACCEPT = 0.95  # as vit-export's OOD threshold: 95 % of held-out images count as known
DISPLAY_SIZE = 256  # the input crop is tiny for small models: show it large enough to see


@dataclass
class Item:
    """One image to look at: `given` is its label in the run, `suggested` what to relabel it to (None: no guess)."""

    path: str
    given: str
    suggested: str | None
    score: float
    why: str


def find_checkpoint(run_dir: Path) -> Path:
    """The checkpoint to review with; a clear error when the run has none."""
    if not run_dir.is_dir():
        raise SetupError(f"{run_dir} is not a folder: give the run directory of a fit (--trainer.default_root_dir)")
    for name in CHECKPOINTS:
        if (run_dir / "checkpoints" / name).is_file():
            return run_dir / "checkpoints" / name
    raise SetupError(
        f"{run_dir} has no checkpoints/best.ckpt or last.ckpt: review a run that vit-train fit has trained "
        "(its --trainer.default_root_dir)"
    )


def _read_split(split_file: Path, labels: list[str]) -> dict:
    """The run's split.json, refused unless it is the one that trained the checkpoint's `labels` (another run's,
    after a refit stopped before its first checkpoint, would label every image wrong, or fail on an index)."""
    try:
        split = json.loads(split_file.read_text(encoding="utf-8"))
        classes, root = list(split["classes"]), str(split["root"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SetupError(f"{split_file} is not a split.json that vit-train fit writes ({e})") from None
    if classes != labels or not root:
        raise SetupError(
            f"{split_file} is another run's: its classes {classes} are not the checkpoint's {labels}; review the run "
            "folder whose fit wrote both, or fit again"
        )
    return split


def _split_parts(split: dict, split_file: Path, classes: int) -> dict[str, list[tuple[str, int]]]:
    """(path, label) of each image of the split's parts; a `SetupError` naming `split_file` for an entry fit does not
    write (no path, a label out of 0..K-1, which showed an image as another class or ended in a traceback)."""
    parts = {}
    for key in ("train", "val", "calib"):
        entries = split.get(key, [])
        wrong = [e for e in entries if not _image_entry(e, classes)] if isinstance(entries, list) else [entries]
        if wrong:
            raise SetupError(
                f"{split_file} is not a split.json that vit-train fit writes ({key}: {wrong[0]!r:.100} is not "
                f'{{"path": ..., "label": 0 to {classes - 1}}}): fit the run again, or fix the entry'
            )
        parts[key] = [(e["path"], e["label"]) for e in entries]
    return parts


def _image_entry(entry, classes: int) -> bool:
    """Whether `entry` is one image of a split: {"path": text, "label": a class index} (a bool is not an index)."""
    if not isinstance(entry, dict):
        return False
    label = entry.get("label")
    return isinstance(entry.get("path"), str) and type(label) is int and 0 <= label < classes


class ReviewRun:
    """The lists and the network of one run directory.

    Args:
        run_dir: the folder `vit-train fit` wrote (`--trainer.default_root_dir`).
        limit: at most this many images per list.
        batch_size: images per forward pass.
    """

    def __init__(self, run_dir: str | Path, limit: int = 200, batch_size: int = 64):
        if why := link_loop(Path(run_dir).expanduser()):
            raise ValueError(why)
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.checkpoint = find_checkpoint(self.run_dir)
        split_file, reports = self.run_dir / "split.json", self.run_dir / "reports"
        if not split_file.is_file() or not reports.is_dir():
            raise SetupError(
                f"{self.run_dir} has no {'split.json' if not split_file.is_file() else 'reports/ folder'}: review "
                "a run that vit-train fit has finished (it writes both)"
            )
        self.net, meta = load_network(self.checkpoint)
        self.labels: list[str] = list(meta["class_names"])
        self.preprocess = meta["preprocess"]
        split = _read_split(split_file, self.labels)
        self.data_root = Path(split["root"])  # relative paths in a corrections file start here, as in fit
        self.trained_with = self._corrections(split)
        if (decided := self.run_dir / CORRECTIONS_FILE).exists():  # one fit would refuse: said before the scoring
            read_corrections(decided, self.data_root, self.labels)
        parts = _split_parts(split, split_file, len(self.labels))
        self.given = {p: self.labels[y] for entries in parts.values() for p, y in entries}
        self.limit = limit
        log.info("review: scoring the %d images of %s", len(self.given), self.run_dir)  # once the run is known good
        scored = self._score(parts, batch_size)
        # a list that is empty because its report is missing says so (an older run, or a fit that did not finish)
        self.missing = {
            name: f"this run has no reports/{file}: vit-train fit writes it"
            for name, file in ((LISTS[0], "label_issues.csv"), (LISTS[1], "duplicates.csv"))
            if not (reports / file).is_file()
        }
        self.lists = {
            LISTS[0]: self._read_label_issues(reports / "label_issues.csv"),
            LISTS[1]: self._read_duplicates(reports / "duplicates.csv", scored),
            LISTS[2]: self._unknown(scored),
            LISTS[3]: self._worst_errors(scored),
        }

    def _corrections(self, split: dict) -> dict[str, str | None]:
        """The corrections the run was trained with (absolute path -> label), {} without any or when their file is
        gone (then said: the review cannot carry them on)."""
        file = split.get("corrections")
        if not file:
            return {}
        if not Path(file).is_file():
            log.warning("the run was trained with the corrections of %s, which is gone: review without them", file)
            return {}
        return load_corrections(file, split["root"], self.labels)

    def _pixels(self, path: str) -> np.ndarray:
        """(H, W, 3) uint8: the model's input crop of one image."""
        return self.preprocess.to_uint8(load_image(path))

    @torch.inference_mode()
    def _score(self, parts: dict[str, list[tuple[str, int]]], batch_size: int) -> dict[str, dict]:
        """Per split: paths, labels (n,), logits (n, K), features (n, D); unreadable images are skipped."""
        out, unreadable = {}, []
        for key, entries in parts.items():
            paths, labels, logits, feats = [], [], [], []
            for start in range(0, len(entries), batch_size):
                batch = []
                for p, y in entries[start : start + batch_size]:
                    try:
                        batch.append(self._pixels(p))
                    except (ImageError, OSError) as e:
                        log.debug("review: skipping %s (%s)", p, e)
                        unreadable.append(f"{p} ({e})")
                        continue
                    paths.append(p)
                    labels.append(y)
                if batch:
                    x = torch.from_numpy(self.preprocess.normalize(np.stack(batch)))  # (b, 3, H, W)
                    z, f = flip.logits_and_features(self.net, x)  # (b, K), (b, D): as the exported file answers
                    feats.append(f.numpy())
                    logits.append(z.numpy())
            K = len(self.labels)
            out[key] = {
                "paths": paths,
                "labels": np.asarray(labels, np.int64),
                "logits": np.concatenate(logits) if logits else np.zeros((0, K), np.float32),
                "features": np.concatenate(feats) if feats else None,
            }
        self.unreadable = self._say_unreadable(unreadable, sum(map(len, parts.values())))
        D = next((o["features"].shape[1] for o in out.values() if o["features"] is not None), 0)
        for o in out.values():  # a split with no readable image: no rows, as wide as the others
            o["features"] = o["features"] if o["features"] is not None else np.zeros((0, D), np.float32)
        calib = out["calib"]
        self.temperature = cal.fit_temperature(calib["logits"], calib["labels"]) if len(calib["labels"]) else 1.0
        self.calibrated = bool(len(calib["labels"]))
        for part in out.values():
            part["probs"] = cal.softmax(part["logits"], self.temperature)  # (n, K)
        return out

    def _say_unreadable(self, unreadable: list[str], total: int) -> str:
        """One line for the images the scoring could not read ("" for none), also logged.

        Raises:
            SetupError: none could be read (the data folder moved or gone): the lists would be empty, and look like
                a model that makes no mistake.
        """
        if not unreadable:
            return ""
        where = f"was the data folder {self.data_root} moved or deleted since the run? Put it back there"
        if len(unreadable) == total:
            raise SetupError(f"none of the run's {total} images can be read (first: {unreadable[0]}): {where}")
        said = (
            f"{len(unreadable)} of the run's {total} images cannot be read (first: {unreadable[0]}), and the lists "
            f"leave them out: {where}"
        )
        log.warning("review: %s", said)
        return said

    def _read_report(self, file: Path, columns: tuple[str, ...], item: Callable[[dict], Item]) -> list[Item]:
        """The first `limit` rows of a report of the run as `Item`s ([] without the file).

        Raises:
            SetupError: a report fit does not write (a header cut short, another encoding, a class index out of
                range, a score that is no number, a stray quote), naming the file and the row: one line, where a
                traceback ended the review or the rows were read wrong.
        """
        if not file.is_file():
            return []
        line, fix = 1, "run vit-train fit again to write it, or fix the row"
        try:
            with open(file, newline="", encoding="utf-8", errors=FILE_NAME_ERRORS) as f:
                reader = csv.DictReader(f, strict=True)  # a stray quote is refused, not read as one long field
                if missing := [c for c in columns if c not in (reader.fieldnames or [])]:
                    raise KeyError(f"its header has no {missing[0]} column")
                rows = [(reader.line_num, r) for r in reader]
            items = []
            for at, r in rows[: self.limit]:
                line = at  # said if the row cannot be read
                items.append(item(r))
        except (KeyError, ValueError, IndexError, TypeError, csv.Error) as e:
            line = reader.line_num + 1 if isinstance(e, csv.Error) else line  # the record after the last one read
            why = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise SetupError(f"{file} line {line} is not what vit-train fit writes ({why}): {fix}") from None
        return items

    def _read_label_issues(self, file: Path) -> list[Item]:
        def item(r: dict) -> Item:
            score = float(r["score"] or 0)
            why = f"the run flags it (score {score:.3f})"
            return Item(r["path"], self._name(r["given"]), self._name(r["suggested"]) or None, score, why)

        return self._read_report(file, ("path", "given", "suggested", "score"), item)

    def _name(self, label: str) -> str:
        """A label as a class name (reports may hold the class index); a class name is kept as it is ('dog ')."""
        label = label or ""
        if label in self.labels:
            return label
        label = label.strip()
        if label.isdigit() and label not in self.labels and int(label) >= len(self.labels):
            raise ValueError(f"class index {label}, where the run has {len(self.labels)} classes")
        return self.labels[int(label)] if label.isdigit() and label not in self.labels else label

    def _given(self, path: str) -> str:
        """The label of an image of the run; one it left out (a val copy of a train image) is its folder's class."""
        folder = Path(path).parent.name
        return self.given.get(path) or (folder if folder in self.labels else "?")

    def _read_duplicates(self, file: Path, scored: dict[str, dict]) -> list[Item]:
        every = _joined(scored.values())
        top = dict(zip(every["paths"], [self.labels[k] for k in every["probs"].argmax(-1)], strict=True))
        item = lambda r: Item(
            r["path"], self._given(r["path"]), top.get(r["path"]), float(r["group"]),
            f"copy group {r['group']} ({r['kind']}), in {r['split'] or 'no split'}",
        )  # fmt: skip
        return self._read_report(file, ("group", "path", "kind", "split"), item)

    def _unknown(self, scored: dict[str, dict]) -> list[Item]:
        K = len(self.labels)
        fit = scored["train"] if len(scored["train"]["labels"]) > K else _joined(scored.values())
        if len(fit["labels"]) <= K:
            return []
        means, precision = cal.fit_gaussian(fit["features"], fit["labels"], K)
        held = scored["calib"] if len(scored["calib"]["labels"]) else scored["val"]
        every = _joined(scored.values())
        ood = cal.mahalanobis(every["features"], means, precision)  # (n,)
        known = cal.mahalanobis(held["features"], means, precision)  # (held,)
        bar = float(np.quantile(known, ACCEPT)) if len(known) else 0.0
        order = [i for i in np.argsort(-ood, kind="stable") if ood[i] > bar][: self.limit]
        why = lambda i: f"OOD score {ood[i]:.1f} (known images: under {bar:.1f})"
        return [self._item(every, i, float(ood[i]), why(i)) for i in order]

    def _worst_errors(self, scored: dict[str, dict]) -> list[Item]:
        val = scored["val"]
        top = val["probs"].argmax(-1) if len(val["labels"]) else np.zeros(0, np.int64)
        wrong = np.flatnonzero(top != val["labels"])
        conf = val["probs"][wrong, top[wrong]]
        order = wrong[np.argsort(-conf, kind="stable")][: self.limit]
        why = "validation image, predicted wrongly"
        return [self._item(val, i, float(val["probs"][i, top[i]]), why) for i in order]

    def _item(self, part: dict, i: int, score: float, why: str) -> Item:
        suggested = self.labels[int(part["probs"][i].argmax())]
        return Item(part["paths"][i], self.labels[int(part["labels"][i])], suggested, score, why)

    @torch.inference_mode()
    def explain(self, path: str) -> tuple[np.ndarray, dict[str, float], np.ndarray]:
        """One image: (its input crop (H, W, 3) uint8, {class: calibrated probability}, rollout overlay (h, w, 3))."""
        pixels = self._pixels(path)
        x = torch.from_numpy(self.preprocess.normalize(pixels[None]))  # (1, 3, H, W)
        logits, attns = self.net(x, return_attn=True)  # (1, K), depth x (1, nh, N, N)
        rollout = attention_rollout(attns, num_prefix_tokens=self.net.num_prefix_tokens, query=self.net.rollout_query)
        grid = rollout[0].reshape(self.net.grid_size).numpy()  # (Gh, Gw)
        probs = cal.softmax(logits.numpy(), self.temperature)[0]
        return pixels, {name: float(p) for name, p in zip(self.labels, probs, strict=True)}, overlay(pixels, grid)


def _joined(parts) -> dict:
    """The scores of several splits as one."""
    parts = list(parts)
    join = lambda k: sum((p[k] for p in parts), []) if k == "paths" else np.concatenate([p[k] for p in parts])
    return {k: join(k) for k in parts[0]}


def overlay(pixels: np.ndarray, grid: np.ndarray, opacity: float = 0.5, colormap: str = "inferno") -> np.ndarray:
    """A relevance grid (Gh, Gw) blended over the image (H, W, 3) uint8, in the serving UI's default colours.

    Returns:
        (h, w, 3) uint8, the longer side `DISPLAY_SIZE`.
    """
    H, W, _ = pixels.shape
    scale = DISPLAY_SIZE / max(H, W)
    w, h = max(1, round(W * scale)), max(1, round(H * scale))
    base = np.asarray(Image.fromarray(pixels).resize((w, h), Image.Resampling.BICUBIC), np.float32)  # (h, w, 3)
    g = np.asarray(grid, np.float32)
    span = float(g.max() - g.min())
    g = (g - g.min()) / span if span > 1e-8 else np.zeros_like(g)  # min-max: the contrast within this map
    heat = np.asarray(Image.fromarray(g).resize((w, h), Image.Resampling.BILINEAR), np.float32)  # (h, w)
    rgb = matplotlib.colormaps[colormap](np.clip(heat, 0.0, 1.0))[..., :3] * 255.0  # (h, w, 3)
    return np.clip((1.0 - opacity) * base + opacity * rgb, 0, 255).astype(np.uint8)
