"""Hub sources and publishing through the real huggingface_hub client, against the local stand-in for the Hub.

The client runs in this process with its endpoint, cache and token file pointed at the loopback server
and a temporary folder (what HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE set at import); one test sets the
variables themselves in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import huggingface_hub
import pytest
import timm
import torch
import yaml
from huggingface_hub import constants
from packaging.version import Version
from safetensors.torch import save_file
from support import REPO, TINY, assert_fp32_close, move_off_init_
from support.hub_server import LocalHub, hub_env, point_client_at
from timm.models import get_pretrained_cfg
from transformers import DINOv3ViTConfig, DINOv3ViTModel

from timm_layerscale import (
    HubError,
    VitLsConfig,
    fold_layer_scale,
    hub_weights,
    push_to_hub,
    register_variant,
    save_for_hub,
)
from timm_layerscale.config import TRAINING_SWITCHES
from timm_layerscale.variants import VARIANTS, ungated_tag

OFFICIAL = "facebook/dinov3-vits16-pretrain-lvd1689m"
OFFICIAL_7B_SAT = "facebook/dinov3-vit7b16-pretrain-sat493m"
UNGATED = "timm/vit_small_patch16_dinov3_qkvb.lvd1689m"
SHARDED = "someone/dinov3-small-sharded"
NO_WEIGHTS = "someone/no-weights"
MISSING_SHARD = "someone/dinov3-missing-shard"
TOKEN = "hf_has_access"
SMALL = "vit_ls_small_patch16_dinov3"
# transformers recomputes RoPE periods in fp32, unrounded; its files hold none.
FROM_TRANSFORMERS = dict(TINY, rope_periods_bf16=False)


@pytest.fixture(scope="module")
def reference() -> DINOv3ViTModel:
    """transformers' DINOv3ViTModel in the shape of the official repos, weights moved off their inits."""
    config = DINOv3ViTConfig(
        hidden_size=TINY["embed_dim"],
        num_attention_heads=TINY["num_heads"],
        num_hidden_layers=TINY["depth"],
        intermediate_size=TINY["embed_dim"] * 4,
        num_register_tokens=4,
        layerscale_value=1e-5,
    )
    torch.manual_seed(0)
    return move_off_init_(DINOv3ViTModel(config)).eval()


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory, reference: DINOv3ViTModel) -> Path:
    root = tmp_path_factory.mktemp("hub")
    reference.save_pretrained(root / OFFICIAL)  # config.json + one model.safetensors, as the Hub has them
    reference.save_pretrained(root / SHARDED, max_shard_size="150KB")  # an index and its shards
    reference.save_pretrained(root / MISSING_SHARD, max_shard_size="150KB")
    next(iter(sorted((root / MISSING_SHARD).glob("model-*.safetensors")))).unlink()
    (root / OFFICIAL_7B_SAT).mkdir(parents=True)
    (root / NO_WEIGHTS).mkdir(parents=True)
    (root / NO_WEIGHTS / "README.md").write_text("no weights here\n")
    torch.manual_seed(1)
    eva = move_off_init_(timm.create_model("vit_small_patch16_dinov3_qkvb", global_pool="token", **TINY))
    (root / UNGATED).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in eva.state_dict().items()}, root / UNGATED / "model.safetensors")
    return root


@pytest.fixture
def hub(hub_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    """The loopback Hub, with the client's endpoint, cache and token file set as HF_ENDPOINT/HF_HOME set them."""
    with LocalHub(hub_root, gated={OFFICIAL: {TOKEN}, OFFICIAL_7B_SAT: {TOKEN}}) as server:
        point_client_at(server, tmp_path / "hf_home", monkeypatch)
        yield server


def one_line_error(call: Callable[[], object]) -> str:
    """The message of the HubError `call` raises, checked to be one line and to come within 30 s."""
    start = time.monotonic()
    with pytest.raises(HubError) as caught:
        call()
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert "\n" not in message
    return message


def small(pretrained: bool = True, **kwargs) -> torch.nn.Module:
    return timm.create_model(f"{SMALL}.lvd1689m_facebook", pretrained=pretrained, **FROM_TRANSFORMERS, **kwargs).eval()


@torch.no_grad()
def assert_matches(model: torch.nn.Module, reference: DINOv3ViTModel, images: torch.Tensor) -> None:
    expected = reference(pixel_values=images).last_hidden_state
    assert_fp32_close(model.forward_features(images), expected)


# ------------------------------------------------------------------------------------------------ tags


def test_official_tags_name_the_gated_repos_with_the_ungated_tags_data_config() -> None:
    official = {
        f"{SMALL}.lvd1689m_facebook": "facebook/dinov3-vits16-pretrain-lvd1689m",
        "vit_ls_small_plus_patch16_dinov3.lvd1689m_facebook": "facebook/dinov3-vits16plus-pretrain-lvd1689m",
        "vit_ls_base_patch16_dinov3.lvd1689m_facebook": "facebook/dinov3-vitb16-pretrain-lvd1689m",
        "vit_ls_large_patch16_dinov3.lvd1689m_facebook": "facebook/dinov3-vitl16-pretrain-lvd1689m",
        "vit_ls_large_patch16_dinov3.sat493m_facebook": "facebook/dinov3-vitl16-pretrain-sat493m",
        "vit_ls_huge_plus_patch16_dinov3.lvd1689m_facebook": "facebook/dinov3-vith16plus-pretrain-lvd1689m",
        "vit_ls_7b_patch16_dinov3.lvd1689m_facebook": "facebook/dinov3-vit7b16-pretrain-lvd1689m",
        "vit_ls_7b_patch16_dinov3.sat493m_facebook": "facebook/dinov3-vit7b16-pretrain-sat493m",
    }
    names = {n for n in timm.list_pretrained("vit_ls_*") if n.endswith("_facebook")}
    assert names == set(official)
    sat_mean, sat_std = (0.430, 0.411, 0.296), (0.213, 0.156, 0.143)
    for name, repo in official.items():
        cfg, ungated = get_pretrained_cfg(name).to_dict(), get_pretrained_cfg(name.removesuffix("_facebook"))
        assert cfg["hf_hub_id"] == repo and ungated.hf_hub_id.startswith("timm/")
        assert {k: v for k, v in cfg.items() if k not in ("hf_hub_id", "tag")} == {
            k: v for k, v in ungated.to_dict().items() if k not in ("hf_hub_id", "tag")
        }
        assert (cfg["mean"], cfg["std"]) == ((sat_mean, sat_std) if "sat493m" in name else (cfg["mean"], cfg["std"]))
        assert name.split(".")[1].startswith("sat493m") == (cfg["mean"] == sat_mean)
    # the tag implies the same architecture as its ungated twin: SAT-493M ViT-L keeps local_cls_norm
    sat = timm.create_model("vit_ls_large_patch16_dinov3.sat493m_facebook", device="meta")
    assert sat.config.local_cls_norm
    # the default tag stays timm's ungated copy
    assert timm.create_model(SMALL, device="meta").pretrained_cfg["hf_hub_id"] == UNGATED


def test_list_and_readme_show_the_official_tags(capsys: pytest.CaptureFixture[str]) -> None:
    from timm_ls.main import main

    assert main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("vit_ls_large_patch16_dinov3 "))
    assert "  lvd1689m, sat493m, lvd1689m_facebook, sat493m_facebook  dinov3-license" in row
    assert main(["list", "--json"]) == 0
    tags = next(v["tags"] for v in json.loads(capsys.readouterr().out) if v["name"] == "vit_ls_large_patch16_dinov3")
    assert tags["lvd1689m_facebook"] == "facebook/dinov3-vitl16-pretrain-lvd1689m"
    assert tags["sat493m_facebook"] == "facebook/dinov3-vitl16-pretrain-sat493m"
    readme = (REPO / "README.md").read_text()
    assert "`lvd1689m`, `sat493m`, `lvd1689m_facebook`, `sat493m_facebook`" in readme


def test_a_fixed_size_model_keeps_the_weights_channels() -> None:
    # timm adapts the first conv to in_chans from the channel count the pretrained cfg gives the weights
    model = timm.create_model(SMALL, dynamic_img_size=False, in_chans=1, **TINY)
    assert model.pretrained_cfg["input_size"] == (3, 224, 224) and model.pretrained_cfg["fixed_input_size"]


# ------------------------------------------------------------------------------------------- sources


def test_official_tag_with_access_loads_converted(hub: LocalHub, reference, images, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model = small()
    assert_matches(model, reference, images)
    assert f"GET /{OFFICIAL}/resolve/main/model.safetensors" in hub.requests
    assert model.pretrained_cfg["hf_hub_id"] == OFFICIAL


def test_gated_repo_without_access_says_how_to_get_it(hub: LocalHub, monkeypatch) -> None:
    page = f"{hub.url}/{OFFICIAL}"
    anonymous = one_line_error(small)
    assert anonymous.startswith(f"{OFFICIAL} is a gated repository this machine has no access to (HTTP 401): ")
    assert f"accept its licence on {page} while logged in" in anonymous
    assert "`hf auth login` or set HF_TOKEN" in anonymous
    assert anonymous.endswith(f"or use {SMALL}.lvd1689m, which holds the same weights ungated")

    monkeypatch.setenv("HF_TOKEN", "hf_without_access")
    assert "(HTTP 403)" in one_line_error(small)
    cfg = get_pretrained_cfg("vit_ls_7b_patch16_dinov3.sat493m_facebook")
    ungated = ungated_tag(VARIANTS["vit_ls_7b_patch16_dinov3"], cfg.tag)  # the registry knows it, the Hub code not
    satellite = one_line_error(lambda: hub_weights(cfg, ungated=ungated))
    assert satellite.startswith(f"{OFFICIAL_7B_SAT} is a gated repository")
    assert satellite.endswith("or use vit_ls_7b_patch16_dinov3.sat493m, which holds the same weights ungated")
    assert "ungated" not in one_line_error(lambda: hub_weights(cfg))
    # a gated repo of one's own has no ungated twin to name
    assert "ungated" not in one_line_error(lambda: hub_weights(f"hf-hub:{OFFICIAL}"))


def test_sharded_repo_downloads_every_shard(hub: LocalHub, reference, images, tmp_path: Path) -> None:
    index = hub_weights(SHARDED)
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert index.name == "model.safetensors.index.json" and len(shards) >= 2
    assert all((index.parent / shard).is_file() for shard in shards)
    assert index.is_relative_to(constants.HF_HUB_CACHE)
    elsewhere = hub_weights(SHARDED, cache_dir=tmp_path / "elsewhere")
    assert elsewhere.is_relative_to(tmp_path / "elsewhere") and all((elsewhere.parent / s).is_file() for s in shards)
    model = timm.create_model(
        SMALL, pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id=SHARDED), **FROM_TRANSFORMERS
    ).eval()
    assert_matches(model, reference, images)


def test_missing_repo_file_or_revision_is_one_line(hub: LocalHub) -> None:
    assert one_line_error(lambda: hub_weights(NO_WEIGHTS)) == (
        f"{NO_WEIGHTS} has no model.safetensors or model.safetensors.index.json (HTTP 404): see its files on "
        f"{hub.url}/{NO_WEIGHTS}, or name another of its files with hf_hub_filename in a tag or pretrained_cfg_overlay"
    )
    named = one_line_error(lambda: hub_weights({"hf_hub_id": SHARDED, "hf_hub_filename": "weights.pth"}))
    assert named.startswith(f"{SHARDED} has no weights.pth (HTTP 404)")
    assert one_line_error(lambda: hub_weights("someone/not-there")).startswith(
        f"someone/not-there is not a repository on {hub.url}"
    )
    assert "has no revision 'v9'" in one_line_error(lambda: hub_weights(f"{SHARDED}@v9"))
    missing = one_line_error(lambda: hub_weights(MISSING_SHARD))
    assert missing.startswith(f"{MISSING_SHARD}'s model.safetensors.index.json names model-00001-of-0000")
    assert missing.endswith(".safetensors, which the repo does not have (HTTP 404)")
    # through timm.create_model too
    overlay = dict(hf_hub_id=NO_WEIGHTS)
    message = one_line_error(lambda: timm.create_model(SMALL, pretrained=True, pretrained_cfg_overlay=overlay, **TINY))
    assert message.startswith(f"{NO_WEIGHTS} has no model.safetensors")


def test_cut_download_is_resumed_or_removed_never_used(hub: LocalHub, reference, images, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)  # progress is kept chunk by chunk
    size = (hub.root / OFFICIAL / "model.safetensors").stat().st_size
    key, url = f"{OFFICIAL}/model.safetensors", f"/{OFFICIAL}/resolve/main/model.safetensors"
    hub.cut[key] = size // 2
    message = one_line_error(small)  # every GET stops halfway: the retries run out
    assert message.startswith(f"the download of model.safetensors from {OFFICIAL} was cut short (RemoteProtocolError: ")
    assert message.endswith(
        "also on huggingface_hub's resumed retries; the partial file was removed, not loaded: try again"
    )
    assert hub.ranges and all(r.startswith(f"{url} bytes=") for r in hub.ranges)
    assert not list(Path(constants.HF_HUB_CACHE).rglob("*.incomplete"))
    assert huggingface_hub.try_to_load_from_cache(OFFICIAL, "model.safetensors") is None  # nothing to load

    hub.cut_once.add(key)  # one GET stops halfway: the retry asks for the rest only
    hub.ranges.clear()
    assert_matches(small(), reference, images)
    (resumed,) = hub.ranges
    start = int(resumed.removeprefix(f"{url} bytes=").removesuffix("-"))
    assert 0 < start <= size // 2
    assert not list(Path(constants.HF_HUB_CACHE).rglob("*.incomplete"))


def test_server_errors_fall_back_to_the_cache(hub: LocalHub, reference, images) -> None:
    index = hub_weights(SHARDED)
    hub.broken.update({SHARDED, UNGATED})
    assert hub_weights(SHARDED) == index
    sharded = timm.create_model(
        SMALL, pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id=SHARDED), **FROM_TRANSFORMERS
    ).eval()
    assert_matches(sharded, reference, images)
    assert one_line_error(lambda: hub_weights(UNGATED)) == (
        f"the Hub ({hub.url}) answered HTTP 500, and the weights of {UNGATED} (model.safetensors or "
        f"model.safetensors.index.json) are not in the local cache {constants.HF_HUB_CACHE}; try again later, "
        f"or pass pretrained_cfg_overlay=dict(file=PATH)"
    )


def test_offline_uses_the_cache_or_says_it_is_empty(
    hub: LocalHub, reference, images, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for source in (OFFICIAL, SHARDED):
        message = one_line_error(lambda: hub_weights(source))  # noqa: B023
        assert message == (
            f"HF_HUB_OFFLINE is set, and the weights of {source} (model.safetensors or "
            f"model.safetensors.index.json) are not in the local cache {constants.HF_HUB_CACHE}; download them "
            f"once with the Hub reachable (HF_HUB_OFFLINE unset), or pass pretrained_cfg_overlay=dict(file=PATH)"
        )
    assert f"not in the local cache {tmp_path / 'elsewhere'};" in one_line_error(
        lambda: hub_weights(OFFICIAL, cache_dir=tmp_path / "elsewhere")
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    small()
    hub_weights(SHARDED)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_TOKEN")
    count = len(hub.requests)
    assert_matches(small(), reference, images)
    sharded = timm.create_model(
        SMALL, pretrained=True, pretrained_cfg_overlay=dict(hf_hub_id=SHARDED), **FROM_TRANSFORMERS
    ).eval()
    assert_matches(sharded, reference, images)
    assert len(hub.requests) == count  # nothing asked of the Hub


def test_unreachable_hub_with_nothing_cached(hub: LocalHub, monkeypatch) -> None:
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}"
    )
    message = one_line_error(lambda: hub_weights(UNGATED))
    assert message.startswith("the Hub (http://127.0.0.1:9) is not reachable: ")
    assert f"and the weights of {UNGATED} (model.safetensors or model.safetensors.index.json) are not in" in message


OFFLINE_LOAD = """
import time, timm
start = time.monotonic()
try:
    timm.create_model("vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True, depth=2)
except Exception as exc:
    print(f"{time.monotonic() - start:.1f} {type(exc).__name__}: {exc}")
"""


def test_offline_environment_variable_in_a_fresh_interpreter(hub_root: Path, tmp_path: Path) -> None:
    with LocalHub(hub_root) as server:
        env = {**hub_env(server, tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
        result = subprocess.run(
            [sys.executable, "-c", OFFLINE_LOAD], env=env, capture_output=True, text=True, timeout=300
        )
    assert not server.requests
    seconds, message = result.stdout.strip().split(" ", 1)
    assert float(seconds) < 30
    assert message.startswith(f"HubError: HF_HUB_OFFLINE is set, and the weights of {UNGATED} (model.safetensors")


def test_cli_names_a_gated_repo_in_one_line(hub: LocalHub, capsys: pytest.CaptureFixture[str]) -> None:
    from timm_ls.main import main

    args = ["--variant", f"{SMALL}.lvd1689m_facebook", "--pretrained", "--model-kwargs", "depth=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"timm-ls: error: {OFFICIAL} is a gated repository") and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------- publishing


def published(model: torch.nn.Module, repo_id: str) -> torch.nn.Module:
    push_to_hub(model, repo_id)
    return timm.create_model(f"hf-hub:{repo_id}", pretrained=True).eval()


@torch.no_grad()
def test_push_to_hub_then_hf_hub_rebuilds_the_same_model(hub: LocalHub, images) -> None:
    torch.manual_seed(0)
    init = {"attn": 1e-5, "mlp": 1e-6}
    model = move_off_init_(timm.create_model(SMALL, init_values=init, num_classes=7, **TINY)).eval()
    again = published(model, "someone/small-ls")
    assert type(again) is type(model) and again.config == model.config
    assert again.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(again(images), model(images))

    with torch.no_grad():  # a second push to the same repo is a new commit
        model.head.bias.add_(1.0)
    assert torch.equal(published(model, "someone/small-ls")(images), model(images))

    repo = hub.root / "someone/small-ls"
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((repo / "config.json").read_text())
    assert config["architecture"] == SMALL
    # every argument, for any timm, but the switches that act once on the model being fine-tuned
    assert set(config["model_args"]) == set(VitLsConfig.field_names()) - set(TRAINING_SWITCHES)
    assert config["model_args"]["init_values"] == init
    card = (repo / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: timm\n")
    assert "license_name: dinov3-license" in card and "DINOv3 License" in card
    assert "- on 4 of 4 branches; init values 1e-06, 1e-05" in card
    assert "- gammas |mean| from " in card
    assert 'timm.create_model("hf-hub:someone/small-ls", pretrained=True)' in card


@torch.no_grad()
def test_a_folded_model_rebuilds_without_layer_scale(hub: LocalHub, images) -> None:
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(SMALL, **TINY)).eval()
    expected = model(images)
    fold_layer_scale(model)
    again = published(model, "someone/small-folded")
    assert not any("gamma" in k for k in again.state_dict())
    assert all(v is None for pair in again.config.layer_init_values for v in pair)
    assert_fp32_close(again(images), expected)
    card = (hub.root / "someone/small-folded/README.md").read_text()
    assert "- on 0 of 4 branches; off" in card
    assert "- no gammas (LayerScale off or folded into the projections)" in card


@torch.no_grad()
def test_own_yaml_variant_publishes_as_its_registered_base(hub: LocalHub, images, tmp_path: Path) -> None:
    name = register_variant({"base": SMALL, "model": {"depth": 3, "init_values": "auto"}}, "my_hub_vit_ls_deep")
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(name, embed_dim=64, num_heads=4)).eval()
    again = published(model, "someone/deep")
    config = json.loads((hub.root / "someone/deep/config.json").read_text())
    assert config["architecture"] == SMALL and config["model_args"]["depth"] == 3
    assert again.config == model.config
    assert torch.equal(again(images), model(images))


@torch.no_grad()
def test_hf_hub_repo_with_sharded_weights(hub: LocalHub, images, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = move_off_init_(timm.create_model(SMALL, **TINY)).eval()
    folder = save_for_hub(model, tmp_path / "saved")
    repo = hub.root / "someone/small-sharded"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text((folder / "config.json").read_text())
    huggingface_hub.save_torch_state_dict(model.state_dict(), repo, max_shard_size="100KB")
    assert not (repo / "model.safetensors").exists() and (repo / "model.safetensors.index.json").is_file()
    again = timm.create_model("hf-hub:someone/small-sharded", pretrained=True).eval()
    assert torch.equal(again(images), model(images))
    # as in timm, an hf-hub: name's own weights come before a file in the overlay
    other = tmp_path / "other.safetensors"
    save_file({k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}, other)
    overlay = dict(file=str(other))
    hub_first = timm.create_model("hf-hub:someone/small-sharded", pretrained=True, pretrained_cfg_overlay=overlay)
    assert torch.equal(hub_first.eval()(images), model(images))


def test_save_for_hub_writes_the_folder_once(tmp_path: Path) -> None:
    model = timm.create_model(SMALL, **TINY)
    folder = save_for_hub(model, tmp_path / "out")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert "# vit_ls_small_patch16_dinov3" in (folder / "README.md").read_text()
    with pytest.raises(HubError.__mro__[1], match="exists; pass overwrite=True"):
        save_for_hub(model, folder)
    save_for_hub(model, folder, overwrite=True, repo_id="someone/x")
    assert "# someone/x" in (folder / "README.md").read_text()
    again = timm.create_model(f"local-dir:{folder}", pretrained=True)
    assert again.config == model.config


# ------------------------------------------------------------------- publishing with timm's own helpers

# timm 1.0.31 records create_model's arguments and its save_for_hf / push_to_hf_hub write them as model_args.
RECORDS_MODEL_ARGS = Version(timm.__version__) >= Version("1.0.31")
needs_recorded_args = pytest.mark.skipif(
    not RECORDS_MODEL_ARGS, reason=f"timm {timm.__version__} records no model args for save_for_hf (1.0.31 does)"
)
OWN_YAML = {"base": SMALL, "model": {"depth": 3, "init_values": "auto", "rope_normalize_coords": "max"}}

FRESH_LOAD = """
import sys, timm, torch
import timm_layerscale  # the shipped variants only, as the start-up hook registers them where installed
name, yaml_name, out, threads = sys.argv[1:]
torch.set_num_threads(int(threads))  # the parent's: the same matmul splits, so outputs compare bit for bit
model = timm.create_model(name, pretrained=True).eval()
x = torch.randn(2, 3, 48, 80, generator=torch.Generator().manual_seed(1))  # conftest's images
with torch.no_grad():
    found = dict(state=model.state_dict(), out=model(x), yaml_known=timm.is_model(yaml_name))
torch.save(found, out)
"""


def own_yaml_model(tmp_path: Path, name: str) -> torch.nn.Module:
    """A model of a user's YAML file (depth, LayerScale and RoPE settings its base does not have)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(OWN_YAML))
    assert register_variant(path) == name
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(name, embed_dim=64, num_heads=4, num_classes=5)).eval()


def rebuilt_in_fresh_process(source: str, yaml_name: str, tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / "fresh.pt"
    args = [sys.executable, "-c", FRESH_LOAD, source, yaml_name, str(out), str(torch.get_num_threads())]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return torch.load(out, weights_only=True)


def assert_rebuilt(found: dict, model: torch.nn.Module, images: torch.Tensor) -> None:
    assert not found["yaml_known"]  # the fresh process never saw the YAML
    state = model.state_dict()
    assert found["state"].keys() == state.keys()
    assert all(torch.equal(found["state"][k], v) for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(found["out"], model(images))


@needs_recorded_args
@pytest.mark.parametrize("safe_serialization", [False, True])
def test_timms_save_for_hf_of_an_own_yaml_variant_rebuilds_without_the_yaml(tmp_path, images, safe_serialization):
    name = f"my_timm_saved_vit_ls_{int(safe_serialization)}"
    model = own_yaml_model(tmp_path, name)
    timm.models.save_for_hf(model, tmp_path / "saved", safe_serialization=safe_serialization)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architecture"] == SMALL
    args = config["model_args"]
    assert (args["depth"], args["init_values"], args["rope_normalize_coords"]) == (3, "auto", "max")
    assert (args["embed_dim"], args["num_heads"], args["num_classes"]) == (64, 4, 5)
    assert_rebuilt(rebuilt_in_fresh_process(f"local-dir:{tmp_path / 'saved'}", name, tmp_path), model, images)


@needs_recorded_args
def test_timms_push_to_hf_hub_of_an_own_yaml_variant_rebuilds_from_hf_hub(hub: LocalHub, tmp_path, images):
    name = "my_timm_pushed_vit_ls"
    model = own_yaml_model(tmp_path, name)
    timm.models.push_to_hf_hub(model, "someone/timm-pushed")
    assert json.loads((hub.root / "someone/timm-pushed/config.json").read_text())["architecture"] == SMALL
    env = hub_env(hub, tmp_path / "fresh_hf_home")
    assert_rebuilt(rebuilt_in_fresh_process("hf-hub:someone/timm-pushed", name, tmp_path, env), model, images)


@pytest.mark.skipif(
    RECORDS_MODEL_ARGS, reason=f"timm {timm.__version__} records model args; this test is of timms before 1.0.31"
)
def test_older_timms_save_for_hf_keeps_the_yaml_name(tmp_path):
    model = own_yaml_model(tmp_path, "my_old_timm_saved_vit_ls")
    timm.models.save_for_hf(model, tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architecture"] == "my_old_timm_saved_vit_ls" and "model_args" not in config
    save_for_hub(model, tmp_path / "ours")  # this package's own helper rebuilds it with any timm
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architecture"] == SMALL
