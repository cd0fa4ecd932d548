"""Every command's parser, without torch: `timm-ls --help`, each command's `--help` and bad arguments answer
before the command's own module (and with it torch and timm) is loaded.

The choices (`--to`, `--dtype`, `--weights`) come from `names`, the same table the package's formats use.
"""

from __future__ import annotations

import argparse

from .image_folder import CLASSIFICATION, TASKS
from .int8_request import add_int8_options
from .names import CAST_DTYPES, EXPORT_DTYPES, FORMAT_NAMES, FORMATS, KEEP, WEIGHTS_SETS, FormatSpec
from .paths import experiments_dir, install_hint
from .pretrain_parser import add_pretrain
from .probe_request import TOKENS

DESCRIPTION = "DINOv3-style ViTs with LayerScale for timm, and LayerScale made visible"
DEFAULT_COMMAND = "demo"
DEFAULT_PLOT = "layerscale_gammas.png"
CHECK_TOLERANCES = "fp32 0.0001, fp16 0.01"  # export --check; the package's `export.check.TOLERANCE`
CONVERT_EXAMPLES = """examples:
  timm-ls convert dinov3_vitb16_pretrain.pth vitb16-timm --to timm
  timm-ls convert ckpt/12499 vitl16-hf --to hf --model vit_ls_large_patch16_dinov3
  timm-ls convert hf-folder model.pth --to meta --dtype bf16
  timm-ls convert model.pth fused --to native --fuse-layerscale
  timm-ls convert dinov3_vitl16_pretrain.pth vitl16-train.pth --to meta-train --meta-config train.yaml
  timm-ls convert timm-finetune/model_best.pth.tar vitb16-teacher --to meta-train --distill-teacher --strict"""
EXPORT_EXAMPLES = """examples:
  timm-ls export vit_ls_small_patch16_dinov3.lvd1689m vits16.onnx --pretrained --check
  timm-ls export dinov3_vitb16_pretrain_lvd1689m.pth vitb16.onnx --outputs features:2,5,8,11 --check
  timm-ls export vit_ls_base_patch16_dinov3.lvd1689m vitb16-fp16.onnx --pretrained --dtype fp16 --size 224x224
  timm-ls export vit7b16-folder vit7b16.onnx --model vit_ls_7b_patch16_dinov3 --dtype fp16
  timm-ls export vit7b16-folder vit7b16-2.onnx --model-kwargs depth=2 --check   # the first 2 blocks
  timm-ls export vit_ls_small_patch16_dinov3.lvd1689m vits16-int8.onnx --pretrained --int8 dynamic --images photos/
  timm-ls export vit_ls_small_patch16_dinov3.lvd1689m vits16-int8.onnx --pretrained --int8 static \\
      --calibrate photos/ --min-cosine 0.98"""
FEATURES_EXAMPLES = """examples:
  timm-ls features photo.jpg --model vit_ls_small_patch16_dinov3.lvd1689m --pretrained --out pca
  timm-ls features photos/ --model vit_small_patch14_dinov2.lvd142m --pretrained --out pca --foreground
  timm-ls features big.png --model vit_ls_base_patch16_dinov3 --checkpoint model/ --size native --out pca --save
  timm-ls features a.png b.png --model vit_ls_small_patch16_dinov3 --out pca --per-image --layer 5"""
PROBE_EXAMPLES = """examples:
  timm-ls probe flowers/ --model vit_ls_small_patch16_dinov3.lvd1689m --pretrained --out probe-flowers
  timm-ls probe flowers/ --model vit_ls_small_patch16_dinov3.lvd1689m vit_small_patch14_dinov2.lvd142m --pretrained \\
      --out probe-flowers
  timm-ls probe flowers/ --model vit_ls_base_patch16_dinov3 --checkpoint model/ --layer last last_four 6 --out p
  timm-ls probe scenes/ --task segmentation --model vit_ls_small_patch16_dinov3.lvd1689m --pretrained --out seg"""


def _choices(names: tuple[str, ...]) -> str:
    return "{" + ",".join(names) + "}"


def _model_kwargs(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--model-kwargs", nargs="+", action="extend", default=[], metavar="K=V", help=f"model args, e.g. {example}"
    )


def _weights(parser: argparse.ArgumentParser, checkpoint: str, pretrained: str, pretrained_first: bool = False) -> None:
    """`--checkpoint PATH` or `--pretrained`, never both, each with the command's own help, in the command's
    order (its usage line and help list them so)."""
    weights = parser.add_mutually_exclusive_group()
    if pretrained_first:
        weights.add_argument("--pretrained", action="store_true", help=pretrained)
    weights.add_argument("--checkpoint", metavar="PATH", help=checkpoint)
    if not pretrained_first:
        weights.add_argument("--pretrained", action="store_true", help=pretrained)


def _plot(parser: argparse.ArgumentParser, default: str | None) -> None:
    where = f" (default {default})" if default else ""
    parser.add_argument("--plot", metavar="FILE.png", default=None, help=f"write a PNG of the gammas{where}")
    if default:
        parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.set_defaults(default_plot=default)


def add_demo(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "demo",
        help="watch LayerScale learn on generated shapes, or show a model's gammas (the default command)",
        description="Without weights it trains a small vit_ls from random weights on shapes generated from a seed "
        "(about 20 s on 2 CPU cores, nothing downloaded) and shows each block's gammas before and after. With "
        "--pretrained or --checkpoint it shows that model's gammas and runs the shipped images through it.",
    )
    parser.add_argument(
        "--variant", help="NAME, NAME.TAG or a YAML variant file (default: the experiment's, a small ViT-S)"
    )
    _weights(parser, "show the gammas of this checkpoint (file or folder)", "show the gammas of the tag's Hub weights")
    _model_kwargs(parser, "init_values=1e-6 depth=2")
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=str(experiments_dir() / "demo.yaml"),
        help="the training experiment: model size, data, steps, lr (default: the shipped demo.yaml)",
    )
    parser.add_argument("--steps", type=int, help="training steps (default: the experiment's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and batch order (default 0)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for training (default 1: the model is tiny)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    parser.add_argument("--image", action="append", default=[], metavar="PATH", help="with weights: run these images")
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="the folder for the picture and, in training, the trained model (default: ./timm-ls-demo, or "
        "~/.cache/timm-layerscale/demo inside a git checkout of this repository)",
    )
    _plot(parser, DEFAULT_PLOT)


def add_inspect(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "inspect",
        help="show the LayerScale gammas of a checkpoint, variant or timm model",
        description="The source is a checkpoint file in any format the package reads, a registered vit_ls name "
        "(random, --pretrained or --checkpoint weights), a YAML variant file, or any timm model with LayerScale. "
        "Files are read lazily: only the gamma tensors leave the disk, so a 7B checkpoint takes seconds.",
    )
    parser.add_argument(
        "source",
        metavar="MODEL_OR_CHECKPOINT",
        help="a checkpoint file or folder, a vit_ls NAME[.TAG], a YAML variant file, or a timm model with LayerScale "
        "(deit3_*, cait_*, vit_*_dinov3, ...)",
    )
    _weights(
        parser, "with a model name: read the gammas from this file", "with a model name: read its pretrained weights"
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS_SETS,
        default="auto",
        help="which weights set of a training checkpoint (default auto: EMA/teacher where there is one)",
    )
    _model_kwargs(parser, "depth=2 init_values=1e-6")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    _plot(parser, None)


def add_ablate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "ablate",
        help="train one deep, narrow ViT-LS per init value and compare (about 6 minutes on 2 idle cores)",
        description="Every run shares the weights seed, batch order, learning-rate schedule, step budget and data "
        "(shapes generated from a seed, nothing downloaded); only init_values differs. Writes the curves as CSV and "
        "PNG, the final gammas as CSV, the experiment as YAML, and a short summary of what happened.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=str(experiments_dir() / "ablate.yaml"),
        help="the experiment (default: the shipped ablate.yaml); the flags below override it",
    )
    parser.add_argument("--variant", help="NAME or a YAML variant file whose architecture rules are used")
    parser.add_argument("--depth", type=int, help="blocks")
    parser.add_argument("--width", type=int, help="embed_dim")
    parser.add_argument("--heads", type=int, help="num_heads")
    parser.add_argument("--steps", type=int, help="training steps")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--warmup", type=int, help="linear warmup steps")
    parser.add_argument("--batch-size", type=int, help="images per step")
    parser.add_argument("--init-values", nargs="+", metavar="V", help="e.g. off 0.1 1e-4 1e-6")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="S", help="e.g. 0 1 2")
    _model_kwargs(parser, "other VitLsConfig fields")
    parser.add_argument("--jobs", type=int, help="runs side by side, one thread each (default: one per core)")
    parser.add_argument(
        "--out", default="layerscale_ablation", metavar="DIR", help="output folder (default %(default)s)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")


def add_list(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("list", help="list the registered variants")
    parser.add_argument("--json", action="store_true", help="print every tag's Hub repo and each YAML file as JSON")


def add_run(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("run", help="run a timm script (train.py, validate.py) with the variants registered")
    parser.add_argument("script", metavar="SCRIPT", help="path of the script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")


def add_convert(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert",
        help="convert a checkpoint between Meta, transformers, timm eva and native formats",
        description="Convert a checkpoint into another format, tensor by tensor, and say what the target cannot hold.",
        epilog=CONVERT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "src",
        metavar="SRC",
        help="a .pth/.bin/.safetensors file, a sharded index, a Hub folder or a torch.distributed.checkpoint folder",
    )
    parser.add_argument(
        "dst",
        metavar="DST",
        help="a folder (native, hf, timm) or a .pth/.safetensors file (meta); meta-train: a .pth file, or a name "
        "without a suffix for a distributed checkpoint folder; its folder must exist",
    )
    targets = "; ".join(f"{spec.name}: {spec.description}" for spec in FORMATS)
    parser.add_argument("--to", required=True, metavar=_choices(FORMAT_NAMES), help=targets)
    parser.add_argument("--model", metavar="NAME[.TAG]|VARIANT.yaml", help="the variant (default: from the shapes)")
    _model_kwargs(parser, "depth=2")
    parser.add_argument(
        "--dtype",
        metavar=_choices((KEEP, *CAST_DTYPES)),
        help="cast the weights (RoPE periods keep theirs); default keep, fp32 for meta-train",
    )
    parser.add_argument(
        "--weights", default="auto", metavar=_choices(WEIGHTS_SETS), help="EMA/teacher or trained weights"
    )
    parser.add_argument("--fuse-layerscale", action="store_true", help="fold every gamma into the layer before it")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="refuse NaN/Inf gammas, outputs the target changes and (meta-train) what Meta's backbone cannot hold",
    )
    for spec in FORMATS:
        _add_format_options(parser, spec)
    parser.add_argument(
        "--json", action="store_true", help="print what was done as JSON, every model argument included"
    )


def _add_format_options(parser: argparse.ArgumentParser, spec: FormatSpec) -> None:
    """A format's own options as a group of `convert`: a flag for a boolean, a typed value otherwise."""
    if not spec.options:
        return
    group = parser.add_argument_group(spec.options_title)
    for option in spec.options:
        if isinstance(option.default, bool):
            group.add_argument(option.flag, action="store_true", help=option.help)
        else:
            kind = type(option.default) if option.default is not None else str
            group.add_argument(option.flag, type=kind, default=option.default, metavar=option.metavar, help=option.help)


def add_export(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="export a model or checkpoint to ONNX, checked in ONNX Runtime",
        description="Export to ONNX with one input, pixel_values [N, 3, H, W], and named outputs; the metadata "
        "carries the variant, preprocessing and licence. Needs the export extra: "
        f"{install_hint('export')}",
        epilog=EXPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        metavar="MODEL_OR_CHECKPOINT",
        help="a variant NAME[.TAG] (with --pretrained for its weights), a YAML variant file, or any checkpoint "
        "file or folder",
    )
    parser.add_argument("dst", metavar="DST.onnx", help="the ONNX file (weights over 2 GB go to DST.onnx.data)")
    parser.add_argument(
        "--model", metavar="NAME[.TAG]|VARIANT.yaml", help="a checkpoint's variant (default: from the shapes)"
    )
    _model_kwargs(parser, "depth=2 (of a checkpoint: its first 2 blocks)")
    parser.add_argument("--pretrained", action="store_true", help="a variant name's Hub weights (else random init)")
    parser.add_argument("--dtype", default="fp32", metavar=_choices(EXPORT_DTYPES), help="weights and activations")
    parser.add_argument("--batch", default="dynamic", metavar="N|dynamic", help="the batch size (default: dynamic)")
    parser.add_argument("--size", default="dynamic", metavar="HxW|dynamic", help="the input sides (default: dynamic)")
    parser.add_argument(
        "--outputs",
        default="pooled",
        metavar="pooled|tokens|features:I,J,...|features:NAME",
        help="pooled: what forward returns; tokens: the last block's normed tokens; features: those blocks' "
        "(or a name's: last, last_four, four_even, Meta's four_last, four_even_intervals) "
        "patch tokens as [N, C, H/16, W/16]",
    )
    parser.add_argument("--fuse-layerscale", action="store_true", help="fold every gamma into the layer before it")
    parser.add_argument("--opset", type=int, metavar="N", help="the ONNX opset (default: torch's)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare ONNX Runtime with PyTorch fp32 at three sizes; fail above a relative error of "
        + CHECK_TOLERANCES,
    )
    add_int8_options(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")


def add_features(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "features",
        help="the PCA of a model's patch features as RGB, beside each image (and the features as safetensors)",
        description="Runs each image through the model at the size asked, takes one block's normed patch tokens "
        "(the last by default; CLS and storage tokens left out) and writes DIR/<stem>_pca.png: the image and its "
        "features' first three whitened PCA components as RGB through sigmoid(2x), as in Meta's DINOv3 figures. "
        "One PCA is fitted on all the images together, so a colour means the same in every picture. Before a "
        "large image it says what the forward will take, and refuses what would not fit in memory. Needs PIL "
        "(the tools extra: pip install 'timm-layerscale[tools]').",
        epilog=FEATURES_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files, or folders of them")
    parser.add_argument(
        "--model",
        metavar="NAME[.TAG]|VARIANT.yaml",
        help="a vit_ls variant, a YAML variant file, or a timm ViT with forward_intermediates (vit_*_dinov2, "
        "deit3_*, eva's vit_*_dinov3, ...); with --checkpoint, by default the model the checkpoint is",
    )
    _weights(
        parser, "weights from this file or folder", "the tag's Hub weights (else random init)", pretrained_first=True
    )
    _model_kwargs(parser, "depth=2")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write; must not exist")
    parser.add_argument("--overwrite", action="store_true", help="write into DIR although it exists")
    parser.add_argument(
        "--size",
        default="768",
        metavar="N|native",
        help="the shorter side in pixels, the longer cropped to a multiple of the patch (default 768, as Meta's "
        "notebook); native: each image's own size, cropped to a multiple of the patch",
    )
    parser.add_argument("--layer", default="last", metavar="I|last", help="the block to read (default last)")
    parser.add_argument("--per-image", action="store_true", help="fit one PCA per image, not one for them all")
    parser.add_argument(
        "--foreground",
        action="store_true",
        help="DINOv2's rule: drop patches whose first PCA component is below a threshold, then fit the colours "
        "on the rest; the background is black",
    )
    parser.add_argument("--save", action="store_true", help="also write DIR/<stem>_features.safetensors")
    parser.add_argument("--batch", type=int, default=8, metavar="N", help="images of one size per forward (8)")
    parser.add_argument("--dtype", default="fp32", metavar=_choices(CAST_DTYPES), help="weights and activations")
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu, cuda, cuda:1, mps (default cpu)")


def add_probe(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "probe",
        help="how good a model's frozen features are on your images: Meta's kNN, logistic-regression and linear "
        "segmentation protocols",
        description="Extracts each model's features once (its own eval transform, under inference_mode, batched) "
        "into DIR/features/ as safetensors, so that a second probe on the same data does no forward, then runs "
        "Meta's protocols on them: weighted kNN (T=0.07; k in 10, 20, 100, 200) and L-BFGS logistic regression "
        "over Meta's C grid (classification), or the linear head on patch tokens (segmentation). Prints a table "
        "and writes DIR/results.json; several --model or --layer values give one row each and a chart. The "
        "logistic regression needs scikit-learn (pip install 'timm-layerscale[probe]').",
        epilog=PROBE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "data",
        metavar="DATA",
        help="DATA/train/<class>/* and DATA/val/<class>/* (timm's ImageFolder); "
        "segmentation: DATA/{train,val}/images/* and masks/<name>.png",
    )
    parser.add_argument(
        "--model",
        nargs="+",
        action="extend",
        metavar="NAME[.TAG]|VARIANT.yaml",
        help="one or more models to compare: vit_ls variants, YAML variant files or timm ViTs",
    )
    _weights(
        parser, "weights from this file or folder", "the tags' Hub weights (else random init)", pretrained_first=True
    )
    _model_kwargs(parser, "depth=2")
    parser.add_argument(
        "--layer",
        nargs="+",
        action="extend",
        metavar="I|last|last_four|four_even",
        help="the blocks read (default last): a block index, last, or a set whose blocks are concatenated as "
        "Meta's n_last_blocks; several values: one row each",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="results.json, the chart and pictures, and the feature cache DIR/features/ (reused by the next run)",
    )
    _probe_protocol_options(parser)


def _probe_protocol_options(parser: argparse.ArgumentParser) -> None:
    """`timm-ls probe`'s options of the protocols and of the run."""
    parser.add_argument(
        "--tokens",
        default="cls",
        metavar=_choices(TOKENS),
        help="the logistic regression's input (default cls): the normed CLS token of each block read, the mean of "
        "their patch tokens, or Meta's CLS tokens plus the last block's mean patch token; kNN always takes CLS",
    )
    parser.add_argument("--task", default=CLASSIFICATION, metavar=_choices(TASKS), help="(default %(default)s)")
    parser.add_argument(
        "--val-split",
        type=float,
        default=0.2,
        metavar="F",
        help="without DATA/val: the part of each class held out as val, seeded (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the val split, C's held-out part and the head (0)")
    parser.add_argument("--batch", type=int, default=32, metavar="N", help="images per forward (default 32)")
    parser.add_argument(
        "--strict", action="store_true", help="refuse an image that cannot be read (default: skip it, with a count)"
    )
    parser.add_argument(
        "--max-iter",
        type=int,
        default=1000,
        metavar="N",
        help="logistic regression: L-BFGS iterations per fit at most (default 1000, Meta's max_train_iters)",
    )
    parser.add_argument(
        "--steps", type=int, default=500, metavar="N", help="segmentation: AdamW steps of the linear head (500)"
    )
    parser.add_argument(
        "--pictures", type=int, default=4, metavar="N", help="segmentation: val images drawn with truth and prediction"
    )
    parser.add_argument("--dtype", default="fp32", metavar=_choices(CAST_DTYPES), help="weights and activations")
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu, cuda, cuda:1, mps (default cpu)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch's CPU threads (default: torch's own choice)")


# command -> (its parser, the module of timm_layerscale.cli that runs it)
COMMANDS = {
    "demo": (add_demo, "demo"),
    "inspect": (add_inspect, "inspection"),
    "ablate": (add_ablate, "ablate"),
    "list": (add_list, "listing"),
    "run": (add_run, "run"),
    "convert": (add_convert, "convert"),
    "export": (add_export, "export"),
    "features": (add_features, "features"),
    "probe": (add_probe, "probe"),
    "pretrain": (add_pretrain, "pretrain"),
}


def make_parser(version: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timm-ls",
        description=DESCRIPTION,
        epilog=f"Without a command it runs `{DEFAULT_COMMAND}`; `timm-ls {DEFAULT_COMMAND} -h` lists its options.",
    )
    parser.add_argument("--version", action="version", version=version)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command")
    for add, _ in COMMANDS.values():
        add(commands)
    return parser
