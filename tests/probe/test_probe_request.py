"""`timm-ls probe`'s flags parsed once, in the front and without torch: what a `--layer` value reads in a model
of a given depth, the token choices (the package's protocols refuse any other), and each bad value refused in
one line that names what to pass."""

from __future__ import annotations

import pytest
import torch

from timm_layerscale.probe.evaluate import tokens_of
from timm_layerscale.probe.extract import SplitFeatures
from timm_ls.errors import CliError
from timm_ls.main import parse
from timm_ls.probe_request import TOKENS, LayerChoice, parse_layer, probe_request


def request(*flags: str):
    return probe_request(parse(["probe", "data", "--model", "m", "--out", "out", *flags]))


@pytest.mark.parametrize(
    ("text", "depth", "blocks"),
    [("0", 12, [0]), ("11", 12, [11]), ("-1", 12, [11]), ("-12", 12, [0]), ("last", 12, [11]),
     ("last_four", 12, [8, 9, 10, 11]), ("four_even", 12, [2, 5, 8, 11]), ("last_four", 2, [0, 1])],
)  # fmt: skip
def test_a_layer_value_reads_these_blocks(text, depth, blocks):
    choice = parse_layer(text)
    assert choice.text == text and choice.blocks(depth) == blocks


@pytest.mark.parametrize(("text", "depth"), [("12", 12), ("-13", 12), ("2", 2)])
def test_a_block_past_the_model_is_refused_naming_its_range(text, depth):
    with pytest.raises(ValueError, match=rf"^--layer {text}: the model has {depth} blocks; pass 0 to {depth - 1}"):
        parse_layer(text).blocks(depth)


def test_the_request_holds_every_flag_typed():
    got = request("--layer", "0", "last_four", "--tokens", "avgpool", "--val-split", "0.3", "--seed", "4")
    assert got.layers == (LayerChoice("0", 0), LayerChoice("last_four")) and got.tokens == "avgpool"
    assert (got.val_split, got.seed, got.batch, got.models) == (0.3, 4, 32, ("m",))
    assert request().layers == (LayerChoice("last"),) and request().tokens == "cls"
    with pytest.raises(AttributeError):
        got.tokens = "cls"  # frozen: what the front checked is what runs


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--layer", "middle"], "--layer: got 'middle'; pass a block index (0 is the first, -1 the last), last, "),
        (["--layer", "1.5"], "--layer: got '1.5'"),
        (["--tokens", "patch"], "unknown token choice 'patch'; pass --tokens one of cls, avgpool, cls+avgpool"),
        (["--tokens", "CLS"], "unknown token choice 'CLS'"),
        (["--batch", "0"], "--batch: got 0; pass 1 or more"),
        (["--steps", "0"], "--steps: got 0"),
        (["--max-iter", "0"], "--max-iter: got 0"),
        (["--threads", "0"], "--threads: got 0"),
        (["--pictures", "-1"], "--pictures: got -1; pass 0 or more"),
        (["--val-split", "0"], "--val-split: got 0.0"),
        (["--val-split", "1"], "--val-split: got 1.0"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_fix(flags, words):
    with pytest.raises(CliError) as caught:
        request(*flags)
    assert str(caught.value).startswith(words) and "\n" not in str(caught.value)


def test_the_edges_of_the_counts_are_taken():
    got = request("--batch", "1", "--steps", "1", "--max-iter", "1", "--threads", "1", "--pictures", "0")
    assert (got.batch, got.steps, got.max_iter, got.threads, got.pictures) == (1, 1, 1, 1, 0)


def split_of(rows: int = 3, width: int = 2) -> SplitFeatures:
    blocks = {
        b: {"cls": torch.full((rows, width), 1.0 + b), "avgpool": torch.full((rows, width), -1.0 - b)} for b in (0, 1)
    }
    return SplitFeatures(blocks, list(range(rows)))


def test_each_token_choice_reads_its_tokens_and_any_other_is_refused():
    split, rows = split_of(), torch.tensor([0, 2])
    assert tokens_of(split, rows, [0, 1], "cls").tolist() == [[1, 1, 2, 2]] * 2
    assert tokens_of(split, rows, [0, 1], "avgpool").tolist() == [[-1, -1, -2, -2]] * 2
    assert tokens_of(split, rows, [0, 1], "cls+avgpool").tolist() == [[1, 1, 2, 2, -2, -2]] * 2
    assert set(TOKENS) == {"cls", "avgpool", "cls+avgpool"}
    for other in ("patch", "", "CLS"):
        with pytest.raises(ValueError, match="unknown token choice"):
            tokens_of(split, rows, [0, 1], other)
