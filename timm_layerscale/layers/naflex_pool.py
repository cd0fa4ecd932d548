"""Global pooling of a NaFlex batch: every pool type over each image's valid patch tokens only."""

import torch


def pool_valid_tokens(
    x: torch.Tensor, patch_valid: torch.Tensor, pool_type: str, num_prefix_tokens: int
) -> torch.Tensor:
    """`x` [B, prefix + N, C] pooled as timm's `global_pool_nlc` (and `cls_avg`: the CLS token and the patch
    mean) pools one image's tokens, with padding (`patch_valid` False) in no mean and no max."""
    if pool_type == "token":
        return x[:, 0]
    if not pool_type:
        return x
    patches = x[:, num_prefix_tokens:]
    padding = ~patch_valid.unsqueeze(-1)
    count = patch_valid.sum(dim=1, keepdim=True).clamp(min=1).to(x.dtype)
    mean = patches.masked_fill(padding, 0.0).sum(dim=1) / count
    if pool_type == "avg":
        return mean
    if pool_type == "cls_avg":
        return torch.cat([x[:, 0], mean], dim=-1)
    peak = patches.masked_fill(padding, float("-inf")).amax(dim=1)
    if pool_type == "max":
        return peak
    if pool_type == "avgmax":
        return 0.5 * (mean + peak)
    # Concatenated, not an f-string with !r: TorchScript compiles this function with the scripted forward_head.
    raise ValueError("global_pool: got '" + pool_type + "'; allowed: 'token', 'avg', 'avgmax', 'max', 'cls_avg' or ''")
