"""Checkpoint layouts in the wild, each mapped onto this package's native (Meta DINOv3) key names."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

StateDict = dict[str, torch.Tensor]


def detect_layout(keys: set[str]) -> str | None:
    if "reg_token" in keys or any(k.endswith((".gamma_1", ".gamma_2", ".attn.q_bias")) for k in keys):
        return "timm-eva"
    if any(k.startswith(("embeddings.", "layer.")) or ".layer_scale1." in k for k in keys):
        return "transformers"
    if "storage_tokens" in keys or any(re.match(r"blocks\.\d+\.(ls1\.gamma|attn\.qkv\.weight)$", k) for k in keys):
        return "meta"
    return None


def _rename(state_dict: StateDict, rules: list[tuple[str, str]]) -> StateDict:
    out = {}
    for key, value in state_dict.items():
        for pattern, repl in rules:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


def _fuse_qkv_weights(state_dict: StateDict, block_keys: Callable[[str], tuple[str, str, str]]) -> None:
    """Concatenates split q/k/v projections; a missing k bias is zero (DINOv3 never trains it)."""
    blocks = sorted({int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.attn\.q_proj\.", k))})
    for i in blocks:
        q, k, v = block_keys(f"blocks.{i}.attn")
        weight = torch.cat(
            [state_dict.pop(f"{q}.weight"), state_dict.pop(f"{k}.weight"), state_dict.pop(f"{v}.weight")]
        )
        state_dict[f"blocks.{i}.attn.qkv.weight"] = weight
        q_bias, k_bias, v_bias = (state_dict.pop(f"{name}.bias", None) for name in (q, k, v))
        if q_bias is not None or v_bias is not None:
            zeros = weight.new_zeros(weight.shape[0] // 3)
            parts = [b if b is not None else zeros for b in (q_bias, k_bias, v_bias)]
            state_dict[f"blocks.{i}.attn.qkv.bias"] = torch.cat(parts)


def from_transformers(state_dict: StateDict) -> StateDict:
    sd = _rename(
        state_dict,
        [
            (r"^model\.layer\.", "blocks."),
            (r"^layer\.", "blocks."),
            (r"^embeddings\.register_tokens$", "storage_tokens"),
            (r"^embeddings\.patch_embeddings\.", "patch_embed.proj."),
            (r"^embeddings\.", ""),
            (r"\.attention\.o_proj\.", ".attn.proj."),
            (r"\.attention\.", ".attn."),
            (r"\.layer_scale(\d)\.lambda1$", r".ls\1.gamma"),
        ],
    )
    if "mask_token" in sd:
        sd["mask_token"] = sd["mask_token"].reshape(1, -1)
    _fuse_qkv_weights(sd, lambda attn: (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"))
    gated = any(k.endswith(".mlp.gate_proj.weight") for k in sd)
    mlp_rules = (
        [
            (r"\.mlp\.gate_proj\.", ".mlp.w1."),
            (r"\.mlp\.up_proj\.", ".mlp.w2."),
            (r"\.mlp\.down_proj\.", ".mlp.w3."),
        ]
        if gated
        else [(r"\.mlp\.up_proj\.", ".mlp.fc1."), (r"\.mlp\.down_proj\.", ".mlp.fc2.")]
    )
    return _rename(sd, mlp_rules)


def from_timm_eva(state_dict: StateDict) -> StateDict:
    sd = _rename(
        state_dict,
        [
            (r"^reg_token$", "storage_tokens"),
            (r"\.gamma_(\d)$", r".ls\1.gamma"),
            (r"\.mlp\.fc1_g\.", ".mlp.w1."),
            (r"\.mlp\.fc1_x\.", ".mlp.w2."),
        ],
    )
    if any(k.endswith(".mlp.w1.weight") for k in sd):
        sd = _rename(sd, [(r"\.mlp\.fc2\.", ".mlp.w3.")])
    for key in [k for k in sd if k.endswith(".attn.q_bias")]:
        attn = key[: -len(".q_bias")]
        q_bias, v_bias = sd.pop(key), sd.pop(f"{attn}.v_bias")
        sd[f"{attn}.qkv.bias"] = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])
    return sd


CONVERTERS: dict[str, Callable[[StateDict], StateDict]] = {
    "meta": dict,
    "transformers": from_transformers,
    "timm-eva": from_timm_eva,
}
