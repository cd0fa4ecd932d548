"""Which weights set of a checkpoint is read: a training checkpoint nests its sets (EMA, teacher, student, ...)
under top-level names beside its training state; the set is chosen by name, the wrappers around the backbone
(`module.`, `backbone.`, ...) are stripped and the training-only parts (heads, losses, the Gram teacher) left
out. Keys only: nothing here reads a tensor.
"""

from __future__ import annotations

import re

from timm_ls.names import WEIGHTS_SETS

from ..errors import CheckpointError

# `LazyCheckpoint.weights` for a source that holds one weights set only.
ONLY_SET = "the only weights set"

# Weights sets a training checkpoint may hold, as top-level names, best first.
EMA_SETS = ("model_ema", "teacher", "state_dict_ema")
RAW_SETS = ("student", "state_dict", "model")
# Other top-level names of training checkpoints: a file whose top level is only these and sets is a container.
TRAINING_STATE = (
    *("optimizer", "scheduler", "lr_scheduler", "scaler", "grad_scaler", "amp_scaler"),
    *("iteration", "epoch", "args", "dataloader", "train_state"),
)
# Prefixes that wrap a backbone in training checkpoints, DDP and torch.compile models.
WRAPPER_PREFIXES = ("module.", "backbone.", "_orig_mod.")
# Meta's DINOv3 pretraining heads, kept apart from the backbone when asked for (`open_checkpoint(heads=True)`).
HEADS = re.compile(r"^(dino_head|ibot_head)\.")
# Keys of pretraining heads, losses, the Gram teacher and other parts no backbone holds.
TRAINING_ONLY = re.compile(
    r"^(dino_head|ibot_head|dino_loss|ibot_patch_loss|koleo_loss|gram_loss|gram_teacher|projectors|gram)\."
)


def _is_container(top: set[str]) -> bool:
    sets = (*EMA_SETS, *RAW_SETS)
    return bool(top & set(sets)) and all(t in sets or t in TRAINING_STATE or TRAINING_ONLY.match(t + ".") for t in top)


def _inside(names: dict[str, str], prefix: str) -> dict[str, str]:
    return {k[len(prefix) :]: v for k, v in names.items() if k.startswith(prefix)}


def select_weights(
    keys: list[str], weights: str, source: str, heads: dict[str, str] | None = None
) -> tuple[str, dict[str, str]]:
    """Picks one weights set among flat keys; returns its name and {backbone key: flat key}.

    `heads`, when given, is filled with the set's pretraining heads, {`dino_head.*`/`ibot_head.*`: flat key}.

    A training checkpoint nests weights sets under top-level names (`teacher.`, `state_dict_ema.`, ...);
    anything else at the top level (`blocks.`, `embeddings.`, `module.`) makes the file one plain set. A single
    set that holds sets itself (DCP's `model.` around Meta's `student.`/`teacher.`/`model_ema.`) is looked into.
    """
    if weights not in WEIGHTS_SETS:
        raise CheckpointError(f"weights must be one of {', '.join(WEIGHTS_SETS)}; got {weights!r}")
    names, taken = {k: k for k in keys}, ONLY_SET
    while True:
        if heads is not None:
            heads.update({k: v for k, v in names.items() if HEADS.match(k)})
            names = {k: v for k, v in names.items() if not HEADS.match(k)}
        names = _strip_wrappers(names)
        top = {k.split(".", 1)[0] for k in names}
        if not _is_container(top):
            break
        ema = [s for s in EMA_SETS if s in top]
        raw = [s for s in RAW_SETS if s in top]
        if len(ema + raw) == 1:
            inner = _strip_wrappers(_inside(names, (ema + raw)[0] + "."))
            if _is_container({k.split(".", 1)[0] for k in inner}):
                names = inner
                continue
        if weights == "ema" and not ema:
            raise CheckpointError(f"{source} holds no EMA or teacher weights; pass --weights raw (or auto)")
        if weights == "raw" and not raw:
            raise CheckpointError(f"{source} holds only EMA or teacher weights; pass --weights ema (or auto)")
        chosen = (ema if weights != "raw" and ema else raw)[0]
        names = _inside(names, chosen + ".")
        taken = chosen if taken == ONLY_SET else f"{taken}.{chosen}"
    if weights == "ema" and taken == ONLY_SET:
        raise CheckpointError(f"{source} holds no EMA or teacher weights; pass --weights raw (or auto)")
    return taken, {k: v for k, v in names.items() if not TRAINING_ONLY.match(k)}


def _strip_wrappers(keys: dict[str, str]) -> dict[str, str]:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            inside = [k for k in keys if k.startswith(prefix)]
            if inside and len(inside) >= len(keys) // 2:
                keys = _inside(keys, prefix)
                changed = True
    return keys


def left_out(flat_keys: list[str], used: set[str], taken: str) -> list[str]:
    """The chosen set's keys that no backbone holds, training-only ones aside (a task head): what is dropped."""
    inside = "" if taken == ONLY_SET else taken + "."
    left = [k[len(inside) :] for k in flat_keys if k not in used and k.startswith(inside)]
    return [k for k in left if not TRAINING_ONLY.match(k.removeprefix("module.")) and not HEADS.match(k)]
