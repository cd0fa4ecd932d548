"""What every benchmark shares: the three models with one set of weights, round-robin timing, peak memory.

Timing: the models take turns within each round (the order rotating from round to round), so drift on a
shared machine hits all of them alike, and each round's time ratio is taken before the median. Memory:
the peak above what was allocated before the call, from CUDA's allocator on a GPU and from the process's
anonymous resident memory (RssAnon in /proc/self/status, sampled every millisecond, after glibc hands its
free memory back) on a CPU, since mapped file pages are reclaimable.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from datetime import date

import timm
import torch
import transformers
from timm.layers import SwiGLU
from timm.models.eva import checkpoint_filter_fn as eva_filter
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from transformers import DINOv3ViTConfig, DINOv3ViTModel

import timm_layerscale
from timm_layerscale.checkpoints.formats.base import hidden_features
from timm_layerscale.checkpoints.formats.hf import HF as HF_FORMAT
from timm_layerscale.checkpoints.formats.hf import transformers_config
from timm_layerscale.checkpoints.formats.timm import TIMM
from timm_ls.cpu import cpu_model

logging.getLogger("timm_layerscale").setLevel(logging.ERROR)  # random weights trip the untrained-gamma warning

OURS, EVA, HF = "timm-layerscale", "timm eva", "transformers"
# variant: (eva model name, embed dim, heads, MLP hidden width)
SHAPES = {
    "small": ("vit_small_patch16_dinov3_qkvb", 384, 6, 1536),
    "base": ("vit_base_patch16_dinov3_qkvb", 768, 12, 3072),
    "large": ("vit_large_patch16_dinov3_qkvb", 1024, 16, 4096),
}


def build_models(variant: str, **ours_kwargs) -> dict[str, nn.Module]:
    """The three models in train mode, carrying the same random weights.

    transformers' model draws them (LayerScale at 1, so every branch counts), ours loads that file through
    its own converter, and eva loads ours (Meta's layout) through timm's converter. The anchors compute RoPE
    periods in fp32 without Meta's bf16 rounding, so ours does too.
    """
    eva_name, dim, heads, hidden = SHAPES[variant]
    torch.manual_seed(0)
    config = DINOv3ViTConfig(
        hidden_size=dim,
        num_attention_heads=heads,
        intermediate_size=hidden,
        num_hidden_layers=12 if variant != "large" else 24,
        num_register_tokens=4,
    )
    hf = DINOv3ViTModel(config)
    ours = timm.create_model(f"vit_ls_{variant}_patch16_dinov3", rope_periods_bf16=False, **ours_kwargs)
    ours.load_state_dict(hf.state_dict())
    eva = timm.create_model(eva_name, global_pool="token")
    eva.load_state_dict(eva_filter(ours.state_dict(), eva))
    return {OURS: ours, EVA: eva, HF: hf}


def features(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The normed CLS token: each model's pooled output without a classifier."""
    return model(pixel_values=x).pooler_output if name == HF else model(x)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
clock = CLOCKS["wall"]


def add_machine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="'process' counts only the CPU time this process gets: use it with --threads 1 on a shared CPU",
    )


def apply_machine_args(args: argparse.Namespace) -> None:
    global clock
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]


def round_robin(
    calls: dict[str, Callable[[], object]],
    rounds: int,
    device: torch.device,
    warmup: int = 2,
    timer: Callable[[Callable[[], object]], float] | None = None,
    go_on: Callable[[int, dict[str, list[float]]], bool] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call for each name, one call of each per round; each round starts one name later.

    `timer` times one call (default: `clock` around it, then a synchronize); `go_on(round, times)` may
    end the rounds early."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    synchronize(device)
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        if go_on is not None and not go_on(r, times):
            break
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if timer is not None:
                times[name].append(timer(calls[name]))
                continue
            start = clock()
            calls[name]()
            synchronize(device)
            times[name].append(clock() - start)
    return times


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000


def ratio_stats(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios."""
    ratios = sorted(a / b for a, b in zip(numerator, denominator))
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return median, q1, q3


def rss_anon_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_memory_mib(call: Callable[[], object], device: torch.device) -> float:
    """Peak memory of one call above what was allocated before it."""
    synchronize(device)
    if device.type == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand cached free memory back, so reuse cannot hide the peak
    before, peak, done = rss_anon_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon_mib())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        call()
    finally:
        done.set()
        sampler.join()
    return max(peak[0], rss_anon_mib()) - before


def profile_top(call: Callable[[], object], device: torch.device, rows: int = 12) -> str:
    """torch.profiler's top operators by self time for one call, to put beside a figure that misses."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        call()
        synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=50)


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, {torch.cuda.device_count()} device(s)"
    return f"{cpu_model()}, {torch.get_num_threads()} torch threads"


def header(what: str) -> str:
    timer = "process CPU time" if clock is time.process_time else "wall time"
    return (
        f"{what}\n{date.today().isoformat()}; {machine()}; {timer}\n"
        f"torch {torch.__version__}, timm {timm.__version__}, transformers {transformers.__version__}, "
        f"timm-layerscale {timm_layerscale.__version__}"
    )


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows[1:]])


# ------------------------------------------------------------------- one set of weights in every model

# variant: (eva's fastest eager form, eva's layout of the Hub files)
EVA_FORMS = {
    "small": ("vit_small_patch16_dinov3", "vit_small_patch16_dinov3_qkvb"),
    "base": ("vit_base_patch16_dinov3", "vit_base_patch16_dinov3_qkvb"),
    "large": ("vit_large_patch16_dinov3", "vit_large_patch16_dinov3_qkvb"),
    "huge_plus": ("vit_huge_plus_patch16_dinov3", "vit_huge_plus_patch16_dinov3_qkvb"),
}


def ours_name(variant: str) -> str:
    return f"vit_ls_{variant}_patch16_dinov3"


@torch.no_grad()
def randomise_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter off its init (gammas of both signs, biases and norms away from 0 and 1), qkv biases
    zero as in the released files; linear weights at unit gain so no branch vanishes."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def draw(p: torch.Tensor, kind: str = "normal") -> torch.Tensor:
        t = torch.empty(p.shape, device=p.device, dtype=p.dtype)
        return t.normal_(generator=generator) if kind == "normal" else t.uniform_(0.5, 1.5, generator=generator)

    for name, p in model.named_parameters():
        if name.endswith("qkv.bias"):
            p.zero_()
        elif name.endswith("gamma"):
            p.copy_(draw(p, "uniform") * draw(p).sign())
        elif name.endswith("bias"):
            p.copy_(draw(p) * 0.2)
        elif p.ndim == 1:
            p.copy_(draw(p, "uniform"))
        elif p.ndim == 2:
            p.copy_(draw(p) / math.sqrt(p.shape[1]))
        else:
            p.copy_(draw(p) * 0.5)
    return model


def build_trio(variant: str, device: torch.device, overrides: dict) -> dict[str, nn.Module]:
    """Ours, eva and transformers in fp32 on `device`, eval mode, with one set of weights."""
    with torch.device(device):
        ours = timm.create_model(ours_name(variant), num_classes=0, rope_periods_bf16=False, **overrides)
        randomise_(ours)
        native = ours.state_dict()
        eva = timm.create_model(EVA_FORMS[variant][0], global_pool="token", num_classes=0, **overrides)
        eva_state, _ = TIMM.table.from_native(native, qkv_bias=False, dim=ours.embed_dim)
        load_exact(eva, dict(eva_state.items()))
        fields = transformers_config(ours.config, k_bias=False, dtype=torch.float32)
        config = DINOv3ViTConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
        config._attn_implementation = "sdpa"
        hf = DINOv3ViTModel(config)
        hf_state, _ = HF_FORMAT.table.from_native(native, k_bias=False, dim=ours.embed_dim)
        load_exact(hf, dict(hf_state.items()))
    return {OURS: ours.eval(), EVA: eva.eval(), HF: hf.eval()}


def load_exact(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every parameter from `state` (whichever block prefix this transformers version uses in memory);
    only buffers the model computes itself (RoPE tables) may be missing."""
    own = model.state_dict()
    state = {k if k in own or f"model.{k}" not in own else f"model.{k}": v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters())
    missing = [k for k in result.missing_keys if k in params]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"{type(model).__name__}: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]} (of "
            f"{len(missing)} and {len(result.unexpected_keys)})"
        )


def build_plain(ours: nn.Module, size: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A plain timm ViT of ours' width, depth and MLP: learned position embedding, no RoPE or storage."""
    cfg = ours.config
    hidden = hidden_features(cfg)
    swiglu = cfg.ffn_layer == "swiglu"
    with torch.device(device):
        model = VisionTransformer(
            img_size=size,
            patch_size=cfg.patch_size,
            embed_dim=cfg.embed_dim,
            depth=cfg.depth,
            num_heads=cfg.num_heads,
            mlp_ratio=(hidden + 0.5) / cfg.embed_dim,  # int() of it gives `hidden` back
            qkv_bias=True,
            global_pool="token",
            num_classes=0,
            mlp_layer=SwiGLU if swiglu else timm.layers.Mlp,
            act_layer=nn.SiLU if swiglu else nn.GELU,
        )
    return model.to(dtype).eval()


def nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# --------------------------------------------------------------------------------------------- timing


def timed(call: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call: CUDA events on a GPU (then a synchronize), the wall clock on a CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1000
