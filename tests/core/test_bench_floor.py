"""benchmarks/floor.py: the floor of an experts forward, against numbers worked out by hand for DSV4-Pro
(hidden 7168, intermediate 3072, top-6), and the benches' use of it (which peak each scheme gets)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_experts import case_floors
from benchmarks.floor import (
    H100_PCIE,
    H100_SXM,
    H200_SXM,
    datasheet_for,
    datasheet_of,
    expert_floor,
    experts_hit,
    experts_hit_by_rank,
    mma_kind,
    weight_bytes_per_expert,
)

H, I, TOPK = 7168, 3072, 6  # noqa: E741 - the spec's names
H200 = dict(hbm_bytes_per_s=H200_SXM.hbm_bytes_per_s, mma_flops_per_s=H200_SXM.mma_flops_per_s)

# One DSV4-Pro expert in MXFP4: 3 x 7168 x 3072 = 66,060,288 weights; 4 bits each = 33,030,144 B,
# plus one E8M0 byte per 32 = 2,064,384 B: 35,094,528 B.
MXFP4_EXPERT_BYTES = 35_094_528


def test_mxfp4_and_bf16_expert_bytes():
    assert weight_bytes_per_expert(H, I, "mxfp4") == MXFP4_EXPERT_BYTES
    assert weight_bytes_per_expert(H, I, "bf16") == 132_120_576  # 66,060,288 x 2


def test_decode_192_experts_8_tokens_is_hbm_bound():
    # EP2's share, 8 tokens x top-6 = 48 pairs hitting 45 experts (the committed bench's routing):
    # weights 45 x 35,094,528 = 1,579,253,760 B / 4.8e12 B/s = 329.0112 us;
    # FLOPs 6 x 48 x 7168 x 3072 = 6,341,787,648 / 1978.9e12 = 3.2047 us on the FP8 MMA.
    f = expert_floor(experts_hit=45, pairs=8 * TOPK, hidden=H, intermediate=I, weight_fmt="mxfp4", a_fmt="fp8", **H200)
    assert f.bound == "hbm" and f.mma == "fp8"
    assert f.hbm_us == pytest.approx(329.0112, rel=1e-9)
    assert f.mma_us == pytest.approx(3.2047, abs=1e-4)
    assert f.us == f.hbm_us


def test_prefill_48_experts_8192_tokens_is_fp8_bound():
    # EP8's share, 8192 tokens x top-6 = 49,152 pairs, all 48 experts hit:
    # FLOPs 6 x 49,152 x 7168 x 3072 = 6,493,990,551,552 / 1978.9e12 = 3281.616 us (FP8 MMA),
    # weights 48 x 35,094,528 = 1,684,537,344 B / 4.8e12 = 350.945 us. On the bf16 peak (989.4e12)
    # the MMA would take 6563.564 us: what the benches reported before, for the same A8W4 forward.
    for a_fmt in ("fp8", "fp4"):  # A8W4 and A4W4: both run e4m3 x e4m3 on Hopper (no FP4 MMA)
        f = expert_floor(experts_hit=48, pairs=8192 * TOPK, hidden=H, intermediate=I, weight_fmt="mxfp4", a_fmt=a_fmt,
                         **H200)
        assert f.bound == "mma" and f.mma == "fp8"
        assert f.us == f.mma_us == pytest.approx(3281.616, abs=1e-3)
        assert f.hbm_us == pytest.approx(350.94528, rel=1e-9)
    bf16_a = expert_floor(experts_hit=48, pairs=8192 * TOPK, hidden=H, intermediate=I, weight_fmt="mxfp4", a_fmt=None,
                          **H200)
    assert bf16_a.mma == "bf16" and bf16_a.us == pytest.approx(6563.564, abs=1e-3)


def test_peak_follows_the_operands():
    assert mma_kind("mxfp4", "fp8") == mma_kind("mxfp4", "fp4") == "fp8"
    assert mma_kind("mxfp4", None) == "bf16"  # A16W4: bf16 rows, weights widened to bf16
    assert mma_kind("bf16", "fp8") == "bf16"  # bf16 weights do not fit an FP8 MMA as they are
    with pytest.raises(ValueError, match="activation format"):
        mma_kind("mxfp4", "int8")
    with pytest.raises(ValueError, match="weight format"):
        weight_bytes_per_expert(H, I, "nvfp4")
    with pytest.raises(ValueError, match="no fp8 MMA peak"):
        expert_floor(experts_hit=1, pairs=6, hidden=H, intermediate=I, weight_fmt="mxfp4", a_fmt="fp8",
                     hbm_bytes_per_s=4.8e12, mma_flops_per_s={"bf16": 989.4e12})


def test_experts_hit_total_and_by_rank():
    ids = torch.tensor([[0, 5], [5, 9], [11, 0]])  # 4 ranks x 3 experts: ids 0, 5, 9, 11
    assert experts_hit(ids) == 4
    assert experts_hit_by_rank(ids, experts_per_rank=3, ranks=4) == [1, 1, 0, 2]
    assert experts_hit_by_rank(torch.tensor([], dtype=torch.int64), experts_per_rank=3, ranks=2) == [0, 0]
    with pytest.raises(ValueError, match="outside"):
        experts_hit_by_rank(ids, experts_per_rank=3, ranks=3)


def test_bench_cases_get_the_peak_of_their_scheme():
    """bench experts' cases: A8W4 against the FP8 peak, the bf16 torch baseline against bf16; the
    measured floor uses the run's ceilings, and is NaN where the run measured none."""
    from benchmarks.bench_experts import Case, fill_metrics

    ceilings = {"measured_copy_tbs": 4.0, "measured_bf16_gemm_tflops": 700.0, "measured_fp8_gemm_tflops": 1400.0}
    a8w4 = Case(48, 8192, 8192 * TOPK, "a8w4", "triton", active_experts=48, us=6563.232656)
    fill_metrics(a8w4, H, I, "mxfp4", "fp8", ceilings)
    assert (a8w4.floor_peak, a8w4.floor_bound) == ("fp8", "mma")
    assert a8w4.floor_us == a8w4.floor_fp8_us == pytest.approx(3281.616, abs=1e-3)
    assert a8w4.floor_bf16_us == pytest.approx(6563.564, abs=1e-3)
    assert a8w4.x_floor == pytest.approx(2.0, abs=1e-4)
    assert a8w4.mma_peak_frac == pytest.approx(0.5, abs=1e-4)
    assert a8w4.floor_measured_us == pytest.approx(6_493_990_551_552 / 1400e6)  # FP8-bound on the measured GEMM too

    base = Case(48, 8192, 8192 * TOPK, "bf16", "torch_grouped_mm", active_experts=48, us=13127.0)
    fill_metrics(base, H, I, "bf16", None, {})
    assert base.floor_peak == "bf16" and base.floor_us == pytest.approx(6563.564, abs=1e-3)
    assert base.floor_measured_us != base.floor_measured_us  # NaN: nothing measured


def test_the_floor_follows_the_card_the_run_is_on():
    """An H100 run printed its floors at the H200's 4.8 TB/s (2026-12-06): the datasheet now comes from
    the card's name, is recorded in meta.ceilings, and the floor is read back from there; a JSON from
    before (no datasheet fields) was an H200 run. Mutation run once: case_floors on the H200's sheet
    regardless of ``ceilings`` fails the H100 line (502.8 us at 3.35 TB/s, not 350.9)."""
    assert datasheet_for("NVIDIA H100 80GB HBM3") is H100_SXM and datasheet_for("NVIDIA H100 PCIe") is H100_PCIE
    assert datasheet_for("NVIDIA H200") is H200_SXM
    other = datasheet_for("NVIDIA A100-SXM4-80GB")
    assert "no datasheet here for 'NVIDIA A100-SXM4-80GB'" in other.name and other.hbm_bytes_per_s == 4.8e12
    h100 = H100_SXM.ceilings()
    assert h100["datasheet"] == "H100 SXM" and h100["hbm_tbs"] == 3.35 and datasheet_of(h100) == H100_SXM
    assert datasheet_of({}) is H200_SXM and datasheet_of({"measured_copy_tbs": 3.0}) is H200_SXM
    # 48 experts hit at 8 tokens: 48 x 35,094,528 B = 1,684,537,344 B -> 350.9 us at 4.8 TB/s, 502.8 at 3.35
    shape = dict(experts_hit=48, pairs=8 * TOPK, hidden=H, intermediate=I, weight_fmt="mxfp4", a_fmt="fp8")
    assert case_floors(h100, **shape)["floor_us"] == pytest.approx(1_684_537_344 / 3.35e12 * 1e6, rel=1e-9)
    assert case_floors({}, **shape)["floor_us"] == pytest.approx(1_684_537_344 / 4.8e12 * 1e6, rel=1e-9)
