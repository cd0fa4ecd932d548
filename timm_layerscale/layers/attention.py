from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import nn

from ..layer_options import LayerOption, register_option
from .rope import apply_rope, apply_rope_into


# One call in every FX graph (torch.fx.wrap for any tracer, timm's list for timm's): the path depends on the
# dtypes and on autograd, and it writes into views in place.
@torch.fx.wrap
@register_notrace_function
def rotate_heads(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on heads `[batch, tokens, heads, head_dim]`: q's and k's heads side by side, or either alone.

    `rope` is one grid's `[tokens, head_dim]` pair, or a NaFlex batch's `[batch, tokens, head_dim]` (one
    grid per image). Heads are rotated in the tables' dtype (`apply_rope`); heads narrower than the tables
    are rotated in place when there is no autograd and no compiler (`apply_rope_into`), one unit off at most.
    Heads of the tables' dtype are not: out of place, the attention branch stays below the MLP's peak, and a
    hook on qkv keeps what qkv computed.
    """
    sin, cos = rope
    rope = (sin.unsqueeze(-2), cos.unsqueeze(-2))
    narrower = x.dtype != cos.dtype and torch.promote_types(x.dtype, cos.dtype) == cos.dtype
    # A compiler fuses the out-of-place rotation into one kernel; writing into a view of qkv would make it
    # copy qkv whole (functionalisation) and run slower than eager.
    if narrower and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return apply_rope_into(x, rope)
    return apply_rope(x, rope)


def qkv_sizes(out_features: int, dim: int) -> list[int]:
    """The q, k and v rows of a fused qkv projection from `dim` channels: `dim`, then two equal k/v parts
    (smaller than `dim` under grouped-query attention)."""
    kv = (out_features - dim) // 2
    return [dim, kv, kv]


def split_qkv(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """A fused qkv weight or bias as its q, k and v rows (`dim`: the model's width)."""
    return t.split(qkv_sizes(t.shape[0], dim))


def k_bias_mask(out_features: int, dim: int | None = None) -> torch.Tensor:
    """A fresh qkv bias mask: ones, with the k rows zero (a k bias is never added unless a checkpoint's mask
    loads it)."""
    mask = torch.ones(out_features)
    q, k, _ = qkv_sizes(out_features, out_features // 3 if dim is None else dim)
    mask[q : q + k] = 0.0
    return mask


def _mask_like(bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mask in the bias's dtype, on its device, and a DTensor like it where the bias is one (FSDP2 shards
    parameters, not buffers: every rank holds the whole mask)."""
    mask = mask.to(device=bias.device, dtype=bias.dtype)
    mesh = getattr(bias, "device_mesh", None)
    if mesh is None or hasattr(mask, "device_mesh"):
        return mask
    # Imported here: only a DTensor reaches this line, and torch builds without distributed have no module.
    from torch.distributed.tensor import Replicate

    return type(bias).from_local(mask, mesh, [Replicate()] * mesh.ndim, run_check=False)


def effective_qkv_bias(bias: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """What the forward adds: the qkv bias times its (loaded) mask, or the bias itself without one."""
    return bias if mask is None else bias * _mask_like(bias, mask)


def fold_bias_mask_(linear: nn.Linear) -> nn.Linear:
    """Multiplies the bias of a qkv linear by its `bias_mask` in place: the bias is then what the forward adds.

    The mask is ones and zeros, so folding is exact in any dtype and folding twice changes nothing."""
    if linear.bias is not None:
        with torch.no_grad():
            linear.bias.mul_(_mask_like(linear.bias, linear.bias_mask))
    return linear


def reset_bias_mask(linear: nn.Linear) -> None:
    """A fresh mask on a qkv linear (k rows zero, `k_bias_mask`), folded into its bias."""
    with torch.no_grad():
        linear.bias_mask.copy_(k_bias_mask(linear.out_features, linear.in_features))
    fold_bias_mask_(linear)


def _fold_on_load(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """`load_state_dict`'s pre-hook: the loaded bias becomes bias * mask (the loaded mask, else the module's).

    A new tensor in load_state_dict's own copy of the dict: the caller's tensors, which `assign=True` would
    make the module's (a file's pages, a conversion's plan), are never written to."""
    bias = state_dict.get(prefix + "bias")
    mask = state_dict.get(prefix + "bias_mask", module.bias_mask)
    if bias is not None and bias.shape == mask.shape:  # else torch reports the mismatch as for any key
        state_dict[prefix + "bias"] = effective_qkv_bias(bias, mask.to(bias.device))


def k_masked_linear(in_features: int, out_features: int) -> nn.Linear:
    """The qkv projection with k-bias masking: a plain `nn.Linear` with a `bias_mask` buffer, its bias folded.

    The type is exactly `nn.Linear`, so whatever matches types (`quantize_dynamic`) treats it as every other
    linear. The bias holds bias * mask: fresh and after every `load_state_dict` (a pre-hook folds the file's
    raw bias by its mask), so the eval forward is the plain linear. The mask is kept as a buffer loaded from
    checkpoints: Meta's layout has it, fresh models zero the k rows, and the released files carry an
    all-zero mask. Training multiplies the bias by the mask again (`Attention`), so masked rows get no gradient.
    """
    linear = nn.Linear(in_features, out_features, bias=True)
    linear.register_buffer("bias_mask", torch.empty(out_features))
    reset_bias_mask(linear)
    # The hook the model's key conversion uses too: torch's public one is newer than the oldest torch supported.
    linear._register_load_state_dict_pre_hook(_fold_on_load, with_module=True)
    return linear


def has_bias_mask(module: nn.Module) -> bool:
    """Whether `module` is a qkv linear with k-bias masking (built by `k_masked_linear`)."""
    return isinstance(module, nn.Linear) and module.bias is not None and "bias_mask" in module._buffers


def fold_bias_masks_(model: nn.Module) -> nn.Module:
    """Folds every qkv `bias_mask` of `model` into its bias, in place, and returns `model`.

    Loading and fresh init fold already; call this after writing qkv biases by hand, so that the eval forward
    (the plain linear) adds the masked bias as training does."""
    for module in model.modules():
        if has_bias_mask(module):
            fold_bias_mask_(module)
    return model


class Attention(nn.Module):
    """Self-attention with one fused qkv projection (rows: q, then k and v of `num_kv_heads` heads each),
    optional per-head qk-norm, RoPE in the dtype of its tables, and k/v heads shared by groups of q heads."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        mask_k_bias: bool = True,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        num_kv_heads: int | None = None,
        qk_norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = dim // num_heads
        out = dim + 2 * self.num_kv_heads * self.head_dim
        if qkv_bias and mask_k_bias:
            self.qkv = k_masked_linear(dim, out)
        else:
            self.qkv = nn.Linear(dim, out, bias=qkv_bias)
        self.normed_qk = qk_norm is not None
        self.q_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
        self.k_norm = qk_norm(self.head_dim) if qk_norm is not None else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def _project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is folded (bias * mask) for the eval forward; training multiplies by the mask in the graph
        # too, so the masked rows get zero gradient and stay zero, as in Meta's LinearKMaskedBias. A qkv
        # replaced by another module (a quantized linear) is just called. `self.qkv` throughout, not a local:
        # TorchScript resolves a submodule's type and attributes only on the attribute itself.
        if self.training and isinstance(self.qkv, nn.Linear) and hasattr(self.qkv, "bias_mask"):
            bias = self.qkv.bias
            assert bias is not None
            return F.linear(x, self.qkv.weight, bias * self.qkv.bias_mask.to(bias.dtype))
        return self.qkv(x)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attn_mask`: None (every token attends to every token), or the keys each query may attend to,
        boolean `[batch, 1, 1, tokens]` (a NaFlex batch's padding is no key)."""
        batch, tokens, dim = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self._project_qkv(x).unflatten(-1, (heads + 2 * kv_heads, self.head_dim))
        # Slices, not `split`: views alike, and an exported graph gets Slice (a split of sizes is a sequence op
        # there until an optimiser folds it)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads], qkv[:, :, heads + kv_heads :]
        if self.normed_qk:  # per-head norms make q and k tensors of their own: rotated one by one
            q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = rotate_heads(q, rope), rotate_heads(k, rope)
        elif rope is not None:  # q's and k's heads side by side in qkv: rotated in one pass
            qk = rotate_heads(qkv[:, :, : heads + kv_heads], rope)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_heads != heads:
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        x = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop if self.training else 0.0
        )
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(batch, tokens, dim)))


# The attention's switches as checkpoint keys show them: a qk-norm has a q-norm weight (LayerNorm's or RMSNorm's).
register_option(LayerOption("qk_norm", True, Attention, signature=("blocks.0.attn.q_norm.weight",)))
register_option(LayerOption("qk_norm", False, Attention))
