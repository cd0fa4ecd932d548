from .attention import (
    Attention,
    effective_qkv_bias,
    fold_bias_mask_,
    fold_bias_masks_,
    has_bias_mask,
    k_bias_mask,
    k_masked_linear,
    qkv_sizes,
    reset_bias_mask,
    split_qkv,
)
from .block import Block
from .ffn import SwiGLU, ffn_hidden_features, swiglu_hidden_features
from .layer_scale import LayerScale, add_scaled, fold_gamma, layer_scale_or_identity
from .naflex_batch import NaFlexBatch, read_naflex_batch
from .naflex_embed import embed_patches
from .naflex_grid import naflex_patch_centres, padding_key_mask
from .naflex_pool import pool_valid_tokens
from .norm import make_norm, norm_classes
from .rope import RopeEmbedding, apply_rope

__all__ = [
    "Attention",
    "Block",
    "LayerScale",
    "NaFlexBatch",
    "RopeEmbedding",
    "SwiGLU",
    "add_scaled",
    "apply_rope",
    "effective_qkv_bias",
    "embed_patches",
    "ffn_hidden_features",
    "fold_bias_mask_",
    "fold_bias_masks_",
    "fold_gamma",
    "has_bias_mask",
    "k_bias_mask",
    "k_masked_linear",
    "layer_scale_or_identity",
    "make_norm",
    "naflex_patch_centres",
    "norm_classes",
    "padding_key_mask",
    "pool_valid_tokens",
    "qkv_sizes",
    "read_naflex_batch",
    "reset_bias_mask",
    "split_qkv",
    "swiglu_hidden_features",
]
