"""Bring timm ViT weights into our model: from a timm model, a timm model name, or a local checkpoint file.

Our parameter names are timm's, so the state dict loads directly; this module only reads the
architecture off the timm model and refuses the variants we do not implement.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vit.model import VisionTransformer
from vit.pos_embed import resample_pos_embed

log = logging.getLogger(__name__)

CHECKPOINT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def from_timm(
    source: nn.Module | str | Path,
    model_name: str | None = None,
    *,
    pretrained: bool = False,
    **overrides: Any,
) -> VisionTransformer:
    """Build our `VisionTransformer` holding the weights of a timm ViT.

    Args:
        source: a timm `VisionTransformer` instance; a timm model name (timm builds it, downloading
            weights when `pretrained=True` and the hub is reachable); or a local checkpoint file
            (.safetensors, .pth, .pt, .bin), in which case `model_name` names its architecture.
        model_name: the timm architecture of a checkpoint file.
        pretrained: with a model name, ask timm for its pretrained weights.
        **overrides: `VisionTransformer` arguments to change: `num_classes` gives a fresh head,
            `img_size` resamples the position table, drop rates and `attn_score` pass through.

    Returns:
        Our model with the same weights; `model.pretrained_cfg` holds timm's preprocessing
        settings (mean, std, crop_pct, interpolation) when timm knows them.
    """
    timm_model = _timm_model(source, model_name, pretrained)
    config = timm_config(timm_model)
    state = timm_model.state_dict()
    if overrides.get("distilled") and not config["distilled"]:
        raise ValueError(
            "a distillation token needs weights that have one (timm's deit_*_distilled_* models); these have none: "
            "train with a teacher from scratch, or fine-tune these weights without one"
        )
    model = VisionTransformer(**{**config, **overrides})

    if model.num_classes != config["num_classes"]:
        state = {k: v for k, v in state.items() if not k.startswith(("head.", "head_dist."))}
    if "pos_embed" in state and model.pos_embed_type == "learn" and state["pos_embed"].shape != model.pos_embed.shape:
        prefix = 0 if model.no_embed_class else model.num_prefix_tokens
        old_grid = timm_model.patch_embed.grid_size
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], model.grid_size, old_grid, prefix, antialias=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    heads = ("head.", "head_dist.")
    expected_missing = {k for k in model.state_dict() if k.startswith(heads)} if "head.weight" not in state else set()
    if set(missing) - expected_missing or unexpected:
        raise ValueError(f"timm weights do not fit: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    if model.num_classes != config["num_classes"]:
        model.reset_classifier(model.num_classes)
    cfg = getattr(timm_model, "pretrained_cfg", None) or {}
    model.pretrained_cfg = {k: cfg[k] for k in ("mean", "std", "crop_pct", "interpolation") if k in cfg}
    return model


def timm_config(m: nn.Module) -> dict[str, Any]:
    """Read `VisionTransformer` arguments off a timm `VisionTransformer`; refuse what we do not implement."""
    from timm.layers import LayerScale as TimmLayerScale
    from timm.layers import Mlp as TimmMlp

    if not hasattr(m, "blocks") or not hasattr(m, "patch_embed"):
        raise TypeError(f"{type(m).__name__} is not a timm VisionTransformer")
    blk = m.blocks[0]
    unsupported = []
    if m.global_pool not in ("token", "avg"):
        unsupported.append(f"global_pool={m.global_pool!r}")
    if not isinstance(blk.mlp, TimmMlp) or type(blk.mlp.act).__name__ != "GELU":
        unsupported.append(f"MLP {type(blk.mlp).__name__} with {type(getattr(blk.mlp, 'act', None)).__name__}")
    if getattr(blk.mlp.act, "approximate", "none") != "none":
        unsupported.append("tanh-approximated GELU")
    if not isinstance(getattr(m.patch_embed, "norm", nn.Identity()), nn.Identity):
        unsupported.append("a norm in the patch embedding")
    if not isinstance(getattr(blk.attn, "norm", nn.Identity()), nn.Identity):
        unsupported.append("a norm inside attention")
    if not isinstance(getattr(blk.mlp, "norm", nn.Identity()), nn.Identity):
        unsupported.append("a norm inside the MLP")
    if type(blk).__name__ != "Block":
        unsupported.append(f"block type {type(blk).__name__}")
    if getattr(m, "pos_embed", None) is None:
        unsupported.append("no position embedding")
    norm = blk.norm1
    if not isinstance(norm, nn.LayerNorm) or abs(norm.eps - 1e-6) > 1e-12:
        unsupported.append(f"norm layer {norm}")
    if unsupported:
        raise ValueError(f"this timm model uses features vitscope does not implement: {', '.join(unsupported)}")

    dim = m.embed_dim
    return dict(
        img_size=tuple(m.patch_embed.img_size),
        patch_size=int(m.patch_embed.patch_size[0]),
        in_chans=m.patch_embed.proj.in_channels,
        num_classes=m.num_classes,
        global_pool=m.global_pool,
        embed_dim=dim,
        depth=len(m.blocks),
        num_heads=blk.attn.num_heads,
        mlp_ratio=blk.mlp.fc1.out_features / dim,
        qkv_bias=blk.attn.qkv.bias is not None,
        qk_norm=not isinstance(blk.attn.q_norm, nn.Identity),
        init_values=1e-5 if isinstance(blk.ls1, TimmLayerScale) else None,
        class_token=m.cls_token is not None,
        distilled=getattr(m, "dist_token", None) is not None,  # DeiT's `VisionTransformerDistilled`
        reg_tokens=getattr(m, "num_reg_tokens", 0),
        no_embed_class=m.no_embed_class,
        pre_norm=not isinstance(m.norm_pre, nn.Identity),
        fc_norm=not isinstance(m.fc_norm, nn.Identity),
    )


def load_checkpoint_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from .safetensors (no code runs) or .pth/.pt/.bin (loaded with weights_only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    if path.suffix not in CHECKPOINT_SUFFIXES:
        raise ValueError(f"unknown checkpoint type {path.suffix!r}: expected one of {CHECKPOINT_SUFFIXES}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "module"):  # common wrappers around the weights
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    return state


def _timm_model(source: nn.Module | str | Path, model_name: str | None, pretrained: bool) -> nn.Module:
    import timm

    if isinstance(source, nn.Module):
        return source.eval()
    text = str(source)
    if text.endswith(CHECKPOINT_SUFFIXES) or Path(text).is_file():
        if model_name is None:
            raise ValueError(f"loading {text} needs model_name= (the timm architecture it was saved from)")
        from timm.models.vision_transformer import checkpoint_filter_fn

        timm_model = timm.create_model(model_name, pretrained=False)
        state = checkpoint_filter_fn(load_checkpoint_file(text), timm_model)
        num_classes = state["head.weight"].shape[0] if "head.weight" in state else 0
        if num_classes != timm_model.num_classes:
            timm_model.reset_classifier(num_classes)
        timm_model.load_state_dict(state)
        return timm_model.eval()
    if model_name is not None and model_name != text:
        raise ValueError(f"got the model name twice: {text!r} and model_name={model_name!r}")
    try:
        return timm.create_model(text, pretrained=pretrained).eval()
    except OSError as e:  # huggingface_hub's and requests' errors; timm's own (unknown model or tag) pass through
        if not pretrained:
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise OSError(
            f"could not get the pretrained weights of {text!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{first}). Without network access, download the weights elsewhere and pass the file: "
            f"from_timm('weights.safetensors', {text!r}), or in vit-train --model.pretrained weights.safetensors"
        ) from e
