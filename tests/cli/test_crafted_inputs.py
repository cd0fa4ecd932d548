"""What a file or an argument says of the model, crafted: config.json of every format, variant YAML,
--model-kwargs and key names. Each is answered by the command with a correct read or one `timm-ls: error:` line
(exit 2), within bounded CPU time and memory; then a seeded, structure-aware fuzzer mutates the same inputs (a
config field's value, a YAML value, a block index) and holds every case to the same ends, in this process.
Failures name the seed and the case."""

from __future__ import annotations

import json
import pickle
import random
import resource
import shutil
import time
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from timm_layerscale.checkpoints import CheckpointError
from timm_layerscale.checkpoints.mapping.keys import block_count
from timm_layerscale.checkpoints.read.dcp.reader import read_metadata
from timm_layerscale.checkpoints.read.dcp.schema import LIMITS, Work
from timm_layerscale.checkpoints.read.reader import open_checkpoint
from timm_layerscale.convert import convert_checkpoint
from timm_ls.main import main

SMALL = "vit_ls_small_patch16_dinov3"
TINY = dict(embed_dim=64, num_heads=4, depth=2)
SAPIENS2 = "vit_ls_base_patch16_sapiens2"
SAPIENS2_TINY = dict(embed_dim=64, num_heads=4, depth=2, num_kv_heads=[4, 2])
TINY_KWARGS = ["--model-kwargs", *(f"{k}={v}" for k, v in TINY.items())]
# Bounds in CPU seconds of this process, on one torch thread: other load on the machine leaves them as they are,
# where a wall-clock bound failed on a loaded machine (the fuzzer's 150 cases took 47 s there, 11 s idle).
SECONDS = 10.0  # each case, beyond the imports; most take well under one
SEED = 20261202
DEEP = "[" * 900 + "]" * 900


def test_a_block_index_is_parsed_with_a_bound():
    """Before any per-block structure: the index at the deepest model a config may have is refused."""
    assert block_count(["blocks.1023.norm1.weight", "cls_token"]) == 1024
    for index in ("1024", "999999999", "9" * 5000, "x", "٣", ""):
        with pytest.raises(CheckpointError, match="block index"):
            block_count([f"blocks.{index}.norm1.weight"])


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("crafted")
    model = timm.create_model(SMALL, **TINY, num_classes=5)
    weights = root / "native.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights)
    found = {"weights": weights}
    for to in ("native", "hf", "timm"):
        found[to] = convert_checkpoint(weights, root / to, to=to, model=SMALL, model_kwargs=TINY).destination
    sapiens2 = timm.create_model(SAPIENS2, **SAPIENS2_TINY, num_classes=0)
    save_file({k: v.contiguous() for k, v in sapiens2.state_dict().items()}, root / "sapiens2.safetensors")
    found["sapiens2 hf"] = convert_checkpoint(
        root / "sapiens2.safetensors", root / "sapiens2_hf", to="hf", model=SAPIENS2, model_kwargs=SAPIENS2_TINY
    ).destination
    found["sapiens2 keys"] = convert_checkpoint(
        root / "sapiens2.safetensors",
        root / "upstream.safetensors",
        to="sapiens2",
        model=SAPIENS2,
        model_kwargs=SAPIENS2_TINY,
    ).destination
    return found


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One thread: the work is counted once, and no thread spins waiting on a sibling that the load stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cpu_seconds() -> float:
    """This process's CPU time: what a command costs, whatever else the machine runs."""
    return time.process_time()


def answer(argv: list[str], capsys) -> tuple[int, str, float]:
    start = cpu_seconds()
    code = main(argv)
    took = cpu_seconds() - start
    return code, capsys.readouterr().err, took


def assert_one_line_or_read(code: int, err: str, took: float, case: str) -> None:
    assert took < SECONDS, f"{case}: {took:.1f} s"
    assert "Traceback" not in err, f"{case}: {err}"
    assert code in (0, 2), f"{case}: exit {code}: {err}"
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("timm-ls: error: "), f"{case}: {err}"


def with_config(source: Path, dst: Path, edit) -> Path:
    shutil.copytree(source, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(edit(cfg) if callable(edit) else edit)
    return dst


def setting(*path_and_value):
    *path, value = path_and_value

    def edit(cfg: dict) -> str:
        inner = cfg
        for part in path[:-1]:
            inner = inner[part]
        inner[path[-1]] = value
        return json.dumps(cfg)

    return edit


CONFIG_CASES = {
    "hf width as text": ("hf", setting("hidden_size", "64"), "hidden_size (embed_dim): got '64'; allowed: an integer"),
    "hf width of 31 digits": ("hf", setting("hidden_size", 10**30), "hidden_size (embed_dim): got 1000"),
    "hf a million layers": ("hf", setting("num_hidden_layers", 10**6), "num_hidden_layers (depth): got 1000000"),
    "hf 900-deep list": ("hf", setting("intermediate_size", json.loads(DEEP)), "intermediate_size: got [[[[...]]]]"),
    "hf gated as text": ("hf", setting("use_gated_mlp", "no"), "use_gated_mlp: got 'no'; allowed: true or false"),
    "timm ratio four": ("timm", setting("model_args", "mlp_ratio", "four"), "mlp_ratio: got 'four'; allowed"),
    "timm a million blocks": ("timm", setting("model_args", "depth", 10**6), "model_args: depth: got 1000000"),
    "timm pretrained cfg a list": ("timm", setting("pretrained_cfg", [1]), "pretrained_cfg: got a list"),
    "native width as text": ("native", setting("model_args", "embed_dim", "64"), "model_args: embed_dim: got '64'"),
    "native a million blocks": ("native", setting("model_args", "depth", 10**6), "model_args: depth: got 1000000"),
    "native init per block of 2000": ("native", setting("model_args", "init_values", [0.5] * 2000), "model_args: init"),
    "native init 900 deep": ("native", setting("model_args", "init_values", json.loads(DEEP)), "init_values"),
    # transformers' Sapiens2Config: a per-layer list, or null for its default pattern; values no model has
    "sapiens2 kv heads an int": ("sapiens2 hf", setting("num_key_value_heads_per_layer", 2), "layer: got 2; allowed"),
    "sapiens2 kv heads text": ("sapiens2 hf", setting("num_key_value_heads_per_layer", "4,2"), "got '4,2'; allowed"),
    "sapiens2 kv heads a zero": ("sapiens2 hf", setting("num_key_value_heads_per_layer", [4, 0]), "got [4, 0]"),
    "sapiens2 rope theta tiny": ("sapiens2 hf", setting("rope_theta", 1e-300), "rope_theta (rope_base): got 1e-300"),
    "sapiens2 rope theta huge": ("sapiens2 hf", setting("rope_theta", 1e308), "rope_theta (rope_base): got 1e+308"),
    "sapiens2 eps huge": ("sapiens2 hf", setting("rms_norm_eps", 1e308), "rms_norm_eps (norm_eps): got 1e+308"),
    "sapiens2 shift huge": ("sapiens2 hf", setting("pos_embed_shift", 1e308), "pos_embed_shift (rope_shift_coords)"),
    "native deeper than JSON": ("native", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "is not valid JSON"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_crafted_config_json_is_one_line(case, sources, tmp_path, capsys):
    fmt, edit, message = CONFIG_CASES[case]
    folder = with_config(sources[fmt], tmp_path / "src", edit)
    code, err, took = answer(["convert", str(folder), str(tmp_path / "out"), "--to", "native"], capsys)
    assert_one_line_or_read(code, err, took, case)
    assert code == 2 and message in err and not (tmp_path / "out").exists(), err
    assert err.startswith(f"timm-ls: error: {folder}"), err  # the file is named


def test_sapiens2_kv_heads_null_is_transformers_default_pattern(sources, tmp_path, capsys):
    """null stands for transformers' pattern (full attention in the first and last 8 blocks, so every block of a
    2-deep model): the grouped tiny model no longer fits it, and says so in one line."""
    folder = with_config(sources["sapiens2 hf"], tmp_path / "src", setting("num_key_value_heads_per_layer", None))
    code, err, took = answer(["convert", str(folder), str(tmp_path / "out"), "--to", "native"], capsys)
    assert_one_line_or_read(code, err, took, "null")
    assert code == 2 and "blocks.1.attn.qkv.weight is [128, 64] in the checkpoint but [192, 64]" in err, err
    grouped_middle = {"num_first_full_attention_layers": 1, "num_last_full_attention_layers": 0}
    edit = lambda cfg: json.dumps({**cfg, **grouped_middle, "num_key_value_attention_heads": 2})  # noqa: E731
    folder = with_config(folder, tmp_path / "pattern", edit)
    code, err, took = answer(["convert", str(folder), str(tmp_path / "out"), "--to", "native"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_args"]["num_kv_heads"] == [4, 2]


def _renumbered(sd: dict, old: str, new: str) -> None:
    for key in [k for k in sd if k.startswith(old)]:
        sd[new + key[len(old) :]] = sd.pop(key)


# Sapiens2's own keys with a part missing, misnumbered, empty or of the wrong rank
SAPIENS2_KEY_CASES = {
    "no wk in block 1": (lambda sd: sd.pop("blocks.1.attn.wk.weight"), "block 1 of 2 has no attention projection"),
    "blocks 0 and 1023": (lambda sd: _renumbered(sd, "blocks.1.", "blocks.1023."), "block 1 of 1024 has no"),
    "empty q-norm": (lambda sd: sd.update({"blocks.0.attn.q_norm.weight": torch.empty(0)}), "q_norm.weight is [0]"),
    "2-D q-norm": (lambda sd: sd.update({"blocks.0.attn.q_norm.weight": torch.ones(4, 4)}), "q_norm.weight is [4, 4]"),
    "1-D wq": (lambda sd: sd.update({"blocks.1.attn.wq.weight": torch.ones(64)}), "timm-ls: error: "),
    "no q-norm in block 1": (lambda sd: sd.pop("blocks.1.attn.q_norm.weight"), "timm-ls: error: "),
    "NaN periods": (lambda sd: sd["rope_embed.periods"].fill_(float("nan")), "rope_embed.periods holds NaN (4 of 4)"),
}


@pytest.mark.parametrize("case", SAPIENS2_KEY_CASES)
def test_crafted_sapiens2_keys_are_one_line(case, sources, tmp_path, capsys):
    edit, message = SAPIENS2_KEY_CASES[case]
    sd = load_file(sources["sapiens2 keys"])
    edit(sd)
    save_file(sd, tmp_path / "crafted.safetensors")
    for argv in (
        ["convert", str(tmp_path / "crafted.safetensors"), str(tmp_path / "out"), "--to", "native"],
        ["export", str(tmp_path / "crafted.safetensors"), str(tmp_path / "out.onnx"), *TINY_KWARGS],
    ):
        code, err, took = answer(argv, capsys)
        assert_one_line_or_read(code, err, took, case)
        assert code == 2 and (message in err or argv[0] == "export"), f"{case}: {err}"
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.onnx").exists()


def test_a_head_less_native_folder_is_read_as_native(sources, tmp_path, capsys):
    folder = tmp_path / "src"
    shutil.copytree(sources["native"], folder)
    weights = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("head.")}
    save_file(weights, folder / "model.safetensors")
    setting("model_args", "num_classes", 0)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_classes"] = cfg["model_args"]["num_classes"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main(["convert", str(folder), str(tmp_path / "out"), "--to", "hf"]) == 0
    assert "timm-layerscale keys" in capsys.readouterr().out


YAML_CASES = {
    "object/apply": ("model: !!python/object/apply:os.system ['true']\n", "line 1: could not determine a constructor"),
    "python/name": ("model: {depth: !!python/name:os.system }\n", "line 1: could not determine a constructor"),
    "a list for model": ("model: [1, 2]\n", "model: got a list; allowed: a mapping of config fields"),
    "an int tag on text": ("model: {depth: !!int abc}\n", "line 1: invalid literal for int()"),
    "not YAML": (bytes(range(256)) * 4, "unacceptable character"),
    "3000 deep": ("model:\n  depth: " + "[" * 3000 + "]" * 3000 + "\n", "line 2: it nests more than 64 deep"),
    "a billion depth": (f"base: {SMALL}\nmodel: {{depth: 1000000000}}\n", "depth: got 1000000000; allowed"),
    "billion laughs": (
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
        + f"base: {SMALL}\nmodel: {{init_values: *i}}\n",
        "more than 100000 values once its aliases are expanded",
    ),
    "refers to itself": ("model: &m {init_values: *m}\n", "once its aliases are expanded"),
}


@pytest.mark.parametrize("command", ["inspect", "convert"])
@pytest.mark.parametrize("case", YAML_CASES)
def test_a_crafted_variant_yaml_is_one_line(case, command, sources, tmp_path, capsys):
    text, message = YAML_CASES[case]
    path = tmp_path / "variant.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    argv = ["inspect", str(path)]
    if command == "convert":
        argv = ["convert", str(sources["weights"]), str(tmp_path / "out"), "--to", "native", "--model", str(path)]
    code, err, took = answer(argv, capsys)
    assert_one_line_or_read(code, err, took, case)
    assert code == 2 and message in err, err
    assert took < 1.0, f"{case}: {took:.2f} s"


def test_a_deep_meta_config_is_one_line(sources, tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text("dino: " + "[" * 3000 + "]" * 3000 + "\n")
    argv = ["convert", str(sources["weights"]), str(tmp_path / "o"), "--to", "meta-train", "--meta-config", str(path)]
    code, err, took = answer([*argv, *TINY_KWARGS], capsys)
    assert_one_line_or_read(code, err, took, "meta-config")
    assert code == 2 and "it nests more than 64 deep" in err


KWARGS_CASES = {
    "depth=10**9": "depth: got '10**9'; allowed: an integer in [1, 1024]",
    "depth=10000000": "depth: got 10000000; allowed: an integer in [1, 1024]",
    "embed_dim=4e9": "embed_dim: got 4000000000.0; allowed: an integer in [1, 65536]",
    "num_classes=10**12": "num_classes: got '10**12'; allowed: an integer in [0, 1048576]",
    "init_values={}": "init_values: got keys []; allowed: exactly ['attn', 'mlp']",
    "depth=true": "depth: got True; allowed: an integer in [1, 1024]",
    "depth=" + "+".join(["1"] * 20000): "is 39999 characters long",
    "depth=" + "(" * 1000 + "1" + ")" * 1000: "depth: got '((((((((",
}


@pytest.mark.parametrize("command", ["inspect", "convert"])
@pytest.mark.parametrize("kwarg", KWARGS_CASES, ids=lambda k: k[:20])
def test_crafted_model_kwargs_are_one_line(kwarg, command, sources, tmp_path, capsys):
    argv = ["inspect", SMALL]
    if command == "convert":
        argv = ["convert", str(sources["weights"]), str(tmp_path / "out"), "--to", "native", "--model", SMALL]
    code, err, took = answer([*argv, "--model-kwargs", kwarg], capsys)
    assert_one_line_or_read(code, err, took, kwarg[:40])
    assert code == 2 and KWARGS_CASES[kwarg] in err, err


def renamed(sources, tmp_path: Path, old: str, new: str) -> Path:
    tensors = load_file(sources["weights"])
    tensors[new] = tensors.pop(old)
    path = tmp_path / "renamed.safetensors"
    save_file(tensors, path)
    return path


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("999999999", "block index '999999999' is beyond the deepest model a config may have (1024 blocks)"),
        ("1000000", "block index '1000000' is beyond"),
        ("1024", "block index '1024' is beyond"),
        ("x", "key 'blocks.x.norm1.weight': block index 'x' is not an integer"),
        ("٣", "is not an integer"),
        ("9" * 5000, "is beyond"),
    ],
)
def test_a_crafted_block_index_is_one_line(index, message, sources, tmp_path, capsys):
    path = renamed(sources, tmp_path, "blocks.1.norm1.weight", f"blocks.{index}.norm1.weight")
    code, err, took = answer(["convert", str(path), str(tmp_path / "out"), "--to", "native"], capsys)
    assert_one_line_or_read(code, err, took, index[:20])
    assert code == 2 and message in err, err
    assert took < 2.0, f"{took:.1f} s"


def test_a_float_weight_stored_as_integers_is_refused(sources, tmp_path, capsys):
    tensors = load_file(sources["weights"])
    tensors["blocks.0.norm1.weight"] = tensors["blocks.0.norm1.weight"].view(dtype=torch.int32)
    save_file(tensors, tmp_path / "i32.safetensors")
    argv = ["convert", str(tmp_path / "i32.safetensors"), str(tmp_path / "out"), "--to", "native", *TINY_KWARGS]
    assert main(argv) == 2
    assert "stores blocks.0.norm1.weight as int32, but" in capsys.readouterr().err
    # The model holds no integer tensor: every one it has is floating point, so this refuses nothing it holds.
    model = timm.create_model(SMALL, **TINY, device="meta")
    assert all(t.dtype.is_floating_point for t in model.state_dict().values())


def test_a_header_of_many_entries_is_refused_by_its_count(tmp_path, capsys):
    header = {f"x{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    raw = json.dumps(header).encode()
    path = tmp_path / "many.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    code, err, took = answer(["convert", str(path), str(tmp_path / "out"), "--to", "native"], capsys)
    assert code == 2 and "lists 200000 tensors, more than any checkpoint of these models holds (16384)" in err
    assert took < 3.0, f"{took:.1f} s"


# ------------------------------------------------------------------------------------------------ the fuzzer

HOSTILE = ("four", "64", 10**30, -1, 0, True, None, [], {}, 1e308, [[[]]], "x" * 5000, 10**6, 2.5, {"a": [1]})


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))


def mutate_config(cfg: dict, rng: random.Random) -> str:
    path = rng.choice(list(_paths(cfg)))
    inner = cfg
    for part in path[:-1]:
        inner = inner[part]
    if rng.random() < 0.15:
        del inner[path[-1]]
    else:
        inner[path[-1]] = rng.choice(HOSTILE)
    return json.dumps(cfg)


YAML_VALUES = ("!!python/name:os.system", "*nowhere", "[" * 200, "!!int x", "1e999", str(10**40), "[1, [2, [3]]]")


def mutate_yaml(rng: random.Random) -> str:
    fields = {"embed_dim": 64, "num_heads": 4, "depth": 2, "ffn_ratio": 4.0, "init_values": 1e-5, "qkv_bias": "true"}
    field = rng.choice(list(fields)) if rng.random() < 0.8 else None  # else the file as it was
    lines = [f"  {k}: {rng.choice(YAML_VALUES) if k == field else v}" for k, v in fields.items()]
    return f"base: {SMALL}\nmodel:\n" + "\n".join(lines) + "\n"


CASES = 150
INDICES = ("x", "-1", "1024", "999999999", "9" * 4400, "", "1.5", "01", "٣", " 1")


def test_fuzzed_configs_yaml_and_keys_end_in_a_read_or_one_line(sources, tmp_path, capsys):
    rng = random.Random(SEED)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = cpu_seconds()
    tensors = load_file(sources["weights"])
    outcomes = {kind: set() for kind in ("config", "yaml", "keys")}
    for n in range(CASES):
        kind = ("config", "yaml", "keys")[n % 3]
        case, out = f"seed {SEED} case {n} ({kind})", tmp_path / f"out{n}"
        if kind == "config":
            fmt = rng.choice(("native", "hf", "timm"))
            cfg = json.loads((sources[fmt] / "config.json").read_text())
            text = mutate_config(cfg, rng)
            argv = ["convert", str(with_config(sources[fmt], tmp_path / f"src{n}", text)), str(out), "--to", "native"]
        elif kind == "yaml":
            (tmp_path / f"v{n}.yaml").write_text(text := mutate_yaml(rng))
            argv = [
                "convert",
                str(sources["weights"]),
                str(out),
                "--to",
                "native",
                "--model",
                str(tmp_path / f"v{n}.yaml"),
            ]
        else:
            block, index = rng.choice(list(tensors)), rng.choice(INDICES)
            text = block.replace("blocks.1.", f"blocks.{index}.", 1) if block.startswith("blocks.1.") else block
            save_file({**{k: v for k, v in tensors.items() if k != block}, text: tensors[block]}, tmp_path / "k.st")
            argv = ["convert", str(tmp_path / "k.st"), str(out), "--to", "native", *TINY_KWARGS]
        code, err, took = answer(argv, capsys)
        assert_one_line_or_read(code, err, took, f"{case}: {text[:200]}")
        outcomes[kind].add(code)
    assert all(codes == {0, 2} for codes in outcomes.values()), outcomes  # the mutations reach both ends
    assert cpu_seconds() - start < 40
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    assert grown < 1024, f"peak memory grew by {grown:.0f} MB"


def test_dcp_metadata_of_many_items_is_refused_as_its_mapping_fills(tmp_path):
    """20,000 zero-size tensors: refused by their count while unpickling, not after the whole file."""
    item = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([0]), [])
    items = {f"model.k{i}": item for i in range(20_000)}
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata=items, storage_data={})))
    start = cpu_seconds()
    with pytest.raises(CheckpointError, match="lists more than the 16384 items any checkpoint holds"):
        open_checkpoint(folder)
    assert cpu_seconds() - start < 3.0


def test_dcp_metadata_unpickling_is_bounded_by_the_files_size(tmp_path):
    """2 MB of EMPTY_SET opcodes (one byte, a 216-byte set each): refused once they would take more than the
    file's bound, 48 bytes per byte here (91 MiB), not the 700 MB they ask for."""
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"\x80\x04" + b"\x8f" * 2_000_000 + b".")
    work = Work()
    with pytest.raises(CheckpointError, match="makes objects taking over 91 MiB from 2000003 bytes"):
        read_metadata(folder, work=work)
    assert work.memory <= LIMITS.memory_per_byte * 2_000_003 + 1024
