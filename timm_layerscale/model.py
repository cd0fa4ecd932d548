"""The model family: DINOv3-style ViT with LayerScale, RoPE and storage tokens, with timm's model API.

Parameter and buffer names are Meta's, so a Meta DINOv3 state dict is this model's native layout;
other layouts are converted on load by `timm_layerscale.checkpoints`. The forward takes images, or timm's
NaFlex batches (dicts of patches at each image's own aspect ratio, `--naflex-loader`) outside TorchScript.
"""

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from timm.layers import PatchEmbed, register_notrace_function, trunc_normal_
from timm.models.vision_transformer import global_pool_nlc
from torch import nn
from torch.utils.checkpoint import checkpoint

try:  # timm 1.0.31 records a resize for its exports (save_for_hf); older timms record model args nowhere
    from timm.models._input import update_model_input_size
except ImportError:
    update_model_input_size = None

from .checkpoints.load_hook import install_load_hook
from .config import TRAINING_SWITCHES, VitLsConfig
from .intermediates import IntermediatesMixin
from .layer_options import layer_option
from .layers import (
    Block,
    LayerScale,
    RopeEmbedding,
    embed_patches,
    ffn_hidden_features,
    has_bias_mask,
    make_norm,
    naflex_patch_centres,
    norm_classes,
    padding_key_mask,
    pool_valid_tokens,
    read_naflex_batch,
    reset_bias_mask,
)

Rope = tuple[torch.Tensor, torch.Tensor]


# One call in every FX graph (torch.fx.wrap for any tracer, timm's list for timm's): the checks need the
# image size as numbers, known only at run time, so a traced graph checks and works at any size.
@torch.fx.wrap
@register_notrace_function
def patch_grid(image: torch.Tensor, patch_size: int, pad: bool) -> tuple[int, int]:
    """Patches per side of `image`, padded up when `pad`, else an error for a side that is not a multiple."""
    height, width = image.shape[-2], image.shape[-1]
    if pad:  # ceil without a negative floor division: ONNX's integer Div truncates, so -(-h // p) exports wrong
        return (height + patch_size - 1) // patch_size, (width + patch_size - 1) // patch_size
    if height < patch_size or width < patch_size:
        raise ValueError(
            f"input size {height}x{width} is smaller than the patch size {patch_size}: resize it to at least "
            f"{patch_size}x{patch_size}, or build the model with dynamic_img_pad=True to pad"
        )
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"input size {height}x{width} is not a multiple of the patch size {patch_size}: resize or crop it "
            f"to {height // patch_size * patch_size}x{width // patch_size * patch_size}, or build the model "
            f"with dynamic_img_pad=True to pad"
        )
    return height // patch_size, width // patch_size


def _make_blocks(cfg: VitLsConfig, norm_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
    """The blocks, each with its stochastic-depth rate, LayerScale inits and k/v heads."""
    if cfg.stochastic_depth == "drop_path":
        rates = [cfg.drop_path_rate * i / max(cfg.depth - 1, 1) for i in range(cfg.depth)]
    else:
        rates = [cfg.drop_path_rate] * cfg.depth
    mlp_hidden = ffn_hidden_features(cfg.embed_dim, cfg.ffn_layer, cfg.ffn_ratio, cfg.swiglu_align_to)
    return nn.ModuleList(
        Block(
            cfg.embed_dim,
            cfg.num_heads,
            mlp_hidden=mlp_hidden,
            mlp_layer=layer_option("ffn_layer", cfg.ffn_layer).layer,
            qkv_bias=cfg.qkv_bias,
            mask_k_bias=cfg.mask_k_bias,
            proj_bias=cfg.proj_bias,
            ffn_bias=cfg.ffn_bias,
            init_values=cfg.layer_init_values[i],
            norm_layer=norm_layer,
            proj_drop=cfg.proj_drop_rate,
            attn_drop=cfg.attn_drop_rate,
            drop_path=rates[i],
            stochastic_depth=cfg.stochastic_depth,
            num_kv_heads=cfg.layer_kv_heads[i],
            qk_norm=cfg.qk_norm,
        )
        for i in range(cfg.depth)
    )


class VisionTransformerLS(IntermediatesMixin, nn.Module):
    """Vision Transformer with LayerScale on the branches `init_values` names (Sapiens2's: attention only).

    Build it from a `VitLsConfig`, keyword overrides of its fields, or both. `device` and `dtype` place
    the parameters at construction (`device="meta"` allocates nothing).
    """

    __jit_unused_properties__ = ["_model_args", "embeds"]  # timm's bookkeeping, never read by the forward

    def __init__(
        self,
        config: VitLsConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        cfg = config or VitLsConfig()
        if overrides:
            cfg = cfg.replace(**overrides)
        self.config = cfg
        self.num_classes = cfg.num_classes
        self.global_pool = cfg.global_pool
        self.num_features = self.embed_dim = cfg.embed_dim
        self.in_chans = cfg.in_chans
        self.num_storage_tokens = cfg.num_storage_tokens
        self.num_prefix_tokens = cfg.num_prefix_tokens
        self.patch_size = cfg.patch_size
        self.dynamic_img_size = cfg.dynamic_img_size
        self.grad_checkpointing = False

        with torch.device(device) if device is not None else nullcontext():
            self._build(cfg)
        if dtype is not None:
            self.to(dtype=dtype)
        install_load_hook(self)
        if self.local_cls_norm is not None:
            # Only Meta's local-crop pretraining uses it: keep it out of the optimiser and of DDP's reducer.
            self.local_cls_norm.requires_grad_(False)
        if cfg.freeze_layer_scale:
            for module in self.modules():
                if isinstance(module, LayerScale):
                    module.gamma.requires_grad_(False)

    def _build(self, cfg: VitLsConfig) -> None:
        norm_layer = make_norm(cfg.norm_layer, cfg.norm_eps)
        dim = cfg.embed_dim
        self.patch_embed = PatchEmbed(
            img_size=cfg.img_size,
            patch_size=cfg.patch_size,
            in_chans=cfg.in_chans,
            embed_dim=dim,
            output_fmt="NHWC",
            flatten=False,
            strict_img_size=not cfg.dynamic_img_size,
            dynamic_img_pad=cfg.dynamic_img_pad,
        )
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim))
        self.storage_tokens = nn.Parameter(torch.empty(1, cfg.num_storage_tokens, dim))
        self.mask_token = nn.Parameter(torch.empty(1, dim)) if cfg.mask_token else None
        self.rope_embed = RopeEmbedding(
            cfg.head_dim,
            num_prefix_tokens=cfg.num_prefix_tokens,
            base=cfg.rope_base,
            normalize_coords=cfg.rope_normalize_coords,
            shift_coords=cfg.rope_shift_coords,
            jitter_coords=cfg.rope_jitter_coords,
            rescale_coords=cfg.rope_rescale_coords,
            round_periods_to_bf16=cfg.rope_periods_bf16,
            dtype=cfg.rope_dtype,
        )
        self.blocks = _make_blocks(cfg, norm_layer)
        self.feature_info = [
            dict(module=f"blocks.{i}", num_chs=dim, reduction=cfg.patch_size) for i in range(cfg.depth)
        ]
        self.norm = norm_layer(dim)
        self.cls_norm = norm_layer(dim) if cfg.cls_norm else None
        self.local_cls_norm = norm_layer(dim) if cfg.local_cls_norm else None
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = self._make_head(cfg.num_classes)
        if self.cls_token.device.type != "meta":
            self.init_weights()

    def init_weights(self) -> None:
        """DINOv3's initialisation; LayerScale gammas come out equal to their `init_values`."""
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.storage_tokens, std=0.02)
        if self.mask_token is not None:
            nn.init.zeros_(self.mask_token)
        self.rope_embed.reset_parameters()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
                if has_bias_mask(module):
                    reset_bias_mask(module)
            elif isinstance(module, (*norm_classes(), LayerScale, nn.Conv2d)):
                module.reset_parameters()

    reset_parameters = init_weights

    # ---------------------------------------------------------------------------------------- timm API

    @property
    def _model_args(self) -> dict[str, Any]:
        return self.__dict__.get("_reconstruction_args", {})

    @_model_args.setter
    def _model_args(self, args: dict[str, Any]) -> None:
        # timm records create_model's keywords here and exports them (save_for_hf, push_to_hf_hub): a
        # fine-tune saved with reinit_layer_scale=True must not re-initialise its gammas for whoever loads it.
        self.__dict__["_reconstruction_args"] = {k: v for k, v in args.items() if k not in TRAINING_SWITCHES}

    @property
    def head_hidden_size(self) -> int:
        return self.embed_dim * 2 if self.global_pool == "cls_avg" else self.embed_dim

    def _make_head(self, num_classes: int) -> nn.Module:
        return nn.Linear(self.head_hidden_size, num_classes) if num_classes > 0 else nn.Identity()

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"cls_token", "storage_tokens", "mask_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(
            stem=r"^cls_token|^storage_tokens|^mask_token|^patch_embed|^rope_embed",
            blocks=[(r"^blocks\.(\d+)", None), (r"^norm|^cls_norm|^local_cls_norm", (99999,))],
        )

    @torch.jit.ignore
    def get_patch_size(self) -> tuple[int, int]:
        """The patch size the NaFlex loader should cut (train.py's `--naflex-loader` asks for it)."""
        return tuple(self.patch_embed.patch_size)

    @property
    def embeds(self) -> nn.Module:
        """The patch embedding under timm's NaFlexVit name: validate.py's `--naflex-loader` reads
        `model.embeds.patch_size`, and would otherwise cut 16-pixel patches."""
        return self.patch_embed

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        global_pool = self.global_pool if global_pool is None else global_pool
        self.config = self.config.replace(num_classes=num_classes, global_pool=global_pool)  # validates
        self.global_pool = global_pool
        self.num_classes = num_classes
        with torch.device(self.cls_token.device):
            self.head = self._make_head(num_classes).to(dtype=self.cls_token.dtype).train(self.training)

    @torch.jit.ignore
    def set_input_size(
        self, img_size: int | tuple[int, int] | None = None, patch_size: int | tuple[int, int] | None = None
    ) -> None:
        """timm's resize (as eva's): a new input resolution, a new patch size, or both.

        A new patch size resamples the patch embedding as timm's `resample_patch_embed` does; RoPE follows
        the new grid (it is computed from the grid at every forward). The config, the args timm records and
        the pretrained cfg's `input_size` follow, so a later save (`save_native`, timm's `save_for_hf`)
        rebuilds the resized model. Bad values raise a `ValueError` and leave the model unchanged.
        """
        if patch_size is not None and not isinstance(patch_size, int):
            sides = tuple(patch_size)
            if len(sides) != 2 or sides[0] != sides[1]:
                raise ValueError(f"patch_size: got {patch_size!r}; allowed: a positive integer (square patches)")
            patch_size = sides[0]
        if img_size is not None and not isinstance(img_size, int):
            img_size = tuple(img_size)
        config = self.config.replace(  # validates: the size fits the patch size, unless dynamic_img_pad
            img_size=self.config.img_size if img_size is None else img_size,
            patch_size=self.patch_size if patch_size is None else patch_size,
        )
        self.patch_embed.set_input_size(img_size=config.img_size, patch_size=config.patch_size)
        self.config = config
        self.patch_size = config.patch_size
        for info in self.feature_info:
            info["reduction"] = config.patch_size
        height, width = self.patch_embed.img_size
        if update_model_input_size is not None:
            update_model_input_size(self, (height, width), patch_size=config.patch_size)
        else:
            self._model_args = {**self._model_args, "img_size": (height, width), "patch_size": config.patch_size}
        if getattr(self, "pretrained_cfg", None):
            channels = (self.pretrained_cfg.get("input_size") or (self.in_chans,))[0]
            self.pretrained_cfg = self.default_cfg = {**self.pretrained_cfg, "input_size": (channels, height, width)}

    def _patch_grid(self, x: torch.Tensor) -> tuple[int, int]:
        return patch_grid(x, self.patch_size, self.patch_embed.dynamic_img_pad)

    def prepare_tokens(self, x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """`[cls, storage x N, patches]`; masked patches are replaced by `mask_token`."""
        x = self.patch_embed(x).flatten(1, 2)
        mask_token = self.mask_token
        if masks is not None:
            if mask_token is None:
                raise ValueError("masks: this model has no mask token (mask_token=False); pass masks=None")
            x = torch.where(masks.unsqueeze(-1), mask_token.to(x.dtype).unsqueeze(0), x)
        return self._with_prefix(x, self._cls_token(masks is None))

    def _cls_token(self, unmasked: bool = True) -> torch.Tensor:
        """Without masks, `cls_token + 0 * mask_token` keeps the mask token in the graph (DDP without
        find_unused_parameters accepts it)."""
        mask_token = self.mask_token
        if unmasked and mask_token is not None:
            return self.cls_token + 0 * mask_token
        return self.cls_token

    def _with_prefix(self, x: torch.Tensor, cls_token: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        prefix = torch.cat([cls_token, self.storage_tokens], dim=1).to(x.dtype)
        return torch.cat([prefix.expand(batch, -1, -1), x], dim=1)

    def _rope_per_block(self, coords: torch.Tensor) -> list[Rope]:
        """RoPE tables of patch centres `coords` for each block: computed once and shared, except that
        coordinate augmentation draws anew for every block in training, as in DINOv3 pretraining."""
        if self.training and self.rope_embed.augments:
            return [self.rope_embed.from_coords(coords) for _ in self.blocks]
        return [self.rope_embed.from_coords(coords)] * len(self.blocks)

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.cls_norm is None:
            return self.norm(x)
        prefix = self.num_prefix_tokens
        return torch.cat([self.cls_norm(x[:, :prefix]), self.norm(x[:, prefix:])], dim=1)

    def _run_blocks(
        self,
        x: torch.Tensor,
        ropes: list[Rope],
        attn_mask: torch.Tensor | None = None,
        keep: list[int] | None = None,
        last: int = -1,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The blocks' output, and the outputs of the blocks at `keep`; blocks after `last` (when >= 0) are
        not run."""
        kept: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            if last < 0 or i <= last:
                if self.grad_checkpointing and not torch.jit.is_scripting():
                    x = checkpoint(block, x, ropes[i], attn_mask, use_reentrant=False)
                else:
                    x = block(x, ropes[i], attn_mask)
                if keep is not None and i in keep:
                    kept.append(x)
        return x, kept

    def forward_features(
        self, x: torch.Tensor | dict[str, Any], masks: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Normed tokens `[B, 1 + storage + H*W, C]`; for a NaFlex batch, `{"patches": tokens [B, 1 + storage
        + N, C], "patch_valid": [B, N]}` as timm's NaFlexVit returns them (padding tokens hold no result)."""
        if torch.jit.is_scripting():
            assert isinstance(x, torch.Tensor)  # a NaFlex batch is not scriptable
        elif isinstance(x, dict):
            return self._naflex_features(x)
        height, width = self._patch_grid(x)
        ropes = self._rope_per_block(self.rope_embed.grid_coords(height, width))
        # Handed on, not kept in a local: the first block's output then frees the tokens (one tokens-sized
        # tensor less at every later block's peak).
        return self._final_norm(self._run_blocks(self.prepare_tokens(x, masks), ropes)[0])

    def pool(
        self, x: torch.Tensor, pool_type: str | None = None, patch_valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`global_pool` (or `pool_type`) over the tokens `x`; with `patch_valid`, over valid patches only."""
        pool_type = self.global_pool if pool_type is None else pool_type
        if patch_valid is not None:
            return pool_valid_tokens(x, patch_valid, pool_type, self.num_prefix_tokens)
        if pool_type == "cls_avg":
            return torch.cat([x[:, 0], x[:, self.num_prefix_tokens :].mean(dim=1)], dim=-1)
        return global_pool_nlc(x, pool_type=pool_type, num_prefix_tokens=self.num_prefix_tokens)

    def forward_head(
        self,
        x: torch.Tensor | dict[str, torch.Tensor],
        pre_logits: bool = False,
        patch_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pool, head_drop, head. `x`: tokens, or `forward_features`' NaFlex dict, whose padding no pool sees."""
        if torch.jit.is_scripting():
            assert isinstance(x, torch.Tensor)
        elif isinstance(x, dict):
            x, patch_valid = x["patches"], x["patch_valid"]
        x = self.head_drop(self.pool(x, patch_valid=patch_valid))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images `[B, C, H, W]`, or a NaFlex batch (a dict) from timm's `create_naflex_loader` (not scripted).

        Annotated for images alone: FX graphs take this signature, and TorchScript then compiles them."""
        return self.forward_head(self.forward_features(x))

    def _naflex_tokens(
        self, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, list[Rope], torch.Tensor | None]:
        """A NaFlex batch's tokens `[cls, storage x N, patches]`, its `patch_valid`, RoPE per block on each
        image's own grid, and the attention mask that keeps padding from every real token (None without)."""
        cfg, proj = self.config, self.patch_embed.proj
        naflex = read_naflex_batch(batch, cfg)
        x = embed_patches(naflex, proj.weight, proj.bias, cfg.patchify_channels_last, cfg.enable_patch_interpolator)
        x = self._with_prefix(self.patch_embed.norm(x), self._cls_token())
        rope = self.rope_embed
        coords = naflex_patch_centres(naflex.patch_coord, naflex.patch_valid, rope.normalize_coords, rope.table_dtype)
        return (
            x,
            naflex.patch_valid,
            self._rope_per_block(coords),
            padding_key_mask(naflex.patch_valid, self.num_prefix_tokens),
        )

    @torch.jit.unused
    def _naflex_features(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        x, patch_valid, ropes, attn_mask = self._naflex_tokens(batch)
        return {"patches": self._final_norm(self._run_blocks(x, ropes, attn_mask)[0]), "patch_valid": patch_valid}
