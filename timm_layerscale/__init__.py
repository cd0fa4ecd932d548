"""DINOv3-style Vision Transformers with LayerScale for timm.

Importing the package registers the `vit_ls_*` variants: `timm.create_model("vit_ls_base_patch16_dinov3")`.
"""

from .checkpoints import (
    FORMATS,
    CheckpointError,
    Format,
    checkpoint_filter_fn,
    convert_state_dict,
    open_checkpoint,
    register_format,
    rename_layer_scale,
)
from .config import UnknownConfigKeyError, VitLsConfig, cait_init_value, resolve_init_values
from .convert import convert_checkpoint
from .deploy import quantize
from .export import export_onnx
from .families import FAMILIES, FamilyRecord, Holding, register_family
from .fold import fold_layer_scale
from .fsdp import shard_model
from .hub import HubError, fetch_hub_weights, hub_weights
from .layers import fold_bias_masks_
from .model import VisionTransformerLS
from .publish import push_to_hub, save_for_hub, save_native
from .variants import VARIANTS, config_dir, register_builtin_variants, register_variant

__version__ = "0.2.0"
__all__ = [
    "FAMILIES",
    "FORMATS",
    "VARIANTS",
    "CheckpointError",
    "FamilyRecord",
    "Format",
    "Holding",
    "HubError",
    "UnknownConfigKeyError",
    "VisionTransformerLS",
    "VitLsConfig",
    "cait_init_value",
    "checkpoint_filter_fn",
    "config_dir",
    "convert_checkpoint",
    "convert_state_dict",
    "export_onnx",
    "fetch_hub_weights",
    "fold_bias_masks_",
    "fold_layer_scale",
    "hub_weights",
    "open_checkpoint",
    "push_to_hub",
    "quantize",
    "register_family",
    "register_format",
    "register_variant",
    "rename_layer_scale",
    "resolve_init_values",
    "save_for_hub",
    "save_native",
    "shard_model",
]

register_builtin_variants()
