"""What a vitscope checkpoint carries beyond weights, and how to rebuild the network from it.

Lightning writes the checkpoint; `ViTClassifier.on_save_checkpoint` adds two plain-data entries (no
pickled objects), so everything loads with ``weights_only=True``:

    "vitscope"    {"model_config": VisionTransformer kwargs, "class_names": [...], "preprocess": Preprocess.to_dict(),
                   "weights_prefix": "net." or "ema.module.", "variant": str, "versions": {...},
                   "best_val": {"metric", "score", "scores"} (the best epoch's validation scores)}:
                  `load_network` rebuilds the network from it with neither the YAML nor Lightning
    "rng_states"  the random states (`rng_states`), so a resumed run draws the numbers the uninterrupted run drew
"""

from __future__ import annotations

import errno
import hashlib
import json
import pickle
import random
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve.runtime.images import Preprocess
from train.errors import SetupError, first_line
from train.run_dir import damaged_record, usable_checkpoints
from vit.model import VisionTransformer

META_KEY = "vitscope"
RNG_KEY = "rng_states"
# what a run that loads a checkpoint must share with it: the network settings that shape the weights or give them
# their meaning (dropout, initialisation and test-time flips may change), and the preprocessing
NET_MUST_MATCH = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "in_chans", "qkv_bias")
NET_MUST_MATCH += ("qk_norm", "init_values", "pre_norm", "no_embed_class", "global_pool", "class_token", "reg_tokens")
NET_MUST_MATCH += ("distilled", "pos_embed", "attn_score", "stem", "stem_widths")
PREPROCESS_MUST_MATCH = ("img_size", "crop_pct", "interpolation", "mean", "std")


def _checkpoints_in(folder: Path, most: int = 5) -> str:
    """The intact .ckpt files in `folder`, comma-separated, at most `most` named ("" for none, or no such folder)."""
    found = usable_checkpoints(folder)
    more = f" and {len(found) - most} more" if len(found) > most else ""
    return ", ".join(str(p) for p in found[:most]) + more


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint with `weights_only=True` and check it is one of ours."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        kind = "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
    except OSError as e:  # not there, or a name too long for the file system (Path.is_dir says False to both)
        if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise ValueError(f"cannot read the checkpoint {path}: {e.strerror or e}; check the path") from None
        kind = None
    if kind == "other":  # /dev/null, a FIFO: reading one would find nothing, or wait for a writer
        raise ValueError(f"{path} is not a regular file: give the .ckpt file vit-train wrote")
    if kind == "folder":  # a run folder, or its checkpoints folder
        found = _checkpoints_in(path) or _checkpoints_in(path / "checkpoints")
        raise FileNotFoundError(
            f"{path} is a folder: give a checkpoint file in it: {found}"
            if found
            else f"{path} is a folder with no usable .ckpt file: give a checkpoint file vit-train wrote"
        )
    if kind is None:
        found = _checkpoints_in(path.parent)
        raise FileNotFoundError(f"checkpoint not found: {path}" + (f"; that folder holds {found}" if found else ""))
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] != b"PK" and head[:1] != b"\x80":  # a zip (torch.save) or a legacy pickle
        onnx = (
            " (it is an ONNX model: export takes the .ckpt it came from; vit-export MODEL.onnx --web DIR packages a"
            " portable file for the browser)"
            if path.suffix == ".onnx"
            else ""
        )
        raise ValueError(
            f"{path} is not a PyTorch checkpoint{onnx}; give the .ckpt file vit-train wrote, "
            "e.g. runs/<run>/checkpoints/best.ckpt"
        )
    try:
        bad = damaged_record(path) if head[:2] == b"PK" else None
    except Exception as e:  # a flipped method or flag byte fails as NotImplementedError or RuntimeError
        raise ValueError(f"{path} is damaged or truncated ({first_line(e)}); train or copy it again") from None
    if bad:
        raise ValueError(
            f"{path} is damaged: its record {bad} fails its checksum (a disk or copy error); copy it again"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # say what is wrong in one line, not a traceback
        if isinstance(e, pickle.UnpicklingError):  # objects beyond tensors and plain data: never loaded
            raise ValueError(
                f"{path} holds Python objects that a weights-only load refuses ({first_line(e)}); vitscope "
                "checkpoints hold tensors and plain data only: give a .ckpt file written by vit-train"
            ) from None
        raise ValueError(f"{path} is damaged or truncated ({first_line(e)}); train or copy it again") from None
    if not isinstance(ckpt, dict) or META_KEY not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a vitscope checkpoint (no '{META_KEY}' entry); train it with vit-train")
    check_mappings(path, ckpt)
    return ckpt


def check_mappings(path: Path, ckpt: dict[str, Any]) -> None:
    """`ValueError` naming the first entry that vit-train writes as a mapping and this checkpoint holds as
    something else (an edited or foreign file): read as it is, a string `preprocess` gave timm's defaults."""
    meta = ckpt[META_KEY]
    entries = [(f"'{META_KEY}'", meta), ("'state_dict'", ckpt["state_dict"])]
    if isinstance(meta, dict):
        entries += [(f"'{META_KEY}.{k}'", meta[k]) for k in ("model_config", "preprocess") if k in meta]
    for name, value in entries:
        if not isinstance(value, dict):
            raise ValueError(
                f"{path}: its {name} entry is a {type(value).__name__}, not a mapping as vit-train writes it; "
                "give the .ckpt file vit-train wrote, unedited"
            )


def load_network(path: str | Path) -> tuple[VisionTransformer, dict[str, Any]]:
    """Rebuild the trained network (EMA weights when the run kept them) in eval mode.

    Returns:
        (net, meta): meta is the checkpoint's "vitscope" entry plus "sha256" of the file and
        "preprocess" as a `Preprocess`.
    """
    ckpt = load_checkpoint(path)
    meta = dict(ckpt[META_KEY])
    try:
        net = VisionTransformer(**meta["model_config"])
    except ValueError as e:  # sizes no model takes: more patches than it runs allocated 40 GB before anything said no
        raise ValueError(
            f"{path}: its '{META_KEY}' model_config cannot build a network ({first_line(e)}); give the .ckpt file "
            "vit-train wrote, unedited"
        ) from None
    prefix = meta.get("weights_prefix", "net.")
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    net.load_state_dict(state)
    meta["sha256"] = file_sha256(path)
    try:
        meta["preprocess"] = Preprocess.from_dict(meta["preprocess"])
    except (TypeError, ValueError) as e:  # a mean of text, a size of one number
        raise ValueError(
            f"{path}: its 'preprocess' entry cannot be read ({first_line(e)}); give the .ckpt file vit-train wrote, "
            "unedited"
        ) from None
    return net.eval(), meta


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_class_names(meta: dict[str, Any] | None, data_classes: list[str] | None) -> list[str]:
    """The class names a checkpoint's "vitscope" entry holds, refused when they differ from the folder's.

    Raises:
        SetupError: not a vitscope checkpoint, or other classes (its outputs would be labelled wrongly).
    """
    if meta is None or "class_names" not in meta:
        raise SetupError(f"not a vitscope checkpoint (no '{META_KEY}' entry with class names): train it with vit-train")
    saved = list(meta["class_names"])
    if data_classes is not None and saved != list(data_classes):
        raise SetupError(
            f"the checkpoint was trained on {len(saved)} classes {saved}, but the image folder has "
            f"{len(data_classes)} classes {list(data_classes)}; its outputs would be labelled wrongly. Use the "
            "folder it was trained on (the same class folders), or train a new run without --ckpt_path"
        )
    return saved


def check_checkpoint_fits(
    meta: dict[str, Any] | None, data_classes: list[str] | None, net_config: dict, preprocess: dict | None
) -> list[str]:
    """The class names of a checkpoint this run may load (`check_class_names`), refused too when its network
    or its preprocessing differ from this run's: another variant failed in load_state_dict with a hundred
    size-mismatch lines, and another --data.img_size trained on, its checkpoints recording the old size.

    Raises:
        SetupError: other classes, another network, or another preprocessing, each named.
    """
    classes = check_class_names(meta, data_classes)
    plain = lambda value: json.loads(json.dumps(value or {}, default=str))  # tuples and lists alike
    differ = []
    for keys, saved, ours in (
        (NET_MUST_MATCH, plain(meta.get("model_config")), plain(net_config)),
        (PREPROCESS_MUST_MATCH, plain(meta.get("preprocess")), plain(preprocess)),
    ):
        differ += [
            f"{k} {saved[k]} (this run: {ours[k]})" for k in keys if k in saved and k in ours and saved[k] != ours[k]
        ]
    if differ:
        raise SetupError(
            f"the checkpoint was trained with {', '.join(differ[:4])}{' and more' if len(differ) > 4 else ''}: "
            "run with the settings it was trained with (--config RUN/config.yaml), or train a new run without "
            "--ckpt_path"
        )
    return classes


def rng_states() -> dict[str, Any]:
    """The random states that decide shuffling, augmentation and dropout, as weights-only-loadable data.

    These are the main process's. DataLoader workers need none saved: they seed each batch from the run's
    seed and the batch's indices (`train.dataset.ImageListDataset.__getitems__`), and the indices come
    from the main process's stream.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` saved, so a resumed run draws the numbers the uninterrupted run drew."""
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])


def resume_states(checkpoint: dict[str, Any], param_groups: int) -> None:
    """A fit resuming `checkpoint`: refuse it when its optimizer state has another number of parameter groups than
    this run's optimizer (`--model.layer_decay` changed: torch's load failed in a traceback, after the run's
    files were written), then restore its random states (`set_rng_states`)."""
    saved = [len(s.get("param_groups", [])) for s in checkpoint.get("optimizer_states") or []]
    if saved and saved[0] != param_groups:
        raise SetupError(
            f"the checkpoint's optimizer has {saved[0]} parameter groups, and this run's has {param_groups} "
            "(--model.layer_decay differs): run with the settings it was trained with (--config RUN/config.yaml), "
            "or train a new run without --ckpt_path"
        )
    if RNG_KEY in checkpoint:
        set_rng_states(checkpoint[RNG_KEY])
