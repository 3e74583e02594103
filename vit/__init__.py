"""vitscope's Vision Transformer: plain PyTorch, timm-compatible weights, attention maps on demand."""

from vit.attention import ATTN_SCORES, Attention
from vit.block import Block
from vit.model import VARIANTS, VisionTransformer, count_params, create_model
from vit.rollout import attention_rollout, gradient_rollout, rollout_from_gradients
from vit.timm_compat import from_timm, timm_config

__all__ = [
    "ATTN_SCORES",
    "Attention",
    "Block",
    "VARIANTS",
    "VisionTransformer",
    "attention_rollout",
    "count_params",
    "create_model",
    "from_timm",
    "gradient_rollout",
    "rollout_from_gradients",
    "timm_config",
]
