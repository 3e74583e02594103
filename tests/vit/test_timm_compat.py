"""timm interoperability: same weights give the same logits. Random timm models only: no network."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import timm
import torch
from timm.models.vision_transformer import VisionTransformer as TimmViT

from vit import from_timm, timm_config

SMALL = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=7)


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Perturb every weight (LayerScale, tokens, norms included) so parity is not trivially easy."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # CLS token
        dict(global_pool="avg", class_token=False),  # average pooling, fc_norm
        dict(reg_tokens=4, no_embed_class=True, global_pool="avg", class_token=False),
        dict(reg_tokens=2),  # CLS + registers sharing the position table
        dict(init_values=1e-5, qkv_bias=False),  # LayerScale, no qkv bias
        dict(qk_norm=True, mlp_ratio=2.0),
        dict(img_size=(48, 32), patch_size=4),  # rectangular, other patch
        dict(global_pool="avg", fc_norm=False),  # avg pooling of a CLS model, final norm before pooling
    ],
    ids=["cls", "avg", "reg-avg", "cls-reg", "layerscale-nobias", "qknorm", "rect-p4", "avg-nofcnorm"],
)
def test_same_logits_as_timm(kw):
    timm_model = randomised(TimmViT(**{**SMALL, **kw}))
    ours = from_timm(timm_model).eval()
    H, W = timm_model.patch_embed.img_size
    x = torch.randn(3, 3, H, W)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), timm_model(x), atol=1e-4, rtol=1e-4)
        logits, _ = ours(x, return_attn=True)
        torch.testing.assert_close(logits, timm_model(x), atol=1e-4, rtol=1e-4)


def test_deits_distillation_token_and_head_give_timms_logits_in_eval_and_in_distilled_training():
    from timm.models.deit import VisionTransformerDistilled

    timm_model = randomised(VisionTransformerDistilled(**SMALL))
    ours = from_timm(timm_model).eval()
    assert ours.distilled and ours.num_prefix_tokens == 2 and ours.config["distilled"]
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), timm_model(x), atol=1e-4, rtol=1e-4)  # the mean of the two heads
        timm_model.set_distilled_training(True)
        ours.distilled_training = True
        for mine, theirs in zip(ours.train()(x), timm_model.train()(x), strict=True):  # (head, head_dist)
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
        features = from_timm(timm_model, num_classes=0).eval()(x)  # no heads: the two tokens' mean features
        torch.testing.assert_close(features, timm_model.eval().forward_head(timm_model.forward_features(x), True))
    with pytest.raises(ValueError, match="a distillation token needs weights that have one"):
        from_timm(TimmViT(**SMALL), distilled=True)  # no table row or token to start it from


def test_named_timm_model_at_224():
    ours = from_timm("vit_tiny_patch16_224").eval()  # pretrained=False: random weights, no network
    assert ours.embed_dim == 192 and len(ours.blocks) == 12 and ours.num_classes == 1000
    assert ours.pretrained_cfg["mean"] == pytest.approx((0.5, 0.5, 0.5))


@pytest.fixture(scope="module")
def timm_tiny():
    return randomised(timm.create_model("vit_tiny_patch16_224", pretrained=False))


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", ".bin"])
def test_local_checkpoint_file(tmp_path, timm_tiny, suffix):
    path = tmp_path / f"weights{suffix}"
    state = {k: v.contiguous() for k, v in timm_tiny.state_dict().items()}
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)
    ours = from_timm(path, model_name="vit_tiny_patch16_224").eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), timm_tiny(x), atol=1e-4, rtol=1e-4)


def test_fresh_head_keeps_the_backbone(timm_tiny):
    ours = from_timm(timm_tiny, num_classes=3).eval()
    x = torch.randn(2, 3, 224, 224)
    assert ours(x).shape == (2, 3)
    with torch.no_grad():
        torch.testing.assert_close(
            ours.forward_head(ours.forward_features(x), pre_logits=True),
            timm_tiny.forward_head(timm_tiny.forward_features(x), pre_logits=True),
            atol=1e-4,
            rtol=1e-4,
        )


def test_other_image_size_resamples_the_position_table_like_timm(timm_tiny):
    ours = from_timm(timm_tiny, img_size=256).eval()
    timm_256 = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=256).eval()
    from timm.models.vision_transformer import checkpoint_filter_fn

    timm_256.load_state_dict(checkpoint_filter_fn(timm_tiny.state_dict(), timm_256))
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), timm_256(x), atol=1e-4, rtol=1e-4)


def test_checkpoint_file_needs_a_model_name(tmp_path, timm_tiny):
    path = tmp_path / "w.pth"
    torch.save(timm_tiny.state_dict(), path)
    with pytest.raises(ValueError, match="needs model_name"):
        from_timm(path)
    with pytest.raises(FileNotFoundError):
        from_timm(tmp_path / "missing.safetensors", model_name="vit_tiny_patch16_224")


def test_unsupported_timm_features_are_named():
    timm_model = TimmViT(**SMALL, global_pool="map")
    with pytest.raises(ValueError, match="global_pool='map'"):
        timm_config(timm_model)


def test_unreachable_hub_says_how_to_load_the_weights_from_a_file(tmp_path):
    # offline by setting, in a process of its own (huggingface_hub reads it at import), so nothing is attempted
    code = (
        "import vit\n"
        "try:\n"
        "    vit.from_timm('vit_tiny_patch16_224', pretrained=True)\n"
        "except OSError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}  # and an empty cache
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "could not get the pretrained weights of 'vit_tiny_patch16_224'" in out.stdout, out.stderr
    assert "--model.pretrained weights.safetensors" in out.stdout


def test_an_unknown_model_name_is_not_blamed_on_the_network():
    with pytest.raises(RuntimeError, match="Unknown model"):
        from_timm("vit_no_such_model", pretrained=True)
