from .attention import Attention, KMaskedBiasLinear, effective_qkv_bias, k_bias_mask
from .block import Block
from .ffn import SwiGLU, swiglu_hidden_features
from .layer_scale import LayerScale, layer_scale_or_identity
from .rope import RopeEmbedding, apply_rope

__all__ = [
    "Attention",
    "Block",
    "KMaskedBiasLinear",
    "LayerScale",
    "RopeEmbedding",
    "SwiGLU",
    "apply_rope",
    "effective_qkv_bias",
    "k_bias_mask",
    "layer_scale_or_identity",
    "swiglu_hidden_features",
]
