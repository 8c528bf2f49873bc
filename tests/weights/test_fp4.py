"""DeepSeek-V4.1's FP4 routed experts (`weights/fp4.py`): the code table, the byte order, block
scales, and a tiny V4.1 checkpoint written in the release's FP4 layout, loaded exactly, refused in
one line where its scales do not fit."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphc.errors import CheckpointError
from graphc.weights import fp4
from graphc.weights.checkpoint import check_checkpoint, load_model
from graphc.weights.tiny import make_tiny_checkpoint

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
"""float4_e2m1's magnitudes by code (OCP Microscaling spec); bit 3 is the sign."""
EXPERT = "layers.2.ffn.experts.5.w2.weight"
"""A routed expert's down projection in the tiny V4.1: [hidden 64, intermediate 32]."""


def test_every_code_decodes_to_the_formats_value():
    assert fp4.e2m1_values(torch.arange(16)).tolist() == E2M1 + [-v for v in E2M1]
    assert torch.signbit(fp4.e2m1_values(torch.tensor([8]))).item()  # code 8 is -0


def test_every_scale_byte_decodes_as_torchs_float8_e8m0fnu():
    """The scales kept as bytes (`fp4.EXPONENTS`) decode to torch's values, bit for bit: 2^-127
    (byte 0) to 2^127, and NaN (255)."""
    exponents = torch.arange(256, dtype=torch.uint8)
    want = exponents.view(torch.float8_e8m0fnu).float()
    got = fp4.e8m0_values(exponents.view(fp4.EXPONENTS))
    assert torch.equal(got[:255].view(torch.int32), want[:255].view(torch.int32))
    assert got[255].isnan() and want[255].isnan() and got[0] == 2.0**-127


def test_a_byte_holds_its_even_column_in_the_low_nibble():
    pairs = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)  # codes 1, 2 | 7, 15
    assert fp4.unpack(pairs).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    assert torch.equal(fp4.unpack(pairs.view(torch.float4_e2m1fn_x2)), fp4.unpack(pairs.view(torch.int8)))


def test_quantising_picks_power_of_two_scales_and_the_nearest_code():
    weight = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 6)[:, None]
    pairs, scale = fp4.quantize(weight)
    assert pairs.dtype == torch.float4_e2m1fn_x2 and tuple(pairs.shape) == (6, 48)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (6, 3)
    scales = scale.float()
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two
    amax = weight.abs().view(6, 3, 32).amax(-1)
    assert ((amax / scales > 3) & (amax / scales <= 6)).all()  # the least that brings the block within 6
    values = fp4.dequantize(pairs.view(torch.int8), scale)
    steps = scales.repeat_interleave(32, dim=1)  # codes are at most 2 apart: within one scale of the weight
    assert ((values - weight).abs() <= steps).all()
    codes = torch.tensor(E2M1 + [-v for v in E2M1])
    nearest = (weight / steps)[..., None].sub(codes).abs().amin(-1)
    assert torch.equal((values / steps - weight / steps).abs(), nearest)


def test_dequantising_refuses_scales_that_do_not_tile_the_weight():
    with pytest.raises(ValueError, match=r"scales \[4, 1\] do not tile an FP4 weight of \[4, 64\] in \[1, 32\] "
                                         r"blocks; expected \[4, 2\]"):
        fp4.dequantize(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1))


@pytest.fixture(scope="module")
def v41_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp4") / "v41", preset="v41", fp8_block=32)


def test_make_tiny_stores_v41s_routed_experts_as_fp4_and_the_rest_fp8(v41_checkpoint):
    """As the releases store them: FP4 bytes as I8 [R, C / 2] (config.json's `expert_dtype: fp4`
    says what they hold), e8m0 scales."""
    stored = load_file(v41_checkpoint / "model.safetensors")
    experts = [n for n in stored if n.startswith("layers.") and ".ffn.experts." in n and n.endswith(".weight")]
    assert experts and all(stored[n].dtype == torch.int8 for n in experts)
    assert all(stored[n.removesuffix(".weight") + ".scale"].dtype == torch.float8_e8m0fnu for n in experts)
    assert tuple(stored[EXPERT].shape) == (64, 16) and tuple(stored[EXPERT.replace("weight", "scale")].shape) == (64, 1)
    assert stored["layers.2.ffn.shared_experts.w2.weight"].dtype == torch.float8_e4m3fn
    assert set(check_checkpoint(v41_checkpoint).fp4_bytes) == set(experts)


def test_both_models_read_the_fp4_experts_exactly(v41_checkpoint):
    """The paged model's stacked down projection and the reference's expert hold the stored
    codes times their scales (safetensors' own reader for the bytes)."""
    from graphc.weights.checkpoint import load_reference

    stored = load_file(v41_checkpoint / "model.safetensors")
    expected = fp4.dequantize(stored[EXPERT], stored[EXPERT.replace("weight", "scale")])
    paged = dict(load_model(v41_checkpoint).named_parameters())["model.layers.2.mlp.experts.down_proj"][5]
    assert torch.equal(paged, expected)
    assert torch.equal(load_reference(v41_checkpoint).layers[2].ffn.experts[5].w2.weight, expected)


def test_experts_stored_as_f4_load_as_the_i8_bytes_do(v41_checkpoint, tmp_path):
    """safetensors' F4 dtype (float4_e2m1fn_x2) holds the same bytes: the same model loads."""
    retyped = shutil.copytree(v41_checkpoint, tmp_path / "f4")
    tensors = load_file(retyped / "model.safetensors")
    experts = [n for n in tensors if ".ffn.experts." in n and n.endswith(".weight")]  # the draft layer's too
    save_file({n: t.view(torch.float4_e2m1fn_x2) if n in experts else t for n, t in tensors.items()},
              retyped / "model.safetensors")
    assert set(check_checkpoint(retyped).fp4_bytes) == {n for n in experts if n.startswith("layers.")}
    for (name, a), (_, b) in zip(load_model(v41_checkpoint, as_stored=True).state_dict().items(),
                                 load_model(retyped, as_stored=True).state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("break_it, says", [
    (lambda t: t.__setitem__(EXPERT.replace("weight", "scale"), torch.ones(64, 2).to(torch.float8_e8m0fnu)),
     r"layers\.2\.ffn\.experts\.5\.w2\.scale: scales \[64, 2\] do not tile a weight of \[64, 32\] in \[1, 32\] blocks; "
     r"expected \[64, 1\]"),
    (lambda t: t.pop(EXPERT.replace("weight", "scale")),
     r"tensor layers\.2\.ffn\.experts\.5\.w2\.weight is float4_e2m1 \(F4\) but layers\.2\.ffn\.experts\.5\.w2\.scale "
     r"is missing"),
    (lambda t: t.__setitem__(EXPERT.replace("weight", "scale"), torch.ones(64, 1)),
     r"layers\.2\.ffn\.experts\.5\.w2\.scale scales the FP4 tensor layers\.2\.ffn\.experts\.5\.w2\.weight as "
     r"torch\.float32; FP4 scales are float8_e8m0fnu"),
    (lambda t: t.__setitem__(EXPERT, torch.zeros(64, 33, dtype=torch.int8)),
     r"tensor layers\.2\.ffn\.experts\.5\.w2\.weight has shape \[64, 66\], expected \[64, 32\]"),
    (lambda t: t.__setitem__(EXPERT, torch.zeros(64, 33, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)),
     r"tensor layers\.2\.ffn\.experts\.5\.w2\.weight has shape \[64, 66\], expected \[64, 32\]"),
])
def test_broken_fp4_experts_are_refused_from_the_headers_naming_the_tensor(v41_checkpoint, tmp_path, break_it, says):
    broken = shutil.copytree(v41_checkpoint, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    break_it(tensors)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=says):
        check_checkpoint(broken)
