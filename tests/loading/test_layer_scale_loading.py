"""LayerScale gammas are never silently wrong: folded, set to 1 or kept, always reported once."""

import logging

import pytest
import timm
import torch
from safetensors.torch import save_file
from support import TINY, assert_fp32_close, max_diff, move_off_init_
from timm.models import load_checkpoint

from timm_layerscale import CheckpointError, fold_layer_scale
from timm_layerscale.checkpoints import log_report
from timm_layerscale.checkpoints.mapping.fit import ReportLine
from timm_ls.main import main

NAME = "vit_ls_small_patch16_dinov3"


def source(name=NAME, **kwargs):
    torch.manual_seed(0)
    return move_off_init_(timm.create_model(name, **{**TINY, **kwargs})).eval()


def layer_scale_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "timm_layerscale" and "LayerScale:" in r.getMessage()]


def load_both_ways(path, **kwargs):
    """timm's pretrained path (filter + hook) and load_checkpoint (hook only), in that order."""
    by_file = timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY, **kwargs)
    by_checkpoint = timm.create_model(NAME, **TINY, **kwargs)
    load_checkpoint(by_checkpoint, str(path))
    return by_file.eval(), by_checkpoint.eval()


@pytest.mark.parametrize("ffn", ["mlp", "swiglu"])
@torch.no_grad()
def test_gammas_fold_into_a_model_without_layer_scale(ffn, tmp_path, images, ls_log):
    kwargs = {"ffn_layer": ffn}
    src = source(**kwargs)
    save_file(src.state_dict(), tmp_path / "with_gammas.safetensors")
    for model in load_both_ways(tmp_path / "with_gammas.safetensors", init_values=0, **kwargs):
        assert not any(k.endswith("gamma") for k in model.state_dict())
        assert_fp32_close(model.forward_features(images), src.forward_features(images))
    lines = layer_scale_lines(ls_log)
    assert len(lines) == 2 and all("folded 4 gammas" in line for line in lines)  # once per load
    assert all(r.levelno == logging.WARNING for r in ls_log.records if "folded 4 gammas" in r.getMessage())
    assert all(r.levelno == logging.INFO for r in ls_log.records if r.getMessage().startswith("loaded a checkpoint"))


def test_a_report_line_is_logged_at_its_cause_level_whatever_its_words(ls_log):
    """The level comes with the line from what made it: an information line that says "set " or "folded" is
    not a warning, a warning's `WARNING: ` prefix is not logged, and a caller's own plain line is information."""
    log_report(
        [
            ReportLine("dropped the optimizer's state set aside (folded into nothing)"),
            ReportLine("WARNING: gammas look untrained", logging.WARNING, "gammas look untrained"),
            "a caller's own line",
        ]
    )
    assert [(r.levelno, r.getMessage()) for r in ls_log.records] == [
        (logging.INFO, "dropped the optimizer's state set aside (folded into nothing)"),
        (logging.WARNING, "gammas look untrained"),
        (logging.INFO, "a caller's own line"),
    ]


@torch.no_grad()
def test_folding_from_a_foreign_layout(tmp_path, images):
    eva = move_off_init_(timm.create_model("vit_small_patch16_dinov3_qkvb", global_pool="token", **TINY)).eval()
    torch.save(eva.state_dict(), tmp_path / "eva.pth")
    model = timm.create_model(NAME, **TINY, init_values="off", rope_periods_bf16=False).eval()
    load_checkpoint(model, str(tmp_path / "eva.pth"))
    assert_fp32_close(model.forward_features(images), eva.forward_features(images))


@torch.no_grad()
def test_public_fold_layer_scale_keeps_outputs(images):
    model = source(init_values=[{"attn": 1e-5, "mlp": "off"}, 0.1])
    before = model.forward_features(images)
    fold_layer_scale(model)
    assert not any(k.endswith("gamma") for k in model.state_dict())
    assert_fp32_close(model.forward_features(images), before)
    assert model.config.layer_init_values == [(None, None)] * 2


@torch.no_grad()
def test_missing_gammas_become_one(tmp_path, images, ls_log):
    src = source(init_values=0)
    save_file(src.state_dict(), tmp_path / "no_gammas.safetensors")
    for model in load_both_ways(tmp_path / "no_gammas.safetensors"):
        gammas = [v for k, v in model.state_dict().items() if k.endswith("gamma")]
        assert len(gammas) == 4 and all(torch.equal(g, torch.ones(64)) for g in gammas)
        assert max_diff(model.forward_features(images), src.forward_features(images)) == 0
    lines = layer_scale_lines(ls_log)
    assert len(lines) == 2 and all("set 4 gammas to 1" in line for line in lines)
    assert all(r.levelno == logging.WARNING for r in ls_log.records if "set 4 gammas" in r.getMessage())


def test_missing_gammas_fail_under_strict_layer_scale(tmp_path):
    save_file(source(init_values=0).state_dict(), tmp_path / "no_gammas.safetensors")
    expected = r"no LayerScale gammas \(blocks.0.ls1.gamma and 3 more\).*init_values=0"
    with pytest.raises(CheckpointError, match=expected):
        load_both_ways(tmp_path / "no_gammas.safetensors", strict_layer_scale=True)


@torch.no_grad()
def test_kept_gammas_are_reported_once_per_load(tmp_path, ls_log):
    src = source()
    save_file(src.state_dict(), tmp_path / "ok.safetensors")
    for model in load_both_ways(tmp_path / "ok.safetensors"):
        assert all(torch.equal(v, src.state_dict()[k]) for k, v in model.state_dict().items() if k.endswith("gamma"))
    assert layer_scale_lines(ls_log) == ["LayerScale: kept 4 gammas from the checkpoint"] * 2
    assert not [r for r in ls_log.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (float("nan"), "NaN or Inf in blocks 1.mlp"),
        (float("inf"), "NaN or Inf in blocks 1.mlp"),
        (1e-5, "equal an init value in blocks 1.mlp: the checkpoint looks saved before training"),
    ],
)
def test_suspicious_gammas_are_warned_about(value, expected, tmp_path, ls_log):
    state = source().state_dict()
    state["blocks.1.ls2.gamma"] = torch.full((64,), value)
    save_file(state, tmp_path / "odd.safetensors")
    timm.create_model(
        NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "odd.safetensors")), **TINY
    )
    warnings = [r.getMessage() for r in ls_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and expected in warnings[0]


def test_an_untrained_model_is_flagged_for_every_block(tmp_path, ls_log):
    torch.save(timm.create_model(NAME, **TINY).state_dict(), tmp_path / "fresh.pth")
    load_checkpoint(timm.create_model(NAME, **TINY), str(tmp_path / "fresh.pth"))
    warnings = [r.getMessage() for r in ls_log.records if r.levelno == logging.WARNING]
    assert warnings == [
        "LayerScale gammas equal an init value in all 4 branches: the checkpoint looks saved before training"
    ]


@pytest.mark.parametrize(
    ("untrained", "expected"),
    [
        (range(64), "in all 64 branches"),
        (range(5), "in blocks 0.attn, 0.mlp, 1.attn, 1.mlp, 2.attn:"),
        (range(6), "in blocks 0.attn, 0.mlp, 1.attn, 1.mlp and 2 more (6 of 64 branches):"),
    ],
)
def test_warnings_about_many_branches_stay_one_short_line(untrained, expected, tmp_path, ls_log):
    """A 32-block model: the warning names the branches, or says `all 64`, or the first few and a count."""
    model = timm.create_model(NAME, **{**TINY, "depth": 32})
    state = model.state_dict()
    trained = torch.linspace(0.5, 1.5, 64)
    for i, key in enumerate(k for k in state if k.endswith("gamma")):
        state[key] = state[key] if i in untrained else trained.clone()
    save_file(state, tmp_path / "deep.safetensors")
    load_checkpoint(model, str(tmp_path / "deep.safetensors"))
    warnings = [r.getMessage() for r in ls_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and expected in warnings[0], warnings
    assert len(warnings[0]) < 160


def test_gamma_that_cannot_fold_names_key_and_setting(tmp_path):
    state = source().state_dict()
    state["blocks.1.ls2.gamma"] = torch.ones(32)  # does not match mlp.fc2's 64 output rows
    save_file(state, tmp_path / "odd.safetensors")
    with pytest.raises(CheckpointError, match=r"cannot fold LayerScale blocks.1.ls2.gamma \[32\].*init_values="):
        load_both_ways(tmp_path / "odd.safetensors", init_values=0)


def test_reinit_restarts_each_gamma_at_its_own_init_on_pretrained_loads_only(tmp_path, ls_log):
    state = source().state_dict()  # gammas far from any init
    save_file(state, tmp_path / "pretrained.safetensors")
    per_block = [{"attn": 1e-4, "mlp": 1e-6}, {"attn": "off", "mlp": 0.1}]
    by_file, by_checkpoint = load_both_ways(
        tmp_path / "pretrained.safetensors", init_values=per_block, reinit_layer_scale=True
    )
    found = {k: v for k, v in by_file.state_dict().items() if k.endswith("gamma")}
    expected = {"blocks.0.ls1.gamma": 1e-4, "blocks.0.ls2.gamma": 1e-6, "blocks.1.ls2.gamma": 0.1}
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[k], torch.full((64,), v)) for k, v in expected.items())
    fold = state["blocks.1.ls1.gamma"][:, None] * state["blocks.1.attn.proj.weight"]
    assert torch.allclose(by_file.blocks[1].attn.proj.weight, fold)  # no LayerScale there: still folded
    assert all(torch.equal(v, state[k]) for k, v in by_checkpoint.state_dict().items() if k.endswith("gamma"))
    assert layer_scale_lines(ls_log) == [
        "LayerScale: re-initialised 3 gammas to init_values (reinit_layer_scale=True); folded 1 gammas into the "
        "projections before them (the model has LayerScale off; outputs are unchanged)",
        "LayerScale: kept 3 gammas from the checkpoint; folded 1 gammas into the projections before them (the "
        "model has LayerScale off; outputs are unchanged)",
    ]


def test_reinit_needs_no_gammas_in_the_checkpoint(tmp_path, ls_log):
    save_file(source(init_values=0).state_dict(), tmp_path / "no_gammas.safetensors")
    model = timm.create_model(
        NAME,
        pretrained=True,
        pretrained_cfg_overlay=dict(file=str(tmp_path / "no_gammas.safetensors")),
        reinit_layer_scale=True,
        strict_layer_scale=True,  # refuses gammas of 1, not gammas the model starts afresh
        **TINY,
    )
    assert all(torch.equal(v, torch.full((64,), 1e-5)) for k, v in model.state_dict().items() if k.endswith("gamma"))
    warnings = [r.getMessage() for r in ls_log.records if r.levelno >= logging.WARNING]
    assert warnings == ["LayerScale: re-initialised 4 gammas to init_values (reinit_layer_scale=True)"]


def test_convert_says_a_warning_once(tmp_path, capsys):
    """The command prints the fit's warnings on stderr, once; its report on stdout does not repeat them."""
    torch.save(timm.create_model(NAME, **TINY).state_dict(), tmp_path / "fresh.pth")
    kwargs = [f"{k}={v}" for k, v in TINY.items()]
    assert (
        main(
            ["convert", str(tmp_path / "fresh.pth"), str(tmp_path / "out"), "--to", "native", "--model-kwargs", *kwargs]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert err.count("saved before training") == 1 and "saved before training" not in out, (out, err)
    assert err.startswith("timm-ls: warning: LayerScale gammas equal an init value in all 4 branches")
