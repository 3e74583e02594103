"""The model: shapes, the per-call attention maps, the four score functions, other image sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vit import ATTN_SCORES, VARIANTS, VisionTransformer, create_model


def test_forward_shapes(tiny_model):
    x = torch.randn(3, 3, 32, 32)
    assert tiny_model(x).shape == (3, 5)
    tokens = tiny_model.forward_features(x)
    assert tokens.shape == (3, 1 + 16, 32)  # CLS + 4 x 4 patches
    assert tiny_model.forward_head(tokens, pre_logits=True).shape == (3, 32)


def test_num_classes_zero_returns_pooled_features(tiny_config):
    model = VisionTransformer(**{**tiny_config, "num_classes": 0}).eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 32)


@pytest.mark.parametrize(
    "overrides, n_prefix",
    [
        (dict(), 1),
        (dict(global_pool="avg", class_token=False), 0),
        (dict(reg_tokens=4), 5),
        (dict(reg_tokens=2, no_embed_class=True, global_pool="avg"), 3),
        (dict(pos_embed="sincos"), 1),
        (dict(init_values=1e-5, qk_norm=True, qkv_bias=False), 1),
    ],
)
def test_attention_maps_per_call(tiny_config, overrides, n_prefix):
    model = VisionTransformer(**{**tiny_config, **overrides}).eval()
    assert model.num_prefix_tokens == n_prefix
    x = torch.randn(2, 3, 32, 32)
    logits, attns = model(x, return_attn=True)
    N = n_prefix + 16
    assert len(attns) == 2 and all(a.shape == (2, 2, N, N) for a in attns)
    torch.testing.assert_close(attns[0].sum(-1), torch.ones(2, 2, N))  # softmax rows
    torch.testing.assert_close(logits, model(x), atol=1e-5, rtol=1e-5)  # explicit path == fused path


@pytest.mark.parametrize("score", ATTN_SCORES)
def test_fused_and_explicit_paths_agree_for_every_score(tiny_config, score):
    torch.manual_seed(0)
    model = VisionTransformer(**tiny_config, attn_score=score).eval()
    x = torch.randn(4, 3, 32, 32)
    fused = model(x)
    explicit, attns = model(x, return_attn=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(attns[0], attns[1])


def test_scores_differ_from_each_other(tiny_config):
    x = torch.randn(2, 3, 32, 32)
    maps = {}
    for score in ATTN_SCORES:
        torch.manual_seed(0)  # same weights everywhere except the score function's own
        maps[score] = VisionTransformer(**tiny_config, attn_score=score).eval()(x, return_attn=True)[1][0]
    # bilinear starts as scaled dot product (W = I / sqrt(hd)); the others must differ
    torch.testing.assert_close(maps["bilinear"], maps["scaled_dot"], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(maps["dot"], maps["scaled_dot"], atol=1e-4)
    assert not torch.allclose(maps["additive"], maps["scaled_dot"], atol=1e-4)


@pytest.mark.parametrize("score", ATTN_SCORES)
def test_every_score_function_learns(tiny_config, score):
    torch.manual_seed(0)
    model = VisionTransformer(**tiny_config, attn_score=score)
    x, y = torch.randn(16, 3, 32, 32), torch.arange(16) % 5
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], f"{score}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    if score in ("additive", "bilinear"):
        own = [p for n, p in model.named_parameters() if "score_" in n]
        assert own and all(p.grad is not None and p.grad.abs().sum() > 0 for p in own)


def test_other_image_sizes_run_including_rectangles(tiny_model):
    for H, W in [(32, 32), (48, 48), (16, 40), (64, 24)]:
        logits, attns = tiny_model(torch.randn(2, 3, H, W), return_attn=True)
        L = (H // 8) * (W // 8)
        assert logits.shape == (2, 5) and attns[0].shape[-1] == 1 + L


def test_resampled_position_grid_is_the_identity_at_the_built_size(tiny_model):
    from vit.pos_embed import resample_pos_embed

    pos = tiny_model.pos_embed
    assert resample_pos_embed(pos, (4, 4), (4, 4), 1) is pos
    up = resample_pos_embed(pos, (8, 8), (4, 4), 1)
    assert up.shape == (1, 1 + 64, 32)
    torch.testing.assert_close(up[:, :1], pos[:, :1])  # the CLS position is kept as is


def test_image_size_not_a_multiple_of_the_patch_is_refused(tiny_model):
    with pytest.raises(ValueError, match="multiple of the patch size"):
        tiny_model(torch.randn(1, 3, 30, 32))
    with pytest.raises(ValueError, match="not a multiple of patch_size"):
        VisionTransformer(img_size=30, patch_size=8)


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="attn_score must be one of"):
        VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, attn_score="cosine")
    with pytest.raises(ValueError, match="global_pool='token' needs class_token"):
        VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, class_token=False)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        VisionTransformer(img_size=32, patch_size=8, embed_dim=30, depth=1, num_heads=4)
    with pytest.raises(ValueError, match="unknown model 'vit_huge'"):
        create_model("vit_huge")


def test_xavier_init_has_the_glorot_variance():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, weight_init="xavier")
    w = model.blocks[0].mlp.fc1.weight  # (256, 64)
    n_out, n_in = w.shape
    assert w.var().item() == pytest.approx(2 / (n_in + n_out), rel=0.1)
    default = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2)
    assert default.blocks[0].mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_drop_path_is_active_only_in_training(tiny_config):
    model = VisionTransformer(**tiny_config, drop_path_rate=0.5)
    x = torch.randn(8, 3, 32, 32)
    model.train()
    torch.manual_seed(1)
    a = model(x)
    torch.manual_seed(2)
    b = model(x)
    assert not torch.allclose(a, b)
    model.eval()
    torch.testing.assert_close(model(x), model(x))


def test_rollout_reads_the_rows_the_head_pools(tiny_config):
    assert VisionTransformer(**tiny_config).rollout_query == "cls"
    assert VisionTransformer(**tiny_config, global_pool="avg").rollout_query == "mean"  # CLS kept, patches pooled
    assert VisionTransformer(**tiny_config, global_pool="avg", class_token=False).rollout_query == "mean"


def test_config_rebuilds_the_same_model(tiny_model):
    clone = VisionTransformer(**tiny_model.config).eval()
    clone.load_state_dict(tiny_model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(clone(x), tiny_model(x))


def test_layerwise_lr_decay_scales_each_depth_from_the_head(tiny_model):
    from timm.optim import param_groups_layer_decay

    skip = tiny_model.no_weight_decay()
    groups = param_groups_layer_decay(tiny_model, weight_decay=0.05, no_weight_decay_list=skip, layer_decay=0.5)
    scale = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    params = dict(tiny_model.named_parameters())

    def of(name):
        return scale[id(params[name])]

    # as for timm's own ViT: block i at decay^(depth - i), the final norm with the last block, the head at 1
    assert of("cls_token") == of("pos_embed") == of("patch_embed.proj.weight") == 0.5**3
    assert of("blocks.0.attn.qkv.weight") == 0.5**2 and of("blocks.1.mlp.fc2.bias") == of("norm.weight") == 0.5
    assert of("head.weight") == 1.0
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert decay[id(params["pos_embed"])] == 0.0 and decay[id(params["blocks.0.attn.qkv.weight"])] == 0.05


def test_variants_build_with_their_documented_sizes():
    for name, kw in VARIANTS.items():
        model = create_model(name, depth=1)  # one block is enough to check the wiring
        assert model.embed_dim == kw["embed_dim"] and model.patch_embed.img_size == (kw["img_size"],) * 2
    small = create_model("vit_small_patch16_224")
    assert sum(p.numel() for p in small.parameters()) == pytest.approx(22.05e6, rel=0.01)
    pooled = create_model("vit_small_patch16_224", global_pool="avg")  # every token through every block
    assert pooled.flops_per_image() == pytest.approx(9.2e9, rel=0.05)  # ViT-S/16: ~4.6 GMACs
    # a CLS head: the last block's attention rows, projection and MLP run for 1 token, not N = 197
    D, N, hidden = 384, 197, 4 * 384
    saved = 2 * (N - 1) * (2 * N * D + D * D + 2 * D * hidden)
    assert small.flops_per_image() == pooled.flops_per_image() - saved


@pytest.mark.parametrize("score", ATTN_SCORES)
@pytest.mark.parametrize("overrides", [dict(), dict(reg_tokens=2, init_values=1e-2), dict(drop_path_rate=0.2)])
def test_the_last_block_computes_only_the_token_the_head_reads(tiny_config, score, overrides):
    torch.manual_seed(0)
    model = VisionTransformer(**{**tiny_config, **overrides}, attn_score=score).eval()
    x = torch.randn(3, 3, 32, 32)
    tokens = model.forward_features(x)  # every token through every block
    seen = []
    model.blocks[-1].register_forward_hook(lambda module, args, out: seen.append(out[0].shape))
    torch.testing.assert_close(model(x), model.forward_head(tokens), atol=1e-5, rtol=1e-5)
    assert seen[-1] == (3, 1, 32)  # forward ran the last block for the CLS token alone
    cls_only = model.forward_features(x, num_out_tokens=1)
    assert cls_only.shape == (3, 1, 32)
    torch.testing.assert_close(cls_only, tokens[:, :1], atol=1e-5, rtol=1e-5)
    # training reads the same token: the loss and every gradient match the full computation
    model.train()
    y = torch.tensor([0, 1, 2])
    torch.manual_seed(1)  # drop path draws one mask per image and block either way
    full = F.cross_entropy(model.forward_head(model.forward_features(x)), y)
    torch.manual_seed(1)
    pruned = F.cross_entropy(model(x), y)
    torch.testing.assert_close(pruned, full)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(pruned, params), torch.autograd.grad(full, params), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_inference_under_autocast_keeps_the_residual_stream_in_float32(tiny_config):
    torch.manual_seed(0)
    model = VisionTransformer(**tiny_config).eval()  # no LayerScale: the branches come out of linears in bf16
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", torch.bfloat16):
        tokens = model.forward_features(x)
        with torch.no_grad():
            no_grad = model.forward_features(x)
    assert tokens.dtype == no_grad.dtype == torch.float32
    torch.testing.assert_close(no_grad, tokens.detach())


def test_inference_without_autograd_is_the_same_arithmetic_and_leaves_inputs_alone(tiny_config):
    torch.manual_seed(0)
    model = VisionTransformer(**{**tiny_config, "init_values": 1e-2}).eval()
    x = torch.randn(2, 3, 32, 32)
    tokens = model._pos_embed(model.patch_embed(x))
    kept = tokens.clone()
    with_grad = model.blocks[0](tokens)[0]
    with torch.inference_mode():
        in_place = model.blocks[0](tokens)[0]
        logits = model(x)
    assert torch.equal(tokens, kept)  # the block's input is never written to
    assert torch.equal(in_place, with_grad)  # the in-place sums are the same sums, bit for bit
    assert torch.equal(logits, model(x))


@pytest.mark.slow
def test_torch_compile_matches_eager(tiny_model):
    compiled = torch.compile(tiny_model)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(compiled(x), tiny_model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_bf16_on_cuda_matches_fp32(tiny_model):
    model = tiny_model.cuda()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        fast, attns = model(x, return_attn=True)
        fused = model(x)
    reference = model(x)
    torch.testing.assert_close(fast.float(), reference, atol=0.05, rtol=0.05)
    torch.testing.assert_close(fused.float(), reference, atol=0.05, rtol=0.05)
    assert attns[0].dtype == torch.bfloat16


def test_conv_stem_keeps_the_token_grid_and_rebuilds_from_its_config(tiny_config):
    torch.manual_seed(0)
    model = VisionTransformer(**tiny_config, stem="conv")
    assert model.grid_size == (4, 4) and len([m for m in model.patch_embed.stem if isinstance(m, nn.Conv2d)]) == 3
    x = torch.randn(3, 3, 32, 32)
    model.train()
    model(x).sum().backward()  # BatchNorm in training mode, gradients reach the first convolution
    assert model.patch_embed.stem[0].weight.grad.abs().sum() > 0
    model.eval()
    clone = VisionTransformer(**model.config)
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(clone.eval()(x), model(x), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-2 patch_size"):
        VisionTransformer(**{**tiny_config, "img_size": 30, "patch_size": 6}, stem="conv")


def test_conv_stem_widths_keep_full_resolution_before_the_strided_layers(tiny_config):
    model = VisionTransformer(**tiny_config, stem="conv", stem_widths=[8, 16, 16, 32])  # 8-px patches: 3 strided
    convs = [m for m in model.patch_embed.stem if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 16, 16, 32]
    assert [c.stride[0] for c in convs] == [1, 2, 2, 2]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, tiny_config["num_classes"])
    assert VisionTransformer(**model.config).patch_embed.stem[0].out_channels == 8  # rebuilt from its config
    with pytest.raises(ValueError, match="at least 3 positive stem widths"):
        VisionTransformer(**tiny_config, stem="conv", stem_widths=[8, 16])
    with pytest.raises(ValueError, match="stem_widths is for stem='conv'"):
        VisionTransformer(**tiny_config, stem_widths=[8, 16, 32])


def test_an_averaging_head_answers_its_features_before_and_after_their_norm(tiny_config):
    """The unknown-input score needs what `fc_norm` takes out (BENCHMARKS.md, unknown inputs): a patch-average head
    exports the pooled features and the patch average before its norm; a CLS-token head its normalised token."""
    torch.manual_seed(0)
    avg = VisionTransformer(**{**tiny_config, "global_pool": "avg", "class_token": False}).eval()
    cls = VisionTransformer(**tiny_config).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = avg.forward_features(x)  # (2, L, D), not normalised: the head's fc_norm does that
        logits, features = avg.logits_and_features(tokens)
        D = avg.embed_dim
        assert features.shape == (2, 2 * D)
        torch.testing.assert_close(features[:, :D], avg.forward_head(tokens, pre_logits=True))
        torch.testing.assert_close(features[:, D:], tokens.mean(1))
        torch.testing.assert_close(logits, avg(x))
        assert cls.logits_and_features(cls.forward_features(x))[1].shape == (2, D)
        normed = VisionTransformer(**tiny_config, fc_norm=True).eval()  # a CLS head with fc_norm: its token alone
        features = normed.logits_and_features(normed.forward_features(x, num_out_tokens=1))[1]
        assert features.shape == (2, D) and torch.isfinite(features).all()
