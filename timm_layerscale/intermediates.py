"""timm's and Meta's intermediate-layer API of `VisionTransformerLS`: block outputs by index or by a named
layer set, and pruning the blocks after the last one a caller takes."""

from collections.abc import Sequence
from typing import Any

import torch
from timm.models._features import feature_take_indices
from torch import nn

from .config import feature_layers


class IntermediatesMixin:
    """Needs the model's `blocks`, `_naflex_tokens`, `_patch_grid`, `prepare_tokens`, `_rope_per_block`,
    `_run_blocks`, `_final_norm` and `reset_classifier`."""

    def forward_intermediates(
        self,
        x: torch.Tensor | dict[str, Any],
        indices: int | Sequence[int] | str | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
    ) -> list[Any] | tuple[torch.Tensor, list[Any]] | dict[str, Any]:
        """timm's contract: block outputs at `indices` (last n if an int, or a name of `config.feature_layers`:
        "last", "last_four", "four_even"), optionally normed. A NaFlex batch's come as timm's NaFlexVit gives
        them: "NLC" only, padded `[B, N, C]` (`output_dict` adds `patch_valid`)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt: got {output_fmt!r}; allowed: 'NCHW' or 'NLC'")
        take_indices, max_index = feature_take_indices(len(self.blocks), feature_layers(indices, len(self.blocks)))
        grid, patch_valid, attn_mask = None, None, None
        if isinstance(x, dict):
            if output_fmt != "NLC":
                raise ValueError(
                    "output_fmt: got 'NCHW' for a NaFlex batch, whose images have grids of their own; allowed: "
                    "'NLC' (place each token by patch_coord)"
                )
            x, patch_valid, ropes, attn_mask = self._naflex_tokens(x)
        else:
            grid = self._patch_grid(x)
            x = self.prepare_tokens(x)
            ropes = self._rope_per_block(self.rope_embed.grid_coords(*grid))
        x, intermediates = self._run_blocks(
            x, ropes, attn_mask, keep=list(take_indices), last=max_index if stop_early else -1
        )
        if norm:
            intermediates = [self._final_norm(y) for y in intermediates]
        prefix = self.num_prefix_tokens
        prefix_tokens = [y[:, :prefix] for y in intermediates]
        intermediates = [y[:, prefix:] for y in intermediates]
        if grid is not None and output_fmt == "NCHW":
            intermediates = [y.unflatten(1, grid).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if output_dict:
            found = {"image_intermediates": intermediates}
            if return_prefix_tokens:
                found["image_intermediates_prefix"] = prefix_tokens
            if patch_valid is not None:
                found["patch_valid"] = patch_valid
            return found if intermediates_only else {**found, "image_features": self._final_norm(x)}
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix_tokens))
        return intermediates if intermediates_only else (self._final_norm(x), intermediates)

    def prune_intermediate_layers(
        self, indices: int | Sequence[int] | str = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        take_indices, max_index = feature_take_indices(len(self.blocks), feature_layers(indices, len(self.blocks)))
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
            self.cls_norm = nn.Identity() if self.cls_norm is not None else None
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    def get_intermediate_layers(
        self,
        x: torch.Tensor,
        n: int | Sequence[int] | str = 1,
        reshape: bool = False,
        return_class_token: bool = False,
        return_extra_tokens: bool = False,
        norm: bool = True,
    ) -> tuple[Any, ...]:
        """Meta's DINOv3 method: patch tokens of the last `n` blocks (or of the listed blocks, or of a name:
        "last", "last_four", "four_even", and Meta's "four_last", "four_even_intervals")."""
        outputs = self.forward_intermediates(
            x,
            indices=n,
            return_prefix_tokens=True,
            norm=norm,
            stop_early=True,
            output_fmt="NCHW" if reshape else "NLC",
            intermediates_only=True,
        )
        result = []
        for patches, prefix in outputs:
            item = (patches,)
            if return_class_token:
                item += (prefix[:, 0],)
            if return_extra_tokens:
                item += (prefix[:, 1:],)
            result.append(item if len(item) > 1 else patches)
        return tuple(result)
