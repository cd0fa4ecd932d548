"""A Hub that cannot be asked: one question at most, then the cached file or one line, for every entry point.

Two unreachable Hubs: a loopback port nothing listens on (refused at once) and a loopback server that accepts
connections and never answers (`BlackHoleHub`, which counts them). The work is bounded by counting: the
connections the black hole saw, and the requests still waiting once the call is over. huggingface_hub's own
timeouts are made an hour long, so that a wait ended by anything but this package's short timeout outlasts
the guard timeouts; those guards stop a hanging test and are not the measure.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import PIL.Image
import pytest
import timm
import torch
from huggingface_hub import constants
from safetensors.torch import save_file
from support import move_off_init_
from support.hub_server import BlackHoleHub, LocalHub, closed_port_url, hub_env, point_client_at

from timm_layerscale import HubError, fetch_hub_weights
from timm_layerscale.hub import HUB_TIMEOUT_VARIABLE
from timm_ls.main import main

HUB_ID = "timm/vit_small_patch16_dinov3_qkvb.lvd1689m"  # the hf_hub_id of vit_ls_small_patch16_dinov3.lvd1689m
WEIGHTS = "model.safetensors"
SHARDED = "someone/sharded"
SHORT_S = "0.5"  # the test's TIMM_LAYERSCALE_HUB_TIMEOUT, to keep the tests fast
HOUR = "3600"  # huggingface_hub's own timeouts: a wait only they would end outlasts every guard
GUARD_S = 60  # against a hanging test; never the measure
MAIN_JOB = ["--pretrained", "--no-plot", "--model-kwargs", "depth=2", "rope_periods_bf16=False"]
INSPECT = ["inspect", "vit_ls_small_patch16_dinov3", "--pretrained"]
# create_model in a fresh interpreter: its error as one line, then every request it left running waited for,
# so that a retry (a second connection) or a wait without the short timeout shows.
CREATE_MODEL = f"""
import threading, timm, timm_layerscale
before = set(threading.enumerate())
try:
    timm.create_model("vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True, depth=2)
    print("loaded")
except Exception as exc:
    print(f"{{type(exc).__name__}}: {{exc}}")
left = [t for t in threading.enumerate() if t not in before]
for thread in left:
    thread.join({GUARD_S // 2})  # within the guard of the run, so that a request left waiting is counted
print(f"requests still waiting: {{sum(t.is_alive() for t in left)}}")
"""


@pytest.fixture(params=["closed port", "black hole"])
def unreachable(request: pytest.FixtureRequest) -> Iterator[BlackHoleHub | SimpleNamespace]:
    """An unreachable Hub: `.url`, and `.connections` (always 0 for the closed port)."""
    if request.param == "closed port":
        yield SimpleNamespace(url=closed_port_url(), connections=0)
        return
    with BlackHoleHub() as hole:
        yield hole


def unreachable_env(hub: BlackHoleHub | SimpleNamespace, home: Path) -> dict[str, str]:
    env = hub_env(hub, home)
    env.update(HF_HUB_ETAG_TIMEOUT=HOUR, HF_HUB_DOWNLOAD_TIMEOUT=HOUR, **{HUB_TIMEOUT_VARIABLE: SHORT_S})
    return env


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=GUARD_S)


def not_reachable(url: str, hole: bool) -> str:
    """How the line names the unreachable Hub: the refused connection, or the short timeout."""
    if hole:
        return f"{url}: TimeoutError: no answer within {SHORT_S} s ({HUB_TIMEOUT_VARIABLE} sets how long to wait)"
    return f"{url}: ConnectionRefusedError: "


# ----------------------------------------------------------------------------------------- nothing cached


def test_create_model_says_so_in_one_line(unreachable, tmp_path: Path) -> None:
    result = run([sys.executable, "-c", CREATE_MODEL], unreachable_env(unreachable, tmp_path / "hf_home"))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    line, waiting = result.stdout.splitlines()
    hole = isinstance(unreachable, BlackHoleHub)
    assert line.startswith(f"HubError: the Hub ({unreachable.url}) is not reachable: ")
    assert (f"TimeoutError: no answer within {SHORT_S} s" if hole else "Connection refused, and the weights") in line
    assert line.endswith(
        f"not in the local cache {tmp_path / 'hf_home' / 'hub'}; check the connection, or download "
        "them once where the Hub is reachable, or pass pretrained_cfg_overlay=dict(file=PATH)"
    )
    assert waiting == "requests still waiting: 0"  # the request's own timeout was the short one
    assert unreachable.connections == int(hole)  # one question, no retry, no second file name asked for


def test_main_job_warns_in_one_line_and_uses_random_weights(unreachable, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "timm_ls", *MAIN_JOB]
    result = run(cli, unreachable_env(unreachable, tmp_path / "hf_home"))
    assert result.returncode == 0, result.stderr
    hole = isinstance(unreachable, BlackHoleHub)
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"timm-ls: warning: --pretrained: the Hub is not reachable ({not_reachable(unreachable.url, hole)}"
    )
    assert line.endswith(f") and {HUB_ID} is not in the local cache; using random weights instead")
    assert "weights: random init, because the Hub is not reachable (see the warning above)" in result.stdout
    assert unreachable.connections == int(hole)


def test_inspect_fails_in_one_line(unreachable, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "timm_ls", *INSPECT]
    result = run(cli, unreachable_env(unreachable, tmp_path / "hf_home"))
    hole = isinstance(unreachable, BlackHoleHub)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"timm-ls: error: --pretrained: the Hub is not reachable ({not_reachable(unreachable.url, hole)}"
    )
    assert line.endswith(
        f") and {HUB_ID} is not in the local cache; pass the downloaded file instead: timm-ls inspect FILE"
    )
    assert unreachable.connections == int(hole)


def test_features_fails_in_one_line_and_writes_nothing(unreachable, tmp_path: Path) -> None:
    """Pictures of an untrained model would pass for the pretrained one's: only the main job falls back."""
    image = tmp_path / "a.png"
    PIL.Image.new("RGB", (64, 48), (200, 30, 90)).save(image)
    out = tmp_path / "pca"
    cli = [sys.executable, "-m", "timm_ls", "features", str(image), "--model", INSPECT[1], "--pretrained"]
    result = run([*cli, "--out", str(out), "--model-kwargs", "depth=2"], unreachable_env(unreachable, tmp_path / "h"))
    hole = isinstance(unreachable, BlackHoleHub)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"timm-ls: error: --pretrained: the Hub is not reachable ({not_reachable(unreachable.url, hole)}"
    )
    assert line.endswith(
        f") and {HUB_ID} is not in the local cache; pass the downloaded file instead with --checkpoint FILE"
    )
    assert not out.exists() and "random" not in result.stdout
    assert unreachable.connections == int(hole)


# ---------------------------------------------------------------------------------------------- cached


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose cache holds HUB_ID's weights (eva DINOv3 at depth 2), downloaded by the real client."""
    root = tmp_path_factory.mktemp("hub")
    eva = move_off_init_(timm.create_model("vit_small_patch16_dinov3_qkvb", depth=2, global_pool="token"))
    (root / HUB_ID).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in eva.state_dict().items()}, root / HUB_ID / WEIGHTS)
    home = tmp_path_factory.mktemp("hf_home")
    with LocalHub(root) as hub:
        huggingface_hub.hf_hub_download(HUB_ID, WEIGHTS, cache_dir=home / "hub", endpoint=hub.url)
    return home


def short_timeout_client(monkeypatch: pytest.MonkeyPatch, url: str, hf_home: Path) -> None:
    """This process's huggingface_hub talking only to `url`, with its cache under `hf_home`; the short timeout."""
    point_client_at(SimpleNamespace(url=url), hf_home, monkeypatch)
    monkeypatch.setenv(HUB_TIMEOUT_VARIABLE, SHORT_S)


def test_cached_weights_load_from_every_entry_point(unreachable, cached: Path, monkeypatch, capsys) -> None:
    short_timeout_client(monkeypatch, unreachable.url, cached)
    hole = isinstance(unreachable, BlackHoleHub)
    from_cache = f"Hub {HUB_ID} from the local cache (the Hub is not reachable: {not_reachable(unreachable.url, hole)}"
    weights = fetch_hub_weights(HUB_ID)
    assert weights.origin.startswith(from_cache) and weights.path.is_relative_to(cached)
    assert unreachable.connections == int(hole)

    model = timm.create_model("vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True, depth=2)
    assert model.blocks[0].ls1.gamma.abs().min() >= 0.5  # the file's gammas, moved off the 1e-5 init
    assert unreachable.connections == 2 * int(hole)

    assert main(MAIN_JOB) == 0
    out = capsys.readouterr().out
    assert f"weights: {from_cache}" in out and "LayerScale gammas: " in out
    assert main(INSPECT) == 0
    assert f"weights: {from_cache}" in capsys.readouterr().out
    assert unreachable.connections == 4 * int(hole)  # one question per load, no retry


def test_offline_asks_nothing(cached: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    with BlackHoleHub() as hole:
        short_timeout_client(monkeypatch, hole.url, cached)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        offline = f"Hub {HUB_ID} from the local cache (the Hub is not reachable: HF_HUB_OFFLINE is set)"
        assert fetch_hub_weights(HUB_ID).origin == offline
        timm.create_model("vit_ls_small_patch16_dinov3.lvd1689m", pretrained=True, depth=2)
        assert main(INSPECT) == 0 and f"weights: {offline} (" in capsys.readouterr().out
        with pytest.raises(HubError, match=r"^HF_HUB_OFFLINE is set, and the weights of ") as caught:
            fetch_hub_weights(HUB_ID, cache_dir=tmp_path / "empty")
        assert caught.value.unreachable == "HF_HUB_OFFLINE is set"
    assert hole.connections == 0


def test_a_reachable_hub_still_revalidates_the_cached_file(tmp_path: Path, monkeypatch) -> None:
    """A cached file is taken offline only when the Hub cannot be asked: a new revision on the Hub is fetched."""
    root = tmp_path / "root"
    (root / HUB_ID).mkdir(parents=True)
    save_file({"x": torch.ones(4)}, root / HUB_ID / WEIGHTS)
    with LocalHub(root) as hub:
        short_timeout_client(monkeypatch, hub.url, tmp_path / "hf_home")
        first = fetch_hub_weights(HUB_ID)
        save_file({"x": torch.zeros(8)}, root / HUB_ID / WEIGHTS)  # a new commit
        second = fetch_hub_weights(HUB_ID)
    assert first.origin == second.origin == f"Hub {HUB_ID}"
    assert first.path != second.path and second.path.stat().st_size != first.path.stat().st_size
    assert sum(r.startswith("GET ") for r in hub.requests) == 2


# --------------------------------------------------------------------------- what the short timeout covers


def test_a_stalled_name_lookup_is_cut_short_too(cached: Path, tmp_path: Path, monkeypatch) -> None:
    """No transport timeout reaches the name lookup (getaddrinfo), which stalls without a network."""
    released, original = threading.Event(), socket.getaddrinfo

    def stalled_lookup(host, *args, **kwargs):
        if host != "hub.invalid":
            return original(host, *args, **kwargs)
        released.wait(GUARD_S)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", stalled_lookup)
    short_timeout_client(monkeypatch, "http://hub.invalid", cached)
    found, failed = (
        within_guard(lambda d=cache_dir: fetch_hub_weights(HUB_ID, cache_dir=d))
        for cache_dir in (cached / "hub", tmp_path / "empty")
    )
    released.set()
    assert found.origin.startswith(f"Hub {HUB_ID} from the local cache (the Hub is not reachable: http://hub.invalid: ")
    assert isinstance(failed, HubError) and "TimeoutError: no answer within 0.5 s" in failed.unreachable


def within_guard(call: Callable[[], object]) -> object:
    """What `call` returns or the HubError it raises, run in a thread waited for GUARD_S (against a hang only)."""
    outcome: list[object] = []

    def attempt() -> None:
        try:
            outcome.append(call())
        except HubError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(GUARD_S)
    assert outcome, f"still waiting after the {GUARD_S} s guard"
    return outcome[0]


def test_a_shard_missing_from_the_cache_is_one_line_at_once(tmp_path: Path, monkeypatch) -> None:
    """A sharded repo's cached index with a shard missing (a download cut off): the Hub is not asked again."""
    torch.manual_seed(0)
    (tmp_path / "root" / SHARDED).mkdir(parents=True)
    state = {f"w{i}": torch.randn(64, 64) for i in range(4)}
    huggingface_hub.save_torch_state_dict(state, tmp_path / "root" / SHARDED, max_shard_size="40KB")
    with LocalHub(tmp_path / "root") as hub:
        short_timeout_client(monkeypatch, hub.url, tmp_path / "hf_home")
        index = fetch_hub_weights(SHARDED).path
    (*_, last) = sorted(index.parent.glob("model-*.safetensors"))
    last.unlink()
    with BlackHoleHub() as hole:
        short_timeout_client(monkeypatch, hole.url, tmp_path / "hf_home")
        failed = within_guard(lambda: fetch_hub_weights(SHARDED))
    assert isinstance(failed, HubError) and str(failed).startswith(
        f"the Hub ({hole.url}) is not reachable: TimeoutError: no answer within {SHORT_S} s "
        f"({HUB_TIMEOUT_VARIABLE} sets how long to wait), and the weights of {SHARDED} ({last.name}) are not in the "
        f"local cache"
    )
    assert hole.connections == 1


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf"])
def test_a_bad_timeout_setting_is_one_line(value: str, cached: Path, monkeypatch) -> None:
    short_timeout_client(monkeypatch, closed_port_url(), cached)
    monkeypatch.setenv(HUB_TIMEOUT_VARIABLE, value)
    with pytest.raises(HubError) as caught:
        fetch_hub_weights(HUB_ID)
    assert str(caught.value) == (
        f"{HUB_TIMEOUT_VARIABLE}={value!r} is not a number of seconds above 0: set it to how long to wait for the "
        f"Hub (e.g. 10), or unset it for 3"
    )
