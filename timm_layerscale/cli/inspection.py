"""`timm-ls inspect MODEL_OR_CHECKPOINT`: LayerScale gammas per block and branch, as a table, JSON or PNG.

The source is a checkpoint file in any format the package reads, a registered `vit_ls` name (random,
`--pretrained` or `--checkpoint` weights), a YAML variant file, or any timm model with LayerScale. Files
are read lazily: only the gamma tensors leave the disk, so a 7B checkpoint takes seconds.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import timm
import torch

from timm_ls.logs import quieted
from timm_ls.names import is_variant_file

from ..checkpoints import CheckpointError
from ..checkpoints.read.reader import LazyCheckpoint, open_checkpoint
from ..hub import HubError, fetch_hub_weights
from ..identity import identify_checkpoint
from ..tools.gammas import BRANCHES, MUTED_BELOW, BlockGammas, block_name, find_gamma_keys, gamma_stats, short_number
from ..variants import VARIANTS, ungated_tag
from .common import CliError, parse_model_kwargs
from .common import resolve_variant as resolve_vit_ls
from .gamma_report import draw, plot_target, stats_table

RANDOM_BUILD_LIMIT = 1_500_000_000  # parameters: larger random models are described from their config only
CHECKPOINT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".tar", ".ckpt")
# The command line's way around the Hub: the downloaded file, read as any checkpoint.
INSPECT_WAY_OUT = "pass the downloaded file instead: timm-ls inspect FILE"
# A transformer block's attention in any format (Meta, timm, transformers): a model without one has no LayerScale.
ATTENTION_KEY = re.compile(r"\.\d+\.(attn|attention|self_attn)\.")


def _meta_model(name: str, kwargs: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return timm.create_model(name, **kwargs)


def _gamma_shapes(keys: dict, shape_of) -> tuple[int, set[int]]:
    blocks = [b for b in keys.values() if b]
    return len(blocks), {shape_of(k)[0] for b in blocks for k in b.values()}


def _check_fits(checkpoint, name: str, kwargs: dict) -> None:
    """A file meant for `name` must have its LayerScale blocks and widths; checked on shapes only."""
    model = _meta_model(name, kwargs)
    expected, _ = find_gamma_keys(list(model.state_dict()))
    found, _ = find_gamma_keys(list(checkpoint))
    want = _gamma_shapes(expected, lambda k: model.state_dict()[k].shape)
    got = _gamma_shapes(found, lambda k: checkpoint.info(k).shape)
    if got != want and want[0]:
        raise CliError(
            f"{checkpoint.path} does not fit {name}: it has LayerScale in {got[0]} blocks of width "
            f"{sorted(got[1])}, {name} in {want[0]} of width {sorted(want[1])}; inspect the file alone "
            f"(`timm-ls inspect {checkpoint.path}`) or name the model it was made for"
        )


def _download(name: str) -> tuple[str, str]:
    """The pretrained weights file of a timm or vit_ls model, from the Hub or its local cache, and its origin."""
    try:
        cfg = timm.models.get_pretrained_cfg(name)
    except RuntimeError as exc:  # an unknown tag
        tags = ", ".join(timm.list_pretrained(name.partition(".")[0] + ".*")) or "none"
        raise CliError(f"{exc} Its tags: {tags}") from None
    if not getattr(cfg, "hf_hub_id", None):
        raise CliError(f"{name} has no pretrained weights on the Hub; pass --checkpoint PATH instead")
    base = name.partition(".")[0]
    ungated = ungated_tag(VARIANTS[base], cfg.tag) if base in VARIANTS else ""
    try:  # huggingface_hub's retries kept off stderr: the command's one line says what failed
        with quieted("huggingface_hub"):
            weights = fetch_hub_weights(cfg, ungated=ungated)
    except HubError as exc:
        if exc.unreachable is None:  # the Hub answered: gated, missing, a server error
            raise CliError(f"--pretrained: {exc.instead(INSPECT_WAY_OUT)}") from None
        raise CliError(
            f"--pretrained: the Hub is not reachable ({exc.unreachable}) and {cfg.hf_hub_id} is not in the local "
            f"cache; {INSPECT_WAY_OUT}"
        ) from None
    return str(weights.path), weights.origin


def _open_file(path: str, weights: str, stack: ExitStack) -> LazyCheckpoint:
    """A file the reader cannot take raises its one-line `CheckpointError` (what the file is, and the fix)."""
    return stack.enter_context(open_checkpoint(path, weights=weights))


def _random_gammas(name: str, kwargs: dict, ours: bool) -> Mapping[str, torch.Tensor]:
    """Gammas of a freshly built model; ours from the config alone, so even the 7B costs nothing."""
    model = _meta_model(name, kwargs)
    if ours:
        init = model.config.layer_init_values
        state = model.state_dict()  # on `meta`: keys and shapes only; the gammas are filled in below
        keys, _ = find_gamma_keys(list(state))
        for i, branches in enumerate(keys.values()):
            for branch, key in branches.items():
                state[key] = torch.full(state[key].shape, init[i][BRANCHES.index(branch)])
        return state
    params = sum(p.numel() for p in model.parameters())
    if params > RANDOM_BUILD_LIMIT:
        raise CliError(
            f"{name} has {params / 1e9:.1f}B parameters: its random gammas all equal the init value, and building "
            f"it to show that is not worth the memory; pass --pretrained or --checkpoint PATH"
        )
    return timm.create_model(name, **kwargs).state_dict()


def _not_found(source: str) -> CliError:
    if "/" in source or source.lower().endswith(CHECKPOINT_SUFFIXES):
        return CliError(f"checkpoint {source} does not exist; pass the path of a checkpoint file")
    base = source.partition(".")[0]
    names = list(VARIANTS) + timm.list_models()
    close = difflib.get_close_matches(base, names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return CliError(
        f"{source!r} is neither a file nor a registered model; {hint}pass a checkpoint file, a YAML variant file, "
        f"a vit_ls name (`timm-ls list`) or a timm model with LayerScale (`timm.list_models('deit3*')`)"
    )


def _identified(ckpt: LazyCheckpoint) -> dict[str, str]:
    """`{"model": ...}`: the variant a DINOv3 checkpoint's weights are, by the one rule convert and export use;
    nothing for other checkpoints (DeiT-III, CaiT, ...) or weights no variant fits."""
    try:
        identified = identify_checkpoint(ckpt).model
    except (CheckpointError, ValueError):
        return {}
    return {"model": f"{identified.full_name} ({identified.reason})"}


def resolve(args: argparse.Namespace, stack: ExitStack) -> tuple[Mapping[str, torch.Tensor], dict[str, str]]:
    """The tensors to read gammas from, and what they are (for the header and the JSON)."""
    source, kwargs = args.source, parse_model_kwargs(args.model_kwargs)
    if not is_variant_file(source) and Path(source).exists():
        if args.checkpoint or args.pretrained or kwargs:
            raise CliError(f"{source} is a file: inspect it alone, or name a model and pass the file with --checkpoint")
        ckpt = _open_file(source, args.weights, stack)
        about = dict(source=source, weights=f"{ckpt.kind}, {ckpt.weights}")
        return ckpt, {**about, **_identified(ckpt)}
    if is_variant_file(source) or source.partition(".")[0] in VARIANTS:
        variant, tag = resolve_vit_ls(source)
        name, ours = f"{variant.name}.{tag}" if tag else variant.name, True
    elif timm.is_model(source.partition(".")[0]):
        name, ours = source, False
    else:
        raise _not_found(source)
    if args.checkpoint:
        ckpt = _open_file(args.checkpoint, args.weights, stack)
        _check_fits(ckpt, name, kwargs)
        return ckpt, dict(source=name, weights=f"{args.checkpoint} ({ckpt.kind}, {ckpt.weights})")
    if args.pretrained:
        path, where = _download(name)
        ckpt = _open_file(path, args.weights, stack)
        return ckpt, dict(source=name, weights=f"{where} ({path})")
    return _random_gammas(name, kwargs, ours), dict(source=name, weights="random init: every gamma is its init value")


# ---------------------------------------------------------------------------------------------- output


def _summary(blocks: list[BlockGammas]) -> list[str]:
    lines = []
    for branch in BRANCHES:
        stats = [(b.label, b.branch(branch)) for b in blocks if b.branch(branch) is not None]
        if not stats:
            lines.append(f"{branch}: no LayerScale in any block")
            continue
        low, high = min(stats, key=lambda t: t[1].mean), max(stats, key=lambda t: t[1].mean)
        muted = sum(s.muted * s.channels for _, s in stats) / sum(s.channels for _, s in stats)
        if short_number(low[1].mean) == short_number(high[1].mean):
            spread = f"{short_number(low[1].mean)} in every block"
        else:
            lowest, highest = short_number(low[1].mean), short_number(high[1].mean)
            spread = f"from {lowest} ({block_name(low[0])}) to {highest} ({block_name(high[0])})"
        lines.append(f"{branch}: mean |gamma| {spread}; {muted:.1%} of channels muted")
    return lines


def _read_line(tensors: Mapping[str, torch.Tensor], read: list[str]) -> str:
    if not isinstance(tensors, LazyCheckpoint):
        return ""
    size = sum(tensors.info(k).nbytes for k in read)
    return (
        f"; read only the {len(read)} gamma tensors ({size / 1e6:.2g} MB) of {len(tensors)} "
        f"({tensors.nbytes / 1e9:.3g} GB)"
    )


def execute(args: argparse.Namespace) -> int:
    plot = plot_target(args)
    with ExitStack() as stack:
        tensors, about = resolve(args, stack)
        keys, spellings = find_gamma_keys(list(tensors))
        blocks = gamma_stats(tensors)
        total = len(tensors)
    if not blocks and not any(ATTENTION_KEY.search(k) for k in tensors):
        raise CliError(
            f"{about['source']} has no LayerScale blocks: it has no transformer blocks with attention (keys "
            f"like blocks.N.attn.*), so no gammas to show; inspect a ViT with LayerScale (deit3_*, cait_*, vit_ls_*)"
        )
    if not blocks:
        raise CliError(
            f"{about['source']} has no LayerScale gammas (keys like blocks.N.ls1.gamma, blocks.N.gamma_1 or "
            f"layer.N.layer_scale1.lambda1): LayerScale is off there or was folded into the projections"
        )
    read = [k for b in keys.values() for k in b.values()]
    plot_line = draw(plot, blocks, f"{about['source']}: {about['weights']}"[:110])
    if args.json:
        print(
            json.dumps(
                dict(
                    **about,
                    spellings=spellings,
                    tensors=total,
                    gammas_read=len(read),
                    muted_below=MUTED_BELOW,
                    blocks=[b.to_dict() for b in blocks],
                    plot=str(plot) if plot_line else None,
                ),
                indent=1,
            )
        )
        return 0
    print(f"source: {about['source']}")
    print(f"weights: {about['weights']}")
    if "model" in about:
        print(f"model: {about['model']}")
    print(f"LayerScale: {', '.join(spellings)} in {len(blocks)} blocks{_read_line(tensors, read)}")
    print(stats_table(blocks))
    print("\n".join(_summary(blocks)))
    if plot_line:
        print(plot_line)
    return 0
