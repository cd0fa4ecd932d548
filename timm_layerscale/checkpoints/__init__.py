"""The checkpoint machinery: formats, one two-way key table per layout, the lazy reader, plans and writers.

Pure: it knows the config and the layers, never the model class, the registry, loading, the Hub or a
command, so every application (pretrained loading, `convert_checkpoint`, publishing, the CLI) builds on it.
"""

from .errors import CheckpointError
from .fit import Fitted, fit_to_model
from .layer_scale import fold_layer_scale
from .layouts import StateDict, detect_layout, rename_layer_scale
from .load_hook import checkpoint_filter_fn, convert_state_dict, install_load_hook, log_report, plan_load
from .plan import Plan
from .reader import LazyCheckpoint, TensorInfo, open_checkpoint

__all__ = [
    "CheckpointError",
    "Fitted",
    "LazyCheckpoint",
    "Plan",
    "StateDict",
    "TensorInfo",
    "checkpoint_filter_fn",
    "convert_state_dict",
    "detect_layout",
    "fit_to_model",
    "fold_layer_scale",
    "install_load_hook",
    "log_report",
    "open_checkpoint",
    "plan_load",
    "rename_layer_scale",
]
