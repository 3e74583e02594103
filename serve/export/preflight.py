"""What `vit-export` refuses before the slow export starts, so that a mistake costs a second, not a minute.

- the output: the checkpoint itself (writing would replace the trained weights), another file that is not an ONNX
  model (`last.ckpt`, `split.json`), a folder, or something that is no regular file (a device, a FIFO, a socket:
  the rename would put a file in its place); a link to a regular file is written through, and stays a link;
- the options: a parity gate of fewer than one image, a `--val-dir` or `--calibrate` folder that is not there
  (the gate would run on random images, or calibration would fail after the export);
- the checkpoint: metadata that cannot rebuild its network (another architecture, missing or unknown entries),
  or class names that do not name the head's outputs one to one;
- the calibration images (`calibration_entries`): too few, of one class or of classes the model does not know; of a
  `--calibrate` folder, the images the run trained on are left out, with a warning;
- the run's `split.json` beside it (the parity gate's and the calibration's images) when it is another run's:
  other classes, or labels that are not the checkpoint's (a refit killed before its first checkpoint leaves
  the new split beside the old `best.ckpt`).

Each refusal is a ValueError whose message says what is wrong and what to do: `vit-export` prints it in one
line and answers 2 (1 means the parity gate failed).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serve.export import files
from serve.runtime.image_files import walk_image_files
from serve.runtime.images import ImageError, load_image
from train import checkpoint_format
from train.errors import first_line
from train.folder_scan import class_dirs, find_image_files
from vit.model import VisionTransformer

log = logging.getLogger(__name__)
MIN_IMAGES = 20  # calibration images: below this, a coverage of 0.95 cannot be promised at all


def check_output(checkpoint: Path, output: Path) -> None:
    """Refuse an output that is the checkpoint itself (by any spelling or link), a folder or no regular file."""
    same = output.resolve() == checkpoint.resolve()
    if not same and output.exists() and checkpoint.exists():
        same = os.path.samefile(output, checkpoint)  # a hard link, or another mount of the same file
    if same:
        raise ValueError(
            f"-o {output} is the checkpoint itself: writing the model there would replace the trained weights; "
            f"name another file, e.g. -o {checkpoint.with_suffix('.onnx')}"
        )
    if output.is_dir():
        raise ValueError(f"-o {output} is a folder; name the file to write in it, e.g. -o {output / 'model.onnx'}")
    output_file(output)
    if output.is_file() and not _looks_like_onnx(output):
        raise ValueError(
            f"-o {output} exists and is not an ONNX model (a checkpoint, a report?): writing the model there would "
            "replace it; name another file, or remove it first"
        )


def output_file(output: Path) -> Path:
    """The file to write for `-o output`: the file a link names (the link stays), else `output` itself.

    Raises:
        ValueError: `output` is (or links to) something that is not a regular file, which the rename would replace.
    """
    target = Path(os.path.realpath(output)) if output.is_symlink() else output
    try:
        mode = output.stat().st_mode  # through links, /proc/self/fd/1's too
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"-o {output}: {e.strerror}; name a file to write, e.g. -o model.onnx") from None
        return target  # a new file, the one a dangling link names, or a folder that cannot be (`check_writable`)
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):  # a folder gets check_output's own message
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        via = " (through a link)" if output.is_symlink() else ""
        raise ValueError(
            f"-o {output} is {kind}{via}, not a regular file: the model would take its place; name a file to "
            "write, e.g. -o model.onnx"
        )
    return target


@contextlib.contextmanager
def writable_folders(output: Path, triton_repo: Path | None) -> Iterator[None]:
    """`check_writable` for the output file's folder and --triton-repo, making those not there yet; the folders made
    are removed again, those still empty, when the export then fails or is stopped: "nothing was written" left the
    new folders of -o and --triton-repo behind."""
    made = check_writable(output.parent, output.name)
    try:
        made += check_writable(Path(triton_repo)) if triton_repo is not None else []
        yield
    except BaseException:
        for folder in sorted(made, key=lambda f: len(f.parts), reverse=True):  # the deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty one
        raise


def check_writable(folder: Path, name: str = "probe") -> list[Path]:
    """Fail before the slow export, not after it, when `folder` cannot be created or written, or `name` (the file
    to write there) is too long for the temporary it is written through (`files.temporary_name`).

    Returns:
        The folders made for it, `folder` and those above it that were not there.
    """
    probe, made = folder / files.temporary_name(name), False
    new = [f for f in (folder, *folder.parents) if not os.path.lexists(f)]
    try:
        if blocking := next((f for f in (folder, *folder.parents) if os.path.isfile(f)), None):
            raise ValueError(f"cannot write to {folder}: {blocking} is a file, not a folder; choose an output folder")
        folder.mkdir(parents=True, exist_ok=True)
        made = True
        files.write_new(probe, b"")
        probe.unlink()
    except OSError as e:
        for f in new:  # the deepest first: nothing is left of a refused export
            with contextlib.suppress(OSError):
                f.rmdir()
        if e.errno == errno.ENAMETOOLONG and made:  # the folder was there: the temporary's name is too long
            raise ValueError(
                f"{folder / name}: the name is too long to be written through a temporary beside it (whose name "
                f"takes {len(os.fsencode(probe.name))} bytes, over the file system's limit); choose a shorter name"
            ) from None
        raise ValueError(
            f"cannot write to {folder}: {e.strerror or e}; choose an output folder you can write to"
        ) from None
    return new


def _looks_like_onnx(path: Path) -> bool:
    """An ONNX file's first byte is its ir_version field's tag (field 1, a varint: 0x08); an empty file is no loss."""
    with open(path, "rb") as f:
        return f.read(1) in (b"\x08", b"")


def check_image_folder(option: str, folder: Path | None) -> None:
    """Refuse a labelled image folder (DIR/<class>/<image>) given as `option` that is not there."""
    if folder is not None and not Path(folder).is_dir():
        raise ValueError(f"{option} {folder}: no such folder (expected DIR/<class>/<image> files)")


def check_parity_options(parity_samples: int, val_dir: Path | None) -> None:
    """Refuse options that would leave the parity gate without validation images (it would run on random ones)."""
    if parity_samples < 1:
        raise ValueError(
            f"--parity-samples must be at least 1, got {parity_samples}: the parity gate compares torch and "
            "onnxruntime on that many validation images (default 256)"
        )
    check_image_folder("--val-dir", val_dir)
    if val_dir is not None and not walk_image_files(val_dir)[0]:  # the gate would run on random images
        raise ValueError(f"--val-dir {val_dir} holds no image files (expected DIR/<class>/<image> files)")


def load_network(checkpoint: Path) -> tuple[VisionTransformer, dict[str, Any]]:
    """`train.checkpoint_format.load_network`, with a checkpoint that cannot be exported refused in one line.

    Raises:
        ValueError: metadata that cannot rebuild the network, weights that do not fit it, or class names that
            do not name the head's outputs one to one.
    """
    key = checkpoint_format.META_KEY
    retrain = "export the best.ckpt that vit-train wrote for the run, unedited, or train the run again"
    try:
        net, meta = checkpoint_format.load_network(checkpoint)
    except KeyError as e:  # an entry the network or its preprocessing is rebuilt from
        raise ValueError(f"{checkpoint} has no {e.args[0]!r} entry in its '{key}' metadata; {retrain}") from None
    except TypeError as e:  # model_config or preprocess from another version: an argument this one does not take
        raise ValueError(
            f"{checkpoint}: its '{key}' metadata does not fit this version of vitscope ({first_line(e)}); export "
            "it with the vitscope version that trained it (its 'versions' entry), or train the run again"
        ) from None
    except ArithmeticError as e:  # a size of 0 the network divides by
        raise ValueError(
            f"{checkpoint}: its '{key}' model_config cannot build a network ({first_line(e)}); {retrain}"
        ) from None
    except RuntimeError as e:  # load_state_dict: the weights are another architecture's
        details = [line.strip() for line in str(e).splitlines()[1:] if line.strip()] or [first_line(e)]
        first, more = details[0][:200].rstrip("."), f"; and {len(details) - 1} more" if len(details) > 1 else ""
        raise ValueError(
            f"{checkpoint}: its weights do not fit the network its model_config describes ({first}{more}); {retrain}"
        ) from None
    check_class_names(checkpoint, meta.get("class_names"), net.num_classes)
    return net, meta


def check_class_names(checkpoint: Path, names: Any, outputs: int) -> None:
    """Refuse class names that do not name each of the head's `outputs` once: the file would label them wrongly."""
    key = checkpoint_format.META_KEY
    if names is None:
        raise ValueError(
            f"{checkpoint} has no 'class_names' entry in its '{key}' metadata; export the best.ckpt vit-train wrote"
        )
    names = list(names) if isinstance(names, (list, tuple)) else [names]
    if len(names) != outputs:
        raise ValueError(
            f"{checkpoint} has {len(names)} class names, but its head has {outputs} outputs: each output needs "
            "one name; export the best.ckpt that vit-train wrote for the run, unedited"
        )
    for i, name in enumerate(names, 1):
        if not isinstance(name, str):
            raise ValueError(f"{checkpoint}: class name {i} of {outputs} is not text ({name!r}); name each class")
        if not name.strip():
            raise ValueError(f"{checkpoint}: class name {i} of {outputs} is empty; name each class")
    repeated = sorted(n for n, count in collections.Counter(names).items() if count > 1)
    if repeated:
        raise ValueError(
            f"{checkpoint} names {', '.join(map(repr, repeated))} more than once: each of the {outputs} outputs "
            "needs a name of its own, or the file would give two classes one label"
        )


def check_decodable(entries: list, source: str, need: int) -> None:
    """`ValueError` unless at least `need` of the (path, label) `entries` decode (calibration images): checked
    before the export, which takes minutes, reading only until `need` have decoded (the calibration reads them all
    after it)."""
    decoded = 0
    for path, _ in entries:
        try:
            load_image(path)
        except (ImageError, OSError):
            continue
        decoded += 1
        if decoded == need:
            return
    raise ValueError(
        f"{source}: {decoded} of its {len(entries)} image files decode, and calibration needs at least {need}"
    )


def split_path(checkpoint: Path) -> Path:
    """The `split.json` of the checkpoint's run: `<run>/checkpoints/best.ckpt` -> `<run>/split.json`."""
    return Path(checkpoint).resolve().parent.parent / "split.json"


def check_split(checkpoint: Path, class_names: list[str]) -> None:
    """Refuse a `split.json` beside the checkpoint that is not its run's: the parity gate and the calibration would
    run on another run's images, labelled by its classes (a wrong temperature, or an IndexError)."""
    split = split_path(checkpoint)
    if not os.path.lexists(split):
        return
    elsewhere = (
        f"export {checkpoint} from its own run folder, beside the split.json that trained it, or from a folder "
        "without one, with --val-dir DIR and --calibrate DIR (or --no-calibration)"
    )
    if not split.is_file():  # taken for no split, the gate ran on random images; a FIFO's read would wait for ever
        kind = "a folder" if split.is_dir() else "a link to nothing" if split.is_symlink() else "not a regular file"
        raise ValueError(f"{split} is {kind}, not the split.json vit-train writes; {elsewhere}")
    K = len(class_names)
    try:
        data = json.loads(split.read_text())
        classes = list(data.get("classes", class_names))
        val = [e.get("label", -1) for e in data.get("val", [])]  # the gate takes a name, or -1 for unknown
        calib = [e["label"] for e in data.get("calib", [])]
        bad = [y for y in val if not (y in class_names or type(y) is int and -1 <= y < K)]
        bad += [y for y in calib if not (type(y) is int and 0 <= y < K)]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        raise ValueError(f"{split} is not a split.json that vit-train writes; {elsewhere}") from None
    if classes != list(class_names):
        raise ValueError(
            f"{split} is another run's: its classes {_shown(classes)} are not the checkpoint's "
            f"{_shown(class_names)}; {elsewhere}"
        )
    if bad:
        raise ValueError(f"{split} labels an image {bad[0]!r}, not one of the checkpoint's {K} classes; {elsewhere}")


def _shown(names: list, most: int = 5) -> str:
    """At most `most` names, for a one-line message."""
    names = list(names)
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return f"[{', '.join(map(repr, names[:most]))}{more}]"


def calibration_entries(
    checkpoint: Path, class_names: list[str], calib_dir: Path | None, warn: bool = True
) -> tuple[list, str]:
    """(path, label) pairs of the calibration images and where they came from; a `--calibrate` folder's images that
    the run trained on are left out, said in a warning when `warn`.

    Raises:
        ValueError: no calibration images, or a folder whose class names the model does not know.
    """
    index = {name: i for i, name in enumerate(class_names)}
    if calib_dir is not None:
        calib_dir = Path(calib_dir)
        check_image_folder("--calibrate", calib_dir)
        entries = []
        for d in class_dirs(calib_dir):
            if d.name not in index:
                raise ValueError(
                    f"--calibrate {calib_dir}: folder {d.name!r} is not one of the model's classes {class_names}"
                )
            entries += [(Path(p), index[d.name]) for p in find_image_files(d)]
        found, entries = len(entries), without_training_images(entries, checkpoint, f"--calibrate {calib_dir}", warn)
        if len(entries) < MIN_IMAGES:  # refused now, not after a minute of export
            less = (
                f" ({found - len(entries)} of {found} left out as the run's training images)"
                if found > len(entries)
                else ""
            )
            raise ValueError(
                f"--calibrate {calib_dir}: {len(entries)} image files{less}, and calibration needs at least "
                f"{MIN_IMAGES}"
            )
        if len(covered := {label for _, label in entries}) < min(2, len(class_names)):
            only = ", ".join(class_names[i] for i in sorted(covered)) or "none"
            raise ValueError(
                f"--calibrate {calib_dir}: its images are of one class ({only}): the temperature, the prediction "
                "sets and the unknown-input threshold are fitted to the images the model will meet, so give held-out "
                "images of its classes (one folder per class)"
            )
        return entries, str(calib_dir)
    split = split_path(checkpoint)
    if not split.is_file():  # a run on a prepared dataset (`vit-train prepare`) keeps none
        raise ValueError(
            f"no calibration images: {split} is not there (a run on a prepared LitData dataset, or a checkpoint out "
            "of its run folder, has no calibration split): give --calibrate DIR, a folder of held-out images per "
            "class; or pass --no-calibration, without the other calibration options, for an uncalibrated file"
        )
    entries = [(Path(e["path"]), int(e["label"])) for e in json.loads(split.read_text()).get("calib", [])]
    if entries:
        return entries, f"{split} (calibration split)"
    raise ValueError(
        "no calibration images: the run's split.json has no calibration split (train with --data.calib_fraction "
        "0.1, the default) and no --calibrate DIR was given; or pass --no-calibration (without the other "
        "calibration options) for an uncalibrated file"
    )


def without_training_images(entries: list, checkpoint: Path, given: str, warn: bool = True) -> list:
    """`entries` less the images the checkpoint's run trained on (its `split.json`), said in a warning (`warn`): scores
    fitted on them are overconfident, and the prediction sets too small for their coverage."""
    split = split_path(checkpoint)
    if not split.is_file():
        return entries
    trained = {
        os.path.realpath(run_path(e["path"], split.parent)) for e in json.loads(split.read_text()).get("train", [])
    }
    kept = [(p, label) for p, label in entries if os.path.realpath(p) not in trained]
    if warn and len(kept) < len(entries):
        log.warning(
            "%s: %d of its %d images are training images of this run (%s), left out of the calibration: scores "
            "fitted on them would be overconfident and the prediction sets too small", given,
            len(entries) - len(kept), len(entries), split,
        )  # fmt: skip
    return kept


def run_path(path: str, run_dir: Path) -> Path:
    """A path of a run's `split.json`: as written (absolute, or from here), else from the run folder."""
    p = Path(path)
    return run_dir / p if not p.is_absolute() and not p.exists() and (run_dir / p).exists() else p
