"""DINOHead: Meta's keys load strictly, and the outputs are Meta's."""

import pytest
import torch
from pretrain_fixture import assert_meta, meta, record, tensors

from timm_layerscale.pretrain.heads import DINOHead


def meta_state(name: str) -> dict[str, torch.Tensor]:
    prefix = f"{name}.state."
    return {key.removeprefix(prefix): value for key, value in tensors().items() if key.startswith(prefix)}


@pytest.mark.parametrize("name", ["head3", "head1", "head2bn", "head4nobias"])
def test_metas_state_dict_loads_strictly_and_gives_metas_outputs(name):
    head = DINOHead(**record()["heads"][name])
    ours = {key: list(value.shape) for key, value in head.state_dict().items()}
    assert ours == record()["head_keys"][name]
    head.load_state_dict(meta_state(name), strict=True)
    head.eval()
    with torch.no_grad():
        assert_meta(head(meta("head.x")), f"{name}.forward")
        assert_meta(head(meta("head.x"), no_last_layer=True), f"{name}.no_last_layer")
        assert_meta(head(meta("head.z"), only_last_layer=True), f"{name}.only_last_layer")
        head.train()
        assert_meta(head(meta("head.x")), f"{name}.forward_train")


def test_init_is_metas_and_the_bottleneck_is_unit_norm():
    """Meta's trunc_normal_ keeps its default cut at +-2 (absolute): at std 0.02 a plain normal."""
    head = DINOHead(in_dim=32, out_dim=64, hidden_dim=48, bottleneck_dim=16)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            assert module.weight.std().item() == pytest.approx(0.02, rel=0.3)
            assert module.bias is None or not module.bias.any()
    assert head.last_layer.bias is None
    z = head(torch.randn(7, 32), no_last_layer=True)
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(7))
    assert head(torch.randn(7, 32)).shape == (7, 64)
    assert isinstance(DINOHead(4, 8, nlayers=0).mlp, torch.nn.Linear)  # nlayers below 1 means 1, as Meta's
    with torch.device("meta"):
        assert DINOHead(4, 8).last_layer.weight.is_meta  # built on meta: nothing initialised
