"""Builders shared by the aiter fused-path tests: a small DeepSeek-style layer (dims that every
upstream shuffle accepts), its plans, the fused object over the fakes, and an fp32 reference."""

from __future__ import annotations

import torch
from rocm_helpers import FakeDist, FakeGroup

from megamoe_backend.experts import quantize_expert_weights
from megamoe_backend.experts.aiter import AiterFusedMoE
from megamoe_backend.formats.mx import MXTensor
from megamoe_backend.knobs import Knobs
from megamoe_backend.layer.reference import fp32_reference_moe
from megamoe_backend.plan import build_plan
from megamoe_backend.platform import MoEShape, RocmAsk, select_backends
from megamoe_backend.spec import MoESpec

H, I, E, K = 128, 128, 8, 2  # gfx1250's scale shuffle needs multiples of 128
GROUPS = {ep: FakeGroup(tuple(range(ep))) for ep in (1, 2)}  # one group object per EP size, as engines hold
GROUP = GROUPS[2]


def make_plan(wire="fp8", combine="bf16", quant="a8w4", mtpr=512, ep=2, rank=0, limit=None, force=None, hidden=H,
              experts=E, transport="auto"):
    spec = MoESpec(hidden_size=hidden, moe_intermediate_size=I, n_routed_experts=experts, num_experts_per_tok=K,
                   quant=quant, swiglu_limit=limit)
    k = Knobs(dispatch_wire=wire, combine_wire=combine, max_tokens_per_rank=mtpr, aiter_force_a8w4=force,
              transport=transport)
    return build_plan(spec, k, ep_rank=rank, ep_size=ep, backends=("aiter", "mori"))


def ask(plan, device_index=None) -> RocmAsk:
    """What the layer's start-up hands selection: the model's shape and this rank (the fake aiter's
    plan builder and mori answer the probes)."""
    return RocmAsk(shape=MoEShape(plan.hidden, plan.spec.moe_intermediate_size, plan.topk), ep_rank=plan.ep_rank,
                   device_index=device_index)


def select(plan, facts, device_index=None):
    return select_backends(facts, plan.knobs, plan.math, ep_size=plan.ep_size, num_experts=plan.placement.num_physical,
                           rocm=ask(plan, device_index))


def fused(fakes, plan, facts, layer_id=0, group=None, env=None):
    group = group or GROUPS[plan.ep_size]
    return AiterFusedMoE(plan, group, "cpu", selection=select(plan, facts), layer_id=layer_id,
                         dist=FakeDist(rank=plan.ep_rank, log=fakes.mori.CALL_LOG), env=env, hip=fakes.hip)


def layer_weights(seed, ep=2, experts=E):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts // ep, 2 * I, H, generator=g) * H ** -0.5
    w2 = torch.randn(experts // ep, H, I, generator=g) * I ** -0.5
    return quantize_expert_weights(w1, w2, "mxfp4", gate_up_layout="interleaved")


def reference(w, x, ids, tw, limit=None):
    """fp32 MoE on the dequantised weights (all experts local: ep 1)."""
    w1 = MXTensor(w.w1, w.w1_scale, "fp4").dequantize()
    w2 = MXTensor(w.w2, w.w2_scale, "fp4").dequantize()
    return fp32_reference_moe(x, ids, tw, w1, w2, gate_up_layout="interleaved", swiglu_limit=limit)


def inputs(t=5, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g), torch.randint(0, E, (t, K), generator=g), torch.rand(t, K, generator=g)


def calls(log, name):
    return [c for c in log if c[0] == name]


def on_arch(fakes, monkeypatch, arch: str):
    """Fake aiter on ``arch``; on gfx1250 with AITER_FORCE_A8W4=1 (A8W4, the fp8 wire these tests use), the
    MegaMoEGfx1250 that has dispatch_wire / combine_quant (yhl-amd/aiter 22f2e2dc) and a mori whose
    dispatch carries the per-token scale row (ROCm/mori#593), which its quantised wires need."""
    from rocm_helpers import use_scale_row_mori

    fakes.aiter.reset(arch)
    if arch == "gfx1250":
        monkeypatch.setenv("AITER_FORCE_A8W4", "1")  # aiter's fused_moe reads it per call
        mod = fakes.aiter.ops.flydsl.kernels.mega_moe_gfx1250
        monkeypatch.setattr(mod, "MegaMoEGfx1250", mod.MegaMoEGfx1250_22f2e2dc)
        use_scale_row_mori(fakes, monkeypatch)
    return fakes
