"""The checkpoint machinery: formats (one module each, `formats/`) over shared mechanisms: the lazy reader,
key tables, plans, fitting and writers.

Pure: it knows the config and the layers, never the model class, the registry, loading, the Hub or a
command, so every application (pretrained loading, `convert_checkpoint`, publishing, the CLI) builds on it.
"""

from .errors import CheckpointError
from .fit import Fitted, fit_to_model
from .formats import FORMATS, Format, get_format, recognise, register_format, source_config
from .gamma_keys import rename_layer_scale
from .keys import StateDict
from .layer_scale import fold_layer_scale
from .load_hook import checkpoint_filter_fn, convert_state_dict, install_load_hook, log_report, plan_load
from .plan import Plan
from .reader import LazyCheckpoint, TensorInfo, open_checkpoint

__all__ = [
    "FORMATS",
    "CheckpointError",
    "Fitted",
    "Format",
    "LazyCheckpoint",
    "Plan",
    "StateDict",
    "TensorInfo",
    "checkpoint_filter_fn",
    "convert_state_dict",
    "fit_to_model",
    "fold_layer_scale",
    "get_format",
    "install_load_hook",
    "log_report",
    "open_checkpoint",
    "plan_load",
    "recognise",
    "register_format",
    "rename_layer_scale",
    "source_config",
]
