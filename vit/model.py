"""The Vision Transformer (Dosovitskiy et al. 2021), with attention maps on demand.

Read top to bottom: `VisionTransformer` (patch embedding, prefix tokens, position encoding,
encoder blocks, pooling, head), then the named variants and `create_model`.
Parameter names match timm's `VisionTransformer`, so timm weights load directly (`vit.timm_compat`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from vit import flip
from vit.block import Block
from vit.patch_embed import PatchEmbed
from vit.pos_embed import resample_pos_embed, sincos_2d

# Shapes: B batch, C channels, H/W image, P patch, Gh/Gw grid, L = Gh*Gw patches,
#         n prefix tokens (CLS, distillation, registers), N = n + L tokens, D embed_dim, nh heads, K classes.

LayerNorm = partial(nn.LayerNorm, eps=1e-6)  # timm's ViT epsilon: weights trained with it expect it


def check_options(global_pool: str, class_token: bool, pos_embed: str, weight_init: str) -> None:
    """Refuse, in one line that says what to use instead, a combination `VisionTransformer` cannot build."""
    if global_pool not in ("token", "avg"):
        raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
    if global_pool == "token" and not class_token:
        raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without a CLS token")
    if pos_embed not in ("learn", "sincos"):
        raise ValueError(f"pos_embed must be 'learn' or 'sincos', got {pos_embed!r}")
    if weight_init not in ("trunc_normal", "xavier"):
        raise ValueError(f"weight_init must be 'trunc_normal' or 'xavier', got {weight_init!r}")


class VisionTransformer(nn.Module):
    """Vision Transformer classifier.

    Args:
        img_size: (H, W) or side the model is built for; other multiples of the patch size also run.
        patch_size: patch side P in pixels.
        in_chans: image channels C.
        num_classes: K; 0 makes `forward` return pooled features.
        global_pool: "token" (CLS token) or "avg" (mean of patch tokens).
        embed_dim: token width D.
        depth: number of encoder blocks.
        num_heads: attention heads nh.
        mlp_ratio: MLP hidden width as a multiple of D.
        qkv_bias: bias on the q, k, v projection.
        qk_norm: LayerNorm on q and k.
        init_values: LayerScale initial value; None disables LayerScale.
        class_token: prepend a learned CLS token.
        distilled: a distillation token after the CLS token, read by a second head (`head_dist`) that learns from
            a teacher's predictions (DeiT, Touvron et al. 2021; timm's `VisionTransformerDistilled`). `forward`
            returns their mean, or both heads' logits in training mode with `distilled_training` set. Rollout
            reads the class head's query (`rollout_query`).
        reg_tokens: number of register tokens (Darcet et al. 2024) after the CLS token.
        no_embed_class: prefix tokens get no position embedding (timm's flag of the same name).
        pos_embed: "learn" (a learned table) or "sincos" (fixed 2-D sin-cos).
        pre_norm: LayerNorm before the blocks (CLIP-style).
        fc_norm: put the final norm after pooling; None means "only for avg pooling", as in timm.
        drop_rate: dropout before the head.
        pos_drop_rate: dropout after adding the position encoding.
        proj_drop_rate: dropout after attention projection and in the MLP.
        attn_drop_rate: dropout on attention weights.
        drop_path_rate: stochastic depth, rising linearly to this rate in the last block.
        attn_score: attention scoring function: "scaled_dot", "dot", "additive", "bilinear" or "lsa" (locality
            self-attention, Lee et al. 2021: scaled dot with a learned temperature, no token attending to itself).
        weight_init: "trunc_normal" (std 0.02, as timm) or "xavier" (uniform, Var(w) = 2 / (n_in + n_out)).
        stem: patch embedding: "patch" (one P x P convolution, timm's), "conv" (3 x 3 stride-2
            convolutions then a 1 x 1 projection, Xiao et al. 2021: learns faster on small data) or "shifted"
            (shifted patch tokens, Lee et al. 2021: each token also sees half a patch around it).
        stem_widths: the conv stem's widths (see `PatchEmbed`); None: its default.
        flip_tta: outside training, answer the mean over each image and its mirror image (`vit.flip`), maps
            included: for classes a mirror does not change; twice the cost of an image. No parameters.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        init_values: float | None = None,
        class_token: bool = True,
        distilled: bool = False,
        reg_tokens: int = 0,
        no_embed_class: bool = False,
        pos_embed: str = "learn",
        pre_norm: bool = False,
        fc_norm: bool | None = None,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        attn_score: str = "scaled_dot",
        weight_init: str = "trunc_normal",
        stem: str = "patch",
        stem_widths: list[int] | None = None,
        flip_tta: bool = False,
    ):
        """Build the network (arguments above). It reads better whole: its length is the signature, timm's
        keyword arguments one a line, and the body builds the modules in the order `forward` runs them."""
        super().__init__()
        check_options(global_pool, class_token, pos_embed, weight_init)
        # the constructor's arguments, so a checkpoint can rebuild the model without any config file
        self.config = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.embed_dim = self.num_features = embed_dim
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = int(class_token) + int(distilled) + reg_tokens
        self.distilled = distilled
        self.no_embed_class = no_embed_class or pos_embed == "sincos"
        use_fc_norm = global_pool == "avg" if fc_norm is None else fc_norm

        self.patch_embed = PatchEmbed(
            img_size, patch_size, in_chans, embed_dim, bias=not pre_norm, stem=stem, stem_widths=stem_widths
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        L = self.patch_embed.num_patches
        embed_len = L if self.no_embed_class else L + self.num_prefix_tokens
        if pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim))
        else:
            self.register_buffer("pos_embed", sincos_2d(self.patch_embed.grid_size, embed_dim), persistent=False)
        self.pos_embed_type = pos_embed
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.norm_pre = LayerNorm(embed_dim) if pre_norm else nn.Identity()

        dpr = torch.linspace(0, drop_path_rate, depth).tolist()  # stochastic depth grows with depth
        block_args = (mlp_ratio, qkv_bias, qk_norm, proj_drop_rate, attn_drop_rate, init_values)
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, *block_args, dpr[i], attn_score, LayerNorm) for i in range(depth)
        )
        self.norm = LayerNorm(embed_dim) if not use_fc_norm else nn.Identity()
        self.fc_norm = LayerNorm(embed_dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = (
            (nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()) if distilled else None
        )
        self.distilled_training = False  # `forward_head` returns both heads' logits while set, in training mode
        self.flip_tta = flip_tta
        self.init_weights(weight_init)

    def init_weights(self, mode: str = "trunc_normal") -> None:
        """Initialise like timm (`trunc_normal`) or with Xavier-uniform linear and patch weights (`xavier`)."""
        if self.pos_embed_type == "learn":
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)  # as timm's: unlike the CLS token, not near zero
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if mode == "xavier":
                    nn.init.xavier_uniform_(m.weight)
                else:
                    nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if mode == "xavier":
            w = self.patch_embed.proj.weight
            nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # as a linear map of a flattened patch

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters that weight decay must not touch (besides norms and biases)."""
        return {"pos_embed", "cls_token", "dist_token", "reg_token"}

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameters by depth, in timm's format (timm.optim's layer-wise LR decay reads it): the embeddings
        first, then block i; the final norm joins the last block, and the head comes last (as in timm's ViT)."""
        return {
            "stem": r"^cls_token|^dist_token|^reg_token|^pos_embed|^patch_embed|^norm_pre",
            "blocks": r"^blocks\.(\d+)" if coarse else [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        }

    @property
    def rollout_query(self) -> str:
        """Which rows of rolled-out attention explain the output: the CLS row when the head reads the CLS
        token, the mean of the patch rows when it reads the patch average (`vit.attention_rollout`'s `query`)."""
        return "cls" if self.global_pool == "token" else "mean"

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    @property
    def two_views(self) -> bool:
        """Whether a call now runs each image and its mirror (`flip_tta`, outside training)."""
        return self.flip_tta and not self.training

    def merge_maps(self, maps: list[torch.Tensor], x: torch.Tensor, reduce: str = "mean") -> list[torch.Tensor]:
        """Each block's maps (2B, nh, N, N) of the two views of the images x (B, C, H, W) as one (B, nh, N, N)."""
        P = self.patch_embed.patch_size
        grid = (x.shape[-2] // P[0], x.shape[-1] // P[1])
        return [flip.merge_maps(m, grid, self.num_prefix_tokens, reduce) for m in maps]

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        B, Gh, Gw, D = x.shape
        if self.pos_embed_type == "sincos":
            pos = self.pos_embed if (Gh, Gw) == self.grid_size else sincos_2d((Gh, Gw), D).to(x)
        else:
            prefix = 0 if self.no_embed_class else self.num_prefix_tokens
            pos = resample_pos_embed(self.pos_embed, (Gh, Gw), self.grid_size, prefix)  # (1, [n +] L, D)
        x = x.reshape(B, Gh * Gw, D)  # (B, L, D)
        tokens = (self.cls_token, self.dist_token, self.reg_token)
        prefix_tokens = [t.expand(B, -1, -1) for t in tokens if t is not None]
        if self.no_embed_class:
            x = torch.cat(prefix_tokens + [x + pos], dim=1)  # (B, N, D)
        else:
            x = torch.cat(prefix_tokens + [x], dim=1) + pos  # (B, N, D)
        return self.pos_drop(x)

    def forward_features(
        self, x: torch.Tensor, return_attn: bool = False, num_out_tokens: int | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Args:
            x: images (B, C, H, W); H and W multiples of the patch size.
            return_attn: also return every block's attention map.
            num_out_tokens: T; the last block computes only the first T tokens (they still attend
                to every token). None: all of them, T = N. `forward` passes 1 for a CLS-token head.

        Returns:
            Tokens (B, T, D) after the final norm; with `return_attn`, also a list of `depth`
            maps (B, nh, N, N), first block first (the last one (B, nh, T, N)).
        """
        x = self._pos_embed(self.patch_embed(x))  # (B, N, D)
        x = self.norm_pre(x)
        attns = []
        for i, blk in enumerate(self.blocks):
            last = i == len(self.blocks) - 1
            x, attn = blk(x, return_attn, num_out_tokens if last else None)
            attns.append(attn)
        x = self.norm(x)
        return (x, attns) if return_attn else x

    def _pooled(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What each head reads, normalised: [(B, D)] for `head`, then the distillation token's for `head_dist`."""
        pooled = [x[:, self.num_prefix_tokens :].mean(dim=1) if self.global_pool == "avg" else x[:, 0]]  # (B, D)
        if self.distilled:
            pooled.append(x[:, int(self.cls_token is not None)])  # the distillation token (B, D)
        return [self.head_drop(self.fc_norm(p)) for p in pooled]

    def forward_head(
        self, x: torch.Tensor, pre_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Args:
            x: tokens (B, N, D) from `forward_features` ((B, 1, D) is enough for a CLS-token head, (B, 2, D) with a
                distillation token).
            pre_logits: return the pooled, normalised features instead of logits.

        Returns:
            Logits (B, K), or features (B, D). With a distillation token: the mean of the two heads' logits (and of
            their features), or both heads' logits `(head, head_dist)` while `distilled_training` in training mode.
        """
        features = self._pooled(x)
        if pre_logits:
            return _mean(features)
        logits = self._logits(features)
        if self.distilled and self.distilled_training and self.training:
            return logits[0], logits[1]
        return _mean(logits)

    def logits_and_features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_head`'s logits (B, K) of the tokens x, and the features (B, F) an exported file answers for its
        unknown-input score: the pooled, normalised pre-logits (F = D), then, for a head that normalises the patch
        average (`fc_norm`), that average before its norm too (F = 2D): the norm takes out much of what tells an
        unknown photo from the training images."""
        features = self._pooled(x)
        logits, pooled = _mean(self._logits(features)), _mean(features)
        if self.global_pool != "avg" or not isinstance(self.fc_norm, nn.LayerNorm):
            return logits, pooled
        return logits, torch.cat([pooled, x[:, self.num_prefix_tokens :].mean(dim=1)], dim=-1)  # (B, 2D)

    def _logits(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each head's logits (B, K) from `_pooled`'s features."""
        heads = [self.head, self.head_dist] if self.distilled else [self.head]
        return [head(f) for head, f in zip(heads, features, strict=True)]

    def forward(
        self, x: torch.Tensor, return_attn: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Args:
            x: images (B, C, H, W).
            return_attn: also return the attention maps; runs the explicit softmax path.

        Returns:
            Logits (B, K) (features (B, D) when `num_classes=0`; both heads' `(head, head_dist)` in distilled
            training); with `return_attn`, `(logits, attns)` where `attns` holds one (B, nh, N, N) map per block,
            first block first.
        """
        views = flip.two_views(x) if self.two_views else x  # (B or 2B, C, H, W)
        if return_attn:
            tokens, attns = self.forward_features(views, return_attn=True)
            if not self.two_views:
                return self.forward_head(tokens), attns
            return flip.mean_of_views(self.forward_head(tokens)), self.merge_maps(attns, x)
        # A CLS-token head reads token 0 alone, so the last block computes token 0 alone: the same
        # logits, with that block's projection and MLP run on 1 token instead of N.
        out = self.forward_head(self.forward_features(views, num_out_tokens=self._head_tokens))
        return flip.mean_of_views(out) if self.two_views else out

    @property
    def _head_tokens(self) -> int | None:
        """How many leading tokens the heads read: the CLS token (and the distillation token) for token pooling,
        else all (None)."""
        return 1 + int(self.distilled) if self.global_pool == "token" else None

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a fresh one for `num_classes` classes (0 removes it)."""
        self.num_classes = self.config["num_classes"] = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = self.head_dist if self.distilled else None
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.trunc_normal_(head.weight, std=0.02)
                nn.init.zeros_(head.bias)

    def flops_per_image(self, img_size: tuple[int, int] | None = None) -> int:
        """Multiply-adds x 2 of one image's answer at `img_size` (matmuls only; softmax and norms are noise); twice
        one view's with `flip_tta`."""
        H, W = img_size or self.patch_embed.img_size
        P = self.patch_embed.patch_size[0]
        L = (H // P) * (W // P)
        N, D = L + self.num_prefix_tokens, self.embed_dim
        hidden = self.blocks[0].mlp.fc1.out_features if len(self.blocks) else 0

        def block(Nq: int) -> int:  # Nq of the N tokens query; q, k, v are projected for all N
            return N * D * 3 * D + 2 * Nq * N * D + Nq * D * D + 2 * Nq * D * hidden

        blocks = (len(self.blocks) - 1) * block(N) + block(self._head_tokens or N) if len(self.blocks) else 0
        embed = L * self.patch_embed.proj.in_channels * P * P * D if self.patch_embed.stem_type == "patch" else 0
        if self.patch_embed.stem_type == "shifted":
            embed = L * self.patch_embed.proj.in_features * D
        elif self.patch_embed.stem_type == "conv":
            embed = L * self.patch_embed.proj.in_channels * D
            side = (H, W)
            for conv in (m for m in self.patch_embed.stem if isinstance(m, nn.Conv2d)):
                side = ((side[0] + 1) // 2, (side[1] + 1) // 2)
                embed += side[0] * side[1] * conv.in_channels * conv.out_channels * 9
        head = D * self.num_classes * (1 + int(self.distilled))
        return 2 * (embed + blocks + head) * (1 + int(self.flip_tta))


# Variants are data: name -> constructor arguments. `create_model(name, **overrides)` builds one.
VARIANTS: dict[str, dict[str, Any]] = {
    "vit_tiny_patch16_224": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_small_patch16_224": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_base_patch16_224": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # small images (CIFAR-sized or the digits sample): 8 x 8 grid of 4-pixel patches
    "vit_tiny_patch4_32": dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3),
    "vit_small_patch4_32": dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6),
    "vit_micro_patch4_32": dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0),
}


def create_model(name: str, **overrides: Any) -> VisionTransformer:
    """Build a named variant; keyword arguments override its settings (e.g. `num_classes=10`).

    Args:
        name: a key of `VARIANTS`.
        **overrides: any `VisionTransformer` argument.

    Returns:
        A freshly initialised model.
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(VARIANTS)}")
    return VisionTransformer(**{**VARIANTS[name], **overrides})


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One head's output as it is; two heads' (class and distillation) averaged, as DeiT answers."""
    return tensors[0] if len(tensors) == 1 else (tensors[0] + tensors[1]) / 2


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
