"""SGLang loaded-parameter layouts -> MegaMoE ExpertWeights (no server, real sglang classes)."""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.experts import interleave_gate_up
from megamoe_backend.formats import quantize_mx
from megamoe_backend.knobs import Knobs
from megamoe_sglang.weights import (
    ExpertFormat,
    UnsupportedExpertsError,
    e8m0_bytes,
    expert_format_of,
    expert_weights_from_params,
)

E, H, I = 3, 64, 32


def _quant_method(cls_path: str, **attrs):
    """A real SGLang quant-method object, left uninitialised (only its class and flags matter)."""
    module, name = cls_path.rsplit(".", 1)
    cls = getattr(__import__(module, fromlist=[name]), name)
    obj = object.__new__(cls)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def test_format_classification_uses_sglang_quant_methods():
    unq = _quant_method("sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod")
    assert expert_format_of(unq).quant == "bf16"
    for mod, scheme, quant in (
        ("quark_w4a4_mxfp4_moe", "QuarkW4A4MXFp4MoE", "a4w4"),
        ("quark_w4a8_mxfp4_moe", "QuarkW4A8MXFp4MoE", "a8w4"),
    ):
        s = _quant_method(f"sglang.srt.layers.quantization.quark.schemes.{mod}.{scheme}")
        q = _quant_method("sglang.srt.layers.quantization.quark.quark.QuarkFusedMoEMethod")
        fmt = expert_format_of(q, scheme=s)  # SGLang keeps the Quark scheme on the layer
        assert (fmt.quant, fmt.weights, fmt.scale_param) == (quant, "mxfp4", "_scale")
    v4 = _quant_method("sglang.srt.layers.quantization.fp8.Fp8MoEMethod", is_fp4_expert=True)
    assert expert_format_of(v4).quant == "a4w4"
    assert expert_format_of(v4, Knobs(aiter_force_a8w4=True)).quant == "a8w4"
    fp8 = _quant_method("sglang.srt.layers.quantization.fp8.Fp8MoEMethod", is_fp4_expert=False)
    with pytest.raises(UnsupportedExpertsError, match="block-FP8"):
        expert_format_of(fp8)


def test_bf16_gate_then_up_becomes_interleaved():
    w13 = torch.randn(E, 2 * I, H).to(torch.bfloat16)
    w2 = torch.randn(E, H, I).to(torch.bfloat16)
    ew = expert_weights_from_params({"w13_weight": w13, "w2_weight": w2}, ExpertFormat("bf16", "bf16", "t"), I)
    assert ew.gate_up_layout == "interleaved"
    assert torch.equal(ew.w1[:, 0::2], w13[:, :I]) and torch.equal(ew.w1[:, 1::2], w13[:, I:])
    assert torch.equal(ew.w2, w2)
    # up-first loaders (TRT-LLM layouts) swap the halves
    up_first = torch.cat((w13[:, I:], w13[:, :I]), dim=1)
    ew2 = expert_weights_from_params({"w13_weight": up_first, "w2_weight": w2}, ExpertFormat("bf16", "bf16", "t"), I, up_first=True)
    assert torch.equal(ew2.w1, ew.w1)


def _mxfp4_layer(pad: int):
    """Quark-style loaded tensors with ``pad`` zero rows per half (SGLang's aiter alignment)."""
    w13 = torch.randn(E, 2 * I, H)
    w2 = torch.randn(E, H, I)
    q13, q2 = quantize_mx(w13, "fp4"), quantize_mx(w2, "fp4")
    gate, up = q13.data[:, :I], q13.data[:, I:]
    sg, su = q13.scales[:, :I], q13.scales[:, I:]
    z = lambda t: torch.zeros(E, pad, t.shape[-1], dtype=torch.uint8)  # noqa: E731
    params = {
        "w13_weight": torch.cat((gate, z(gate), up, z(up)), dim=1),
        "w13_weight_scale": torch.cat((sg, z(sg), su, z(su)), dim=1),
        "w2_weight": torch.cat((q2.data, torch.zeros(E, H, pad // 2, dtype=torch.uint8)), dim=2),
        "w2_weight_scale": torch.cat((q2.scales, torch.zeros(E, H, pad // 32, dtype=torch.uint8)), dim=2),
    }
    return params, q13, q2


@pytest.mark.parametrize("pad", [0, 32])
def test_quark_mxfp4_mapping_strips_padding_and_interleaves(pad):
    params, q13, q2 = _mxfp4_layer(pad)
    ew = expert_weights_from_params(params, ExpertFormat("a4w4", "mxfp4", "quark", scale_param="_scale"), I)
    assert ew.fmt == "mxfp4" and ew.intermediate == I
    assert torch.equal(ew.w1, interleave_gate_up(q13.data)) and torch.equal(ew.w1_scale, interleave_gate_up(q13.scales))
    assert torch.equal(ew.w2, q2.data) and torch.equal(ew.w2_scale, q2.scales)


def test_v4_fp4_experts_with_float32_and_e8m0fnu_scales():
    params, q13, q2 = _mxfp4_layer(0)
    as_float = lambda s: torch.exp2(s.to(torch.float32) - 127)  # noqa: E731 (how CUDA SGLang stores them)
    v4 = {
        "w13_weight": params["w13_weight"].view(torch.int8),
        "w2_weight": params["w2_weight"].view(torch.int8),
        "w13_weight_scale_inv": as_float(params["w13_weight_scale"]),
        "w2_weight_scale_inv": as_float(params["w2_weight_scale"]),
    }
    ew = expert_weights_from_params(v4, ExpertFormat("a4w4", "mxfp4", "v4", scale_param="_scale_inv"), I)
    assert torch.equal(ew.w1_scale, interleave_gate_up(q13.scales)) and torch.equal(ew.w2_scale, q2.scales)
    e8 = params["w2_weight_scale"].view(torch.float8_e8m0fnu)
    assert torch.equal(e8m0_bytes(e8, "s"), q2.scales)


def test_bad_scales_and_missing_params_are_named():
    with pytest.raises(UnsupportedExpertsError, match="powers of two"):
        e8m0_bytes(torch.tensor([0.75]), "w2_weight_scale_inv")
    with pytest.raises(UnsupportedExpertsError, match="w13_weight_scale"):
        expert_weights_from_params(
            {"w13_weight": torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8), "w2_weight": torch.zeros(E, H, I // 2, dtype=torch.uint8)},
            ExpertFormat("a4w4", "mxfp4", "quark", scale_param="_scale"), I,
        )
    with pytest.raises(UnsupportedExpertsError, match="w2_weight"):
        expert_weights_from_params({"w13_weight": torch.zeros(1)}, ExpertFormat("bf16", "bf16", "t"), I)
