"""The checkpoint machinery: formats (one module each, `formats/`) over shared mechanisms: the lazy reader,
key tables, plans, fitting and writers.

Pure: it knows the config and the layers, never the model class, the registry, loading, the Hub or a
command, so every application (pretrained loading, `convert_checkpoint`, publishing, the CLI) builds on it.
"""

from .errors import CheckpointError
from .formats import FORMATS, Format, get_format, recognise, register_format, source_config
from .load_hook import checkpoint_filter_fn, convert_state_dict, install_load_hook, log_report, plan_load
from .mapping.fit import Fitted, fit_to_model
from .mapping.gamma_keys import rename_layer_scale
from .mapping.keys import StateDict
from .mapping.plan import Plan, TensorInfo
from .read.reader import LazyCheckpoint, open_checkpoint

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
