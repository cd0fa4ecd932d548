"""Pretrained loading by streaming: build on the meta device, then each tensor read, converted, cast, placed.

Every pretrained source that reaches a variant's entrypoint loads here (a tag's Hub weights, `hf-hub:` and
`local-dir:` models, `pretrained_cfg_overlay=dict(file=...)` with any source the reader reads, or
`dict(state_dict=...)`). The model is built on the meta device, so nothing is allocated or initialised; the
checkpoint is planned against it (format, LayerScale rules and the load report as for any load), and each
tensor is then read, cast to the requested dtype, put on the requested device and assigned in place of its
meta placeholder. Only what the checkpoint does not hold is computed (RoPE periods, k-bias masks, a new
classifier head). What timm's own loader does after reading is done on the way: the classifier is dropped
when `num_classes` differs from the pretrained one, and the patch embedding is adapted to `in_chans`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from timm.models import adapt_input_conv
from timm.models._hub import download_cached_file
from tqdm.auto import tqdm

from .checkpoints import CheckpointError, log_report, open_checkpoint, plan_load
from .checkpoints.mapping.plan import Plan, Step, passthrough
from .hub import hub_weights
from .layers import fold_bias_masks_
from .model import VisionTransformerLS

__all__ = ["load_pretrained", "pretrained_source"]


PATCH_WEIGHT = "patch_embed.proj.weight"
PROGRESS_DELAY_S = 3.0  # a progress bar appears once a load has taken this long


def pretrained_source(
    cfg: Mapping[str, Any], cache_dir: str | Path | None = None, ungated: str = ""
) -> Path | Mapping[str, Any]:
    """Where a pretrained cfg's weights are, in timm's order: `hf-hub:` and `local-dir:` models by their
    source, then a state dict, a file, a Hub id, a URL. Hub and URL weights are downloaded (and cached);
    `ungated` names an ungated copy of gated Hub weights for the error line."""
    source = cfg.get("source") or ""
    if source == "local-dir":
        return Path(cfg["file"])
    if source != "hf-hub":
        if cfg.get("state_dict") is not None:
            return cfg["state_dict"]
        if cfg.get("file"):
            return Path(cfg["file"])
    if cfg.get("hf_hub_id"):
        return hub_weights(cfg, cache_dir=cache_dir, ungated=ungated)
    if cfg.get("url"):
        return Path(download_cached_file(cfg["url"], cache_dir=cache_dir))
    name = cfg.get("architecture") or "this model"
    raise RuntimeError(f"No pretrained weights exist for {name}. Use `pretrained=False` for random init.")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    device = torch.device(device if device is not None else "cpu")
    if device.type == "meta":
        raise ValueError(
            "pretrained=True loads weights, which a model on the meta device cannot hold; pass a real device "
            "(device='cpu' or 'cuda'), or pretrained=False for an empty model on the meta device"
        )
    return device


def _for_the_model(cfg: Mapping[str, Any], model: VisionTransformerLS) -> Callable[[Plan], Plan]:
    """What timm's loader does to a pretrained state dict before loading it, as plan steps: no classifier
    from the file when `num_classes` differs from the pretrained cfg's, and the patch embedding adapted to
    the model's input channels (`adapt_input_conv`)."""
    new_head = model.num_classes != cfg.get("num_classes")
    base_chans = (cfg.get("input_size") or (3,))[0]
    in_chans = model.config.in_chans

    def adapt(native: Plan) -> Plan:
        steps = passthrough(k for k in native if not (new_head and k.startswith("head.")))
        if PATCH_WEIGHT in native and native.info(PATCH_WEIGHT).shape[1] != in_chans:
            stored = native.info(PATCH_WEIGHT).shape[1]

            def adapted(weight: torch.Tensor) -> tuple[torch.Tensor]:
                try:  # older timm (1.0.26) adapts from 3 channels only: no base_chans
                    return (
                        adapt_input_conv(in_chans, weight, **({"base_chans": base_chans} if base_chans != 3 else {})),
                    )
                except (NotImplementedError, AssertionError, ValueError, TypeError) as exc:
                    raise CheckpointError(
                        f"the checkpoint's {PATCH_WEIGHT} takes {stored} input channels and the pretrained cfg "
                        f"says {base_chans}: it cannot be adapted to in_chans={in_chans}; build with "
                        f"in_chans={stored}, or set input_size in pretrained_cfg_overlay to the channels it was "
                        f"trained on"
                    ) from exc

            adapt_step = Step((PATCH_WEIGHT,), (PATCH_WEIGHT,), adapted)
            steps = [adapt_step if step.outputs == (PATCH_WEIGHT,) else step for step in steps]
        return Plan(native, steps)

    return adapt


def _assign(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    if name in module._parameters:
        old = module._parameters[name]
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[name] = value


def load_pretrained(
    cfg: Mapping[str, Any],
    cache_dir: str | Path | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    ungated: str = "",
    **model_args: Any,
) -> VisionTransformerLS:
    """Builds `VisionTransformerLS(**model_args)` with the weights of pretrained cfg `cfg`, streamed in.

    Each tensor is read, converted, cast to `dtype` (floating ones; RoPE periods stay fp32, as in the model)
    and placed on `device` as it comes; no random init is computed and no second copy of the weights is held.
    """
    device = _resolve_device(device)
    source = pretrained_source(cfg, cache_dir, ungated)
    model = VisionTransformerLS(device="meta", dtype=dtype, **model_args)
    model.pretrained_cfg = dict(cfg)  # names the architecture in error messages; timm's builder sets it again
    targets = model.state_dict()
    with open_checkpoint(source) as checkpoint:
        fitted = plan_load(checkpoint, model, pretrained=True, prepare=_for_the_model(cfg, model))
        with tqdm(
            total=fitted.plan.nbytes, unit="B", unit_scale=True, delay=PROGRESS_DELAY_S, desc="loading", leave=False
        ) as progress:
            for key, tensor in fitted.plan.items():
                target = targets[key]
                value = tensor.to(device=device, dtype=target.dtype, memory_format=torch.contiguous_format)
                if value is tensor:  # still the file's pages or the caller's tensor: the model gets its own
                    value = tensor.clone(memory_format=torch.contiguous_format)
                _assign(model, key, value)
                progress.update(fitted.plan.info(key).nbytes)
        fitted.plan.release()
    fold_bias_masks_(model)  # the file's raw qkv biases beside their masks: the forward adds bias * mask
    log_report(fitted.report(f"loaded a checkpoint with {fitted.format_title}"))
    return model
