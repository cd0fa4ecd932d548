"""Hub loading through the real huggingface_hub client, against a local stand-in for the Hub."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from support import assert_fp32_close
from support.hub_server import LocalHub, hub_env, point_client_at
from timm.models.eva import Eva

import timm_layerscale  # noqa: F401  (registers the variants)

HUB_ID = "timm/vit_small_patch16_dinov3_qkvb.lvd1689m"
TINY = ["depth=2", "rope_periods_bf16=False"]  # timm's eva keeps its RoPE periods unrounded
LOAD_AND_RUN = """
import sys
import timm, timm_layerscale, torch
from safetensors.torch import load_file, save_file

model = timm.create_model(
    "vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True, depth=2, rope_periods_bf16=False
).eval()
x = load_file(sys.argv[1])["x"]
with torch.no_grad():
    tokens = model.forward_features(x)
    pooled = model.forward_head(tokens, pre_logits=True)
save_file({"tokens": tokens.contiguous(), "pooled": pooled.contiguous()}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Eva]:
    """A Hub holding timm's own eva DINOv3 weights, with gammas and q/v biases far from their init."""
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    eva = timm.create_model("vit_small_patch16_dinov3_qkvb", depth=2, global_pool="token").eval()
    with torch.no_grad():
        for name, param in eva.named_parameters():
            if name.endswith(("gamma_1", "gamma_2")):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("q_bias", "v_bias")):
                param.normal_(0.0, 0.5)
    (root / HUB_ID).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in eva.state_dict().items()}, root / HUB_ID / "model.safetensors")
    return root, eva


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def test_pretrained_eva_weights_from_the_hub_match_timm_eva(hub_root: tuple[Path, Eva], tmp_path: Path) -> None:
    root, eva = hub_root
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    save_file({"x": x}, tmp_path / "x.safetensors")
    with LocalHub(root) as hub:
        args = [sys.executable, "-c", LOAD_AND_RUN, str(tmp_path / "x.safetensors"), str(tmp_path / "out.safetensors")]
        result = run(args, hub_env(hub, tmp_path / "hf_home"))
    assert result.returncode == 0, result.stderr
    assert f"GET /{HUB_ID}/resolve/main/model.safetensors" in hub.requests
    out = load_file(tmp_path / "out.safetensors")
    with torch.no_grad():
        tokens = eva.forward_features(x)
        pooled = eva.forward_head(tokens, pre_logits=True)
    assert out["tokens"].shape == tokens.shape == (2, 1 + 4 + 4 * 6, 384)
    assert_fp32_close(out["tokens"], tokens)
    assert_fp32_close(out["pooled"], pooled)


def test_cli_pretrained_names_the_hub_id_then_uses_the_cache_offline(
    hub_root: tuple[Path, Eva], tmp_path: Path
) -> None:
    root, eva = hub_root
    cli = [sys.executable, "-m", "timm_ls", "--pretrained", "--no-plot", "--model-kwargs", *TINY]
    gamma = eva.blocks[0].gamma_1.detach().abs()
    median = gamma.sort().values[191:193].mean()
    expected_row = ["0", f"{gamma.mean():.3g}", f"{median:.3g}", f"{gamma.max():.3g}", "0%"]
    with LocalHub(root) as hub:
        env = hub_env(hub, tmp_path / "hf_home")
        online = run(cli, env)
    assert online.returncode == 0, online.stderr
    assert f"weights: Hub {HUB_ID}\n" in online.stdout
    assert "  loaded a checkpoint with timm eva keys\n" in online.stdout
    assert online.stdout.count("LayerScale: kept 4 gammas from the checkpoint") == 1  # reported once
    assert online.stdout.split("LayerScale gammas: ")[1].splitlines()[2].split()[:5] == expected_row

    offline = run(cli, {**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert (
        f"weights: Hub {HUB_ID} from the local cache (the Hub is not reachable: HF_HUB_OFFLINE is set)"
        in offline.stdout
    )
    assert offline.stdout.split("LayerScale gammas: ")[1].splitlines()[2].split()[:5] == expected_row


def test_cli_pretrained_without_a_hub_falls_back_to_random_init(tmp_path: Path) -> None:
    env = hub_env(SimpleNamespace(url="http://127.0.0.1:9"), tmp_path / "hf_home")
    env.update(HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    cli = [sys.executable, "-m", "timm_ls", "--pretrained", "--no-plot", "--model-kwargs", "depth=2"]
    result = run(cli, env)
    assert result.returncode == 0, result.stderr
    # The fallback is a warning on stderr; stdout says which weights the table shows.
    assert result.stderr.startswith("timm-ls: warning: --pretrained: the Hub is not reachable (http://127.0.0.1:9: "), (
        result.stderr
    )
    assert "using random weights instead" in result.stderr and result.stderr.count("\n") == 1
    assert "weights: random init, because the Hub is not reachable (see the warning above)" in result.stdout
    assert "LayerScale gammas: " in result.stdout
    # That this takes no retry loop is timed in process (test_hub_sources.py), free of start-up time under load.


def test_inspect_pretrained_reads_the_hub_file_then_the_cache(hub_root: tuple[Path, Eva], tmp_path: Path) -> None:
    root, eva = hub_root
    cli = [sys.executable, "-m", "timm_ls", "inspect", "vit_ls_small_patch16_dinov3.lvd1689m"]
    with LocalHub(root) as hub:
        env = hub_env(hub, tmp_path / "hf_home")
        online = run([*cli, "--pretrained", "--json"], env)
    assert online.returncode == 0, online.stderr
    result = json.loads(online.stdout)
    assert result["weights"].startswith(f"Hub {HUB_ID} (") and result["spellings"] == ["gamma_N"]
    for i, block in enumerate(eva.blocks):
        for branch, gamma in (("attn", block.gamma_1), ("mlp", block.gamma_2)):
            assert result["blocks"][i][branch]["mean"] == pytest.approx(gamma.detach().abs().mean().item(), rel=1e-6)
            assert result["blocks"][i][branch]["max"] == pytest.approx(gamma.detach().abs().max().item(), rel=1e-6)
    offline = run([*cli, "--pretrained", "--json"], {**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert json.loads(offline.stdout)["blocks"] == result["blocks"]
    nowhere = hub_env(SimpleNamespace(url="http://127.0.0.1:9"), tmp_path / "empty_home")
    nowhere.update(HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    failed = run([*cli, "--pretrained"], nowhere)
    assert failed.returncode == 2 and failed.stdout == ""
    assert failed.stderr.startswith("timm-ls: error: --pretrained: the Hub is not reachable (http://127.0.0.1:9")
    assert "is not in the local cache; pass the downloaded file instead" in failed.stderr


def test_cli_pretrained_asks_the_hub_once(hub_root: tuple[Path, Eva], tmp_path: Path) -> None:
    """The command learns where the weights came from from the loader's own requests, and adds none."""
    root, _ = hub_root
    loader = [sys.executable, "-c", "import sys, timm_layerscale as t; print(t.fetch_hub_weights(sys.argv[1]).origin)"]
    cli = [sys.executable, "-m", "timm_ls", "--pretrained", "--no-plot", "--model-kwargs", *TINY]

    def weights_requests(args: list[str], home: Path) -> tuple[list[str], subprocess.CompletedProcess]:
        with LocalHub(root) as hub:
            result = run(args, hub_env(hub, home))
        return [r.split()[0] for r in hub.requests if r.split("?")[0].endswith("/model.safetensors")], result

    alone, fetched = weights_requests([*loader, HUB_ID], tmp_path / "alone")
    assert fetched.returncode == 0, fetched.stderr
    assert fetched.stdout == f"Hub {HUB_ID}\n"
    through_cli, result = weights_requests(cli, tmp_path / "cli")
    assert result.returncode == 0, result.stderr
    assert f"weights: Hub {HUB_ID}\n" in result.stdout
    assert through_cli == alone and alone.count("GET") == 1, (through_cli, alone)


def test_pretrained_weights_download_into_the_cache_dir_given(hub_root: tuple[Path, Eva], tmp_path: Path, monkeypatch):
    """`create_model(..., pretrained=True, cache_dir=...)` reaches the Hub download: the weights land there and
    not in the Hub's own cache."""
    root, eva = hub_root
    with LocalHub(root) as hub:
        point_client_at(hub, tmp_path / "hf_home", monkeypatch)
        model = timm.create_model(
            "vit_ls_small_patch16_dinov3.lvd1689m",
            pretrained=True,
            cache_dir=tmp_path / "elsewhere",
            depth=2,
            rope_periods_bf16=False,
        )
    assert f"GET /{HUB_ID}/resolve/main/model.safetensors" in hub.requests
    repo = "models--" + HUB_ID.replace("/", "--")
    assert [p.name for p in (tmp_path / "elsewhere" / repo / "snapshots").glob("*/*")] == ["model.safetensors"]
    assert not (tmp_path / "hf_home" / "hub" / repo).exists()
    assert torch.equal(model.blocks[0].ls1.gamma, eva.blocks[0].gamma_1)


def test_inspect_pretrained_reads_a_timm_models_hub_file(tmp_path: Path) -> None:
    """timm's own LayerScale models (DeiT-III, CaiT) come through the same Hub path as the variants."""
    name = "deit3_small_patch16_224.fb_in22k_ft_in1k"
    hub_id = timm.models.get_pretrained_cfg(name).hf_hub_id
    torch.manual_seed(0)
    deit = timm.create_model(name.partition(".")[0], depth=2, embed_dim=64, num_heads=4)
    gammas = {k: v.uniform_(0.5, 1.5) for k, v in deit.state_dict().items() if k.endswith(".gamma")}
    (tmp_path / "hub" / hub_id).mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in deit.state_dict().items()}, tmp_path / "hub" / hub_id / "model.safetensors"
    )
    with LocalHub(tmp_path / "hub") as hub:
        result = run(
            [sys.executable, "-m", "timm_ls", "inspect", name, "--pretrained", "--json"],
            hub_env(hub, tmp_path / "hf_home"),
        )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["weights"].startswith(f"Hub {hub_id} (") and found["spellings"] == ["lsN.gamma"]
    assert [b["attn"]["mean"] for b in found["blocks"]] == pytest.approx(
        [gammas[f"blocks.{i}.ls1.gamma"].abs().mean().item() for i in range(2)], rel=1e-6
    )
