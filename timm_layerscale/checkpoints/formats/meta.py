"""Meta's released DINOv3 backbones: `dinov3_vit*16_pretrain_*.pth`, what Meta's hub builders load.

Its keys are this package's own (the native layout without a classifier head). Recognised by the storage
tokens, a native gamma or a fused qkv weight. Written as one `.pth` (or `.safetensors`) file; Meta's code
builds the model, so there is no config. Its blocks always have LayerScale.
"""

from __future__ import annotations

from collections.abc import Sequence

from timm_ls.names import META_SPEC

from ..write.writers import write_safetensors, write_torch_file
from .base import (
    META_TABLE,
    META_TITLE,
    Format,
    Job,
    PreparedWrite,
    gamma_branches,
    native_keys,
    not_held_report,
    with_all_gammas,
)


class Meta(Format):
    spec = META_SPEC
    title = META_TITLE
    table = META_TABLE
    may_drop = frozenset({"head"})  # Meta's backbones have no classifier
    rope_code = "Meta's hub builders"

    def recognise(self, keys: Sequence[str]) -> bool:
        return native_keys(keys)

    def prepare_write(self, job: Job) -> PreparedWrite:
        config = job.config
        self.holding(config)
        branches = gamma_branches(config)
        full = with_all_gammas(job.tensors, config.depth, config.embed_dim, job.fill_dtype, branches)
        out, unheld = self.table.from_native(full)
        self.check_holds(config, unheld)
        not_held, warnings = not_held_report(unheld, self.name)
        writer = write_safetensors if job.dst.suffix == ".safetensors" else write_torch_file
        return PreparedWrite(out, lambda tmp, bar: writer(tmp, out, progress=bar), not_held, warnings)


META = Meta()
