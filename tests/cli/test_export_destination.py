"""export's destination: the ONNX file and its companion `DST.onnx.data` (external weights) are both checked
before any work, so an existing companion is never replaced without --overwrite."""

from __future__ import annotations

from timm_ls.main import main


def test_an_existing_onnx_data_is_not_replaced_without_overwrite(tmp_path, capsys):
    companion = tmp_path / "m.onnx.data"
    companion.write_bytes(b"someone's weights")
    assert main(["export", "vit_ls_small_patch16_dinov3", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert str(companion) in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert companion.read_bytes() == b"someone's weights" and not (tmp_path / "m.onnx").exists()
