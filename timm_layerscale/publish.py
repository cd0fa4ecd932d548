"""A live model out: the native folder that timm rebuilds it from, locally or as a Hub repo.

`save_native` writes what the `native` conversion target writes for a model in memory; `save_for_hub` adds
a model card; `push_to_hub` uploads that folder as one commit.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path

import huggingface_hub
from torch import nn

from timm_ls.names import MODEL_CARD_TAGS

from .checkpoints.formats.native import write_native_folder
from .variants import builtin_architecture

__all__ = ["model_card", "push_to_hub", "save_for_hub", "save_native"]

LICENSE_URL = "https://ai.meta.com/resources/models-and-libraries/dinov3-license/"


def save_native(
    model: nn.Module, folder: str | Path, overwrite: bool = False, extra_files: Mapping[str, str] | None = None
) -> Path:
    """Saves a live vit_ls model as a folder that `timm.create_model("local-dir:FOLDER", pretrained=True)`
    (or `hf-hub:` once uploaded) rebuilds exactly, LayerScale settings included (after `fold_layer_scale`
    the folder records LayerScale off)."""
    config = model.config
    pretrained_cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    architecture = builtin_architecture(pretrained_cfg.get("architecture"), config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return write_native_folder(
        Path(folder), state, config, architecture, pretrained_cfg, overwrite, extra_files=extra_files
    )


def model_card(model: nn.Module, repo_id: str | None = None) -> str:
    """README.md for a saved model: the DINOv3 licence, the architecture and its LayerScale settings."""
    config = model.config
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    name = repo_id or cfg.get("architecture") or type(model).__name__
    init = config.layer_init_values
    on = sum(v is not None for pair in init for v in pair)
    values = sorted({v for pair in init for v in pair if v is not None})
    gammas = [m.gamma.detach().float() for m in model.modules() if hasattr(m, "gamma")]
    if gammas:
        flat = [g.abs().mean().item() for g in gammas]
        trained = f"gammas |mean| from {min(flat):.4g} to {max(flat):.4g} across branches"
    else:
        trained = "no gammas (LayerScale off or folded into the projections)"
    start = f"init values {', '.join(f'{v:g}' for v in values)}" if values else "off"
    load = (
        f'timm.create_model("hf-hub:{repo_id}", pretrained=True)'
        if repo_id
        else ('timm.create_model("local-dir:FOLDER", pretrained=True)')
    )
    return "\n".join(
        [
            "---",
            "library_name: timm",
            MODEL_CARD_TAGS,
            "license: other",
            "license_name: dinov3-license",
            f"license_link: {LICENSE_URL}",
            "---",
            f"# {name}",
            "",
            f"A DINOv3-style Vision Transformer with LayerScale (timm-layerscale), architecture "
            f"`{cfg.get('architecture') or type(model).__name__}`: {config.embed_dim} wide, {config.depth} blocks, "
            f"{config.num_heads} heads, {config.ffn_layer} FFN, {config.num_classes} classes "
            f"(global pool `{config.global_pool or 'none'}`).",
            "",
            "## LayerScale",
            "",
            f"- on {on} of {2 * config.depth} branches; {start}",
            f"- {trained}",
            "",
            "## Use",
            "",
            "```python",
            "import timm  # with timm-layerscale installed",
            "",
            f"model = {load}",
            "```",
            "",
            "`config.json` carries every model argument, so any timm from 1.0.26 rebuilds the model.",
            "",
            "## Licence",
            "",
            f"The weights derive from Meta's DINOv3 and are released under the DINOv3 License ({LICENSE_URL}).",
            "",
        ]
    )


def save_for_hub(model: nn.Module, folder: str | Path, overwrite: bool = False, repo_id: str | None = None) -> Path:
    """Writes `model` as a Hub repo folder: `model.safetensors`, timm's `config.json` naming a shipped
    architecture with every model argument (a YAML variant of one's own rebuilds without its YAML), and a
    `README.md` model card with the DINOv3 licence and the LayerScale settings.

    `timm.create_model("local-dir:FOLDER", pretrained=True)`, or `hf-hub:REPO` once uploaded, rebuilds the
    same model with the same weights; after `fold_layer_scale` it rebuilds without LayerScale. An existing
    folder is kept unless `overwrite`; the folder appears complete or not at all.
    """
    return save_native(model, folder, overwrite, extra_files={"README.md": model_card(model, repo_id)})


def push_to_hub(
    model: nn.Module,
    repo_id: str,
    *,
    commit_message: str = "Add model",
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Uploads `model` as `save_for_hub` writes it to the Hub repo `repo_id` (created if missing) and
    returns the commit URL; `timm.create_model(f"hf-hub:{repo_id}", pretrained=True)` rebuilds it."""
    api = huggingface_hub.HfApi(token=token)
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_for_hub(model, Path(tmp) / "repo", repo_id=repo_url.repo_id)
        commit = api.upload_folder(
            repo_id=repo_url.repo_id,
            folder_path=folder,
            commit_message=commit_message,
            revision=revision,
            create_pr=create_pr,
        )
    return str(commit)
