"""What the package and its command know without importing torch: the checkpoint formats by name and what each
writes, the dtype and weights-set choices, and what a variant file is called.

The command line checks its arguments against these before torch loads (`timm-ls --help` and bad input answer
at once); the package's format registry and writers take the same names and rules from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FOLDER, FILE, FILE_OR_FOLDER = "folder", "file", "file or folder"


@dataclass(frozen=True)
class FormatOption:
    """An option of one format's own: `convert --FLAG` on the command line, `convert_checkpoint(dest=...)` in
    Python. `file` names what the value is when it must be an existing file (checked before torch)."""

    flag: str
    default: Any
    help: str
    metavar: str | None = None
    file: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class FormatSpec:
    """A checkpoint format as the command offers it: its `--to` name, what it is, and what it writes.

    `writes` is FOLDER, FILE (named with one of `suffixes`) or FILE_OR_FOLDER (a file with one of `suffixes`,
    a folder without a suffix). `files` are the names (`fnmatch` patterns) of every file it writes in a
    folder: what `--overwrite` may replace there (`timm_ls.destinations`).
    """

    name: str
    description: str
    writes: str
    suffixes: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    options: tuple[FormatOption, ...] = ()  # its own options, in the command's group `options_title`
    options_title: str = ""

    @property
    def option_defaults(self) -> dict[str, Any]:
        return {option.dest: option.default for option in self.options}

    def writes_folder(self, name: str) -> bool:
        """Whether this format writes a folder at a destination called `name`."""
        return self.writes == FOLDER or (self.writes == FILE_OR_FOLDER and not _suffix(name))


def _suffix(name: str) -> str:
    stem = name.rstrip("/").rpartition("/")[2]
    return stem[stem.rfind(".") :].lower() if "." in stem.lstrip(".") else ""


TORCH_SUFFIXES = (".pth", ".pt", ".bin")
# Suffixes that name a file, never a folder a writer makes.
FILE_SUFFIXES = (*TORCH_SUFFIXES, ".safetensors", ".onnx", ".ckpt", ".tar", ".json", ".yaml", ".yml", ".png", ".csv")

WEIGHTS, CONFIG = "model.safetensors", "config.json"
# What torch.distributed.checkpoint's FileSystemWriter writes: the metadata (through a .tmp file), data per rank.
DCP_FILES = (".metadata", ".metadata.tmp", "__*.metadata", "__*.metadata.tmp", "__*_*.distcp")

# Each format's spec, by the name its module takes it by; FORMATS in the order the command lists them.
NATIVE_SPEC = FormatSpec(
    "native", "this package's layout with a timm config.json", FOLDER, files=(WEIGHTS, CONFIG, "README.md")
)
META_SPEC = FormatSpec(
    "meta", "Meta's DINOv3 keys in one .pth or .safetensors file", FILE, (*TORCH_SUFFIXES, ".safetensors")
)
META_TRAIN_SPEC = FormatSpec(
    "meta-train",
    "what Meta's DINOv3 trainer loads: backbone and heads, a .pth or a distributed checkpoint folder",
    FILE_OR_FOLDER,
    (".pth",),
    files=DCP_FILES,
    options=(
        FormatOption(
            "--meta-config",
            None,
            "Meta's training YAML: new heads get its dino:/ibot: head sizes (merged over Meta's defaults); "
            "carried heads must match them",
            metavar="FILE.yaml",
            file="Meta training YAML",
        ),
        FormatOption("--seed", 0, "seed of new heads (default 0)"),
        FormatOption(
            "--distill-teacher",
            False,
            "the checkpoint is for distillation.checkpoint_path: a source without heads warns (--strict refuses)",
        ),
    ),
    options_title="meta-train (what Meta's DINOv3 trainer resumes, distils and gram-anchors from)",
)
HF_SPEC = FormatSpec(
    "hf",
    "transformers' DINOv3ViTModel or Sapiens2Model folder (by the weights' family)",
    FOLDER,
    files=(CONFIG, WEIGHTS, "model-*-of-*.safetensors", "model.safetensors.index.json"),
)
TIMM_SPEC = FormatSpec(
    "timm",
    "timm's eva folder, in the eva architecture of the weights' family",
    FOLDER,
    files=(CONFIG, WEIGHTS),
)
SAPIENS2_SPEC = FormatSpec(
    "sapiens2",
    "Sapiens2's own keys (facebookresearch/sapiens2) in one .pth or .safetensors file",
    FILE,
    (*TORCH_SUFFIXES, ".safetensors"),
)
FORMATS = (NATIVE_SPEC, META_SPEC, META_TRAIN_SPEC, HF_SPEC, TIMM_SPEC, SAPIENS2_SPEC)
FORMAT_NAMES = tuple(spec.name for spec in FORMATS)


def format_spec(name: str) -> FormatSpec | None:
    return next((spec for spec in FORMATS if spec.name == name), None)


# dtype names of `convert --dtype` and `export --dtype`; "keep" leaves each tensor's own.
KEEP = "keep"
CAST_DTYPES = ("fp32", "bf16", "fp16")
EXPORT_DTYPES = ("fp32", "fp16")
# Weights sets of a training checkpoint: EMA/teacher where there is one, the EMA set, the trained set.
WEIGHTS_SETS = ("auto", "ema", "raw")

VARIANT_FILE_SUFFIXES = (".yaml", ".yml")


def is_variant_file(name: str) -> bool:
    """Whether `name` names a YAML variant file (by its suffix; it may not exist)."""
    return str(name).lower().endswith(VARIANT_FILE_SUFFIXES)


def suffix_of(name: str) -> str:
    """The lower-case suffix of a path's last part (`.pth`), or '' (a leading dot does not make one)."""
    return _suffix(str(name))


# The line every model card this package writes carries: a README.md counts as a format's own file (and
# `--overwrite` may replace it) only when it holds this line, so a user's own README is never deleted.
MODEL_CARD_TAGS = "tags: [image-feature-extraction, timm, timm-layerscale, dinov3]"
# Files a format writes under names a user's files have too: ours only when their first bytes hold the mark.
OWN_BY_CONTENT = {"README.md": MODEL_CARD_TAGS}
