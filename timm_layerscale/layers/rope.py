"""Axial rotary position embedding for patch tokens.

Each head's channels are split in two halves that are rotated against each other ("rotate-half"); the
angles are the patch centre's y coordinate for the first quarter of frequencies and x for the second,
both normalised to [-1, 1] over the patch grid (each image's own grid in a NaFlex batch).
"""

import math

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn


def bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


# One call in every FX graph (torch.fx.wrap for any tracer, timm's list for timm's): "max" and "min" compare
# the sides as Python numbers, known only at run time, so a traced graph works at any size.
@torch.fx.wrap
@register_notrace_function
def patch_centre_coords(height: int, width: int, normalize_coords: str, like: torch.Tensor) -> torch.Tensor:
    """Patch centres `[height * width, 2]` (y, x) in `like`'s dtype (fp32, or bf16 for bf16 RoPE) and on its
    device, normalised to [-1, 1] per side as `normalize_coords` says."""
    if normalize_coords == "separate":
        h_den, w_den = height, width
    else:
        h_den = w_den = max(height, width) if normalize_coords == "max" else min(height, width)
    # `arange(n) + 0.5` equals `arange(0.5, n)` and keeps the length symbolic for torch.export.
    # Divided in fp32 and rounded: what torch computes for bf16 over an int, which an exported graph would
    # otherwise divide by the side rounded to bf16 (inexact above 256 patches).
    coords_h = ((torch.arange(height, device=like.device, dtype=like.dtype) + 0.5).float() / h_den).to(like.dtype)
    coords_w = ((torch.arange(width, device=like.device, dtype=like.dtype) + 0.5).float() / w_den).to(like.dtype)
    coords = torch.stack(torch.meshgrid(coords_h, coords_w, indexing="ij"), dim=-1).flatten(0, 1)
    return 2.0 * coords - 1.0


class RopeEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        num_prefix_tokens: int = 0,
        base: float = 100.0,
        normalize_coords: str = "separate",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
        round_periods_to_bf16: bool = True,
        dtype: str = "fp32",
    ) -> None:
        super().__init__()  # head_dim % 4 and normalize_coords: checked once, by the config
        self.head_dim = head_dim
        self.num_prefix_tokens = num_prefix_tokens
        self.base = base
        self.normalize_coords = normalize_coords
        self.shift_coords = shift_coords
        self.jitter_coords = jitter_coords
        self.rescale_coords = rescale_coords
        self.round_periods_to_bf16 = round_periods_to_bf16
        # The one RoPE precision: coordinates, angles, sin and cos in it, and attention rotates q and k in the
        # dtype of these tables. bf16 also computes the fresh periods in bf16.
        self.bf16 = dtype == "bf16"
        # Whether training draws random coordinate changes (then each block gets its own draw).
        self.augments = any(v is not None for v in (shift_coords, jitter_coords, rescale_coords))
        # Persistent: released checkpoints carry their own (bf16-rounded) periods, which must win.
        self.register_buffer("periods", torch.empty(head_dim // 4, dtype=torch.float32), persistent=True)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        # Periods stay fp32 through model.to(dtype): casting would round a checkpoint's exact periods.
        periods = self.periods
        super()._apply(fn, recurse)
        moved = self.periods
        self.periods = moved.float() if periods.is_meta else periods.to(moved.device)
        return self

    def reset_parameters(self) -> None:
        if self.bf16:  # base ** (2i / (head_dim / 2)), computed in bf16
            steps = 2 * torch.arange(self.head_dim // 4, dtype=torch.bfloat16) / (self.head_dim // 2)
            self.periods.copy_(self.base**steps)
            return
        exponents = torch.arange(self.head_dim // 4, dtype=torch.float32) * 4 / self.head_dim
        periods = self.base**exponents
        self.periods.copy_(bf16_rounded(periods) if self.round_periods_to_bf16 else periods)

    def _augment(self, coords: torch.Tensor) -> torch.Tensor:
        # Tensors are made from `coords` and `periods` is used whole, never indexed: under FX these stay
        # graph nodes, where a draw or a slice of a buffer would be computed once at trace time and frozen.
        # One draw per call, shared by every image of the batch (`coords` [..., 2]).
        if self.training:
            if self.shift_coords is not None:
                coords = coords + coords.new_empty(2).uniform_(-self.shift_coords, self.shift_coords)
            if self.jitter_coords is not None:
                log_j = math.log(self.jitter_coords)
                coords = coords * coords.new_empty(2).uniform_(-log_j, log_j).exp()
            if self.rescale_coords is not None:
                log_r = math.log(self.rescale_coords)
                coords = coords * coords.new_empty(1).uniform_(-log_r, log_r).exp()
        return coords

    def forward(self, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(signed sin, cos), each [num_prefix_tokens + height * width, head_dim], in `table_dtype`.

        Prefix tokens get the identity rotation (sin 0, cos 1), so attention rotates all tokens at once.
        The sin's first half is negated: `rotate_half(x) * sin == x.roll(half) * signed_sin`, one kernel less.
        """
        return self.from_coords(self.grid_coords(height, width))

    def grid_coords(self, height: int, width: int) -> torch.Tensor:
        """One grid's patch centres `[height * width, 2]`, in `table_dtype`, for `from_coords`."""
        return patch_centre_coords(height, width, self.normalize_coords, self._periods())

    @property
    def table_dtype(self) -> torch.dtype:
        """What coordinates, angles, sin and cos are computed in."""
        return torch.bfloat16 if self.bf16 else torch.float32

    def _periods(self) -> torch.Tensor:
        return self.periods.to(torch.bfloat16) if self.bf16 else self.periods.float()

    def from_coords(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s (sin, cos) for patch centres `coords` [..., tokens, 2] (y, x) normalised to [-1, 1]:
        one image's grid, or a NaFlex batch's [batch, tokens, 2] with each image's own grid."""
        periods = self._periods()
        # 2 pi times in fp32, then rounded: what torch computes for bf16 (its scalar unrounded), where an exported
        # graph would multiply by 2 pi rounded to bf16.
        turns = (self._augment(coords.to(periods.dtype))[..., None].float() * (2 * math.pi)).to(periods.dtype)
        angles = turns / periods
        angles = angles.flatten(-2)
        # The prefix rows are padded on after sin and cos, not concatenated before: TorchScript's autodiff
        # leaves a list of tensors unguarded, and under inference_mode would save them for backward.
        prefix = (0, 0, self.num_prefix_tokens, 0)
        # torch computes a bf16 sine in fp32 and rounds it, so this is the same; ONNX has no bf16 Sin or Cos.
        wide = angles.float()
        sin, cos = wide.sin().to(angles.dtype), wide.cos().to(angles.dtype)
        sin, cos = F.pad(sin, prefix), F.pad(cos, prefix, value=1.0)
        return torch.cat([-sin, sin], dim=-1), torch.cat([cos, cos], dim=-1)


def _swapped_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    if torch.jit.is_scripting():
        # A flip of the two halves, not a cat of them: TorchScript's autodiff leaves a cat's list of tensors
        # unguarded, so a scripted model that has trained would save them for backward under inference_mode.
        return x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    # One cat: `roll` would first copy a strided `x` (a slice of qkv) whole.
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotates the last dim of `x` in the dtype of the tables, then casts back to `x`'s dtype.

    `rope` is `RopeEmbedding`'s (signed sin, cos), broadcastable to `x`. With fp32 tables `x` is rotated
    as if upcast, whatever its dtype; with bf16 tables every product and the sum are rounded to bf16. `x` is
    never copied up: mixed products compute in the tables' dtype with the values of an upcast copy, and
    autograd keeps `x` itself for backward.
    """
    signed_sin, cos = rope
    dtype = x.dtype
    if torch.promote_types(dtype, cos.dtype) != cos.dtype:
        x = x.to(cos.dtype)  # tables narrower than `x`: rotated in theirs
    return (x * cos).add_(_swapped_halves(x) * signed_sin).to(dtype)


def apply_rope_into(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`apply_rope` for `x` narrower than the tables, without autograd, written back into `x` (which may be
    a view of qkv: a rotated copy of q and k would be the forward's largest temporary).

    One upcast copy of `x` on a CPU, where each mixed-dtype product would make its own; the two sine terms are
    added in place (`addcmul_`), so no swapped copy exists. A fused multiply-add may round once where
    `apply_rope` rounds twice: after rounding to `x`'s dtype the value is `apply_rope`'s or one unit off.
    Eager on a CPU, a batch is rotated one image at a time: the fp32 temporaries of one image's q and k, where
    those of the whole batch would be allocated and touched afresh at every block (twice as slow at ViT-B's
    four images).
    """
    captured = torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling()
    if captured or x.device.type != "cpu" or x.shape[0] == 1:  # a captured graph: one rotation, any batch
        return _rotate_into(x, rope)
    per_image = rope[0].dim() == x.dim()  # a NaFlex batch's tables, one grid per image
    for i, image in enumerate(x.unbind(0)):
        _rotate_into(image, (rope[0][i], rope[1][i]) if per_image else rope)
    return x


def _rotate_into(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    signed_sin, cos = rope
    half = x.shape[-1] // 2
    wide = x.to(cos.dtype) if x.device.type == "cpu" else x
    rotated = wide * cos
    rotated[..., :half].addcmul_(wide[..., half:], signed_sin[..., :half])
    rotated[..., half:].addcmul_(wide[..., :half], signed_sin[..., half:])
    return x.copy_(rotated)
