"""The MEGA_EXPERTS_GEMM knob and the sm_90a CUDA GEMMs' build (experts/cuda) on a machine without a GPU."""

from __future__ import annotations

import pytest

from megamoe_backend.experts.cuda import jit
from megamoe_backend.experts.cuda.gemms import describe_choice
from megamoe_backend.knobs import KnobError, Knobs


def test_knob_values():
    assert Knobs.from_env({}).experts_gemm == "auto"
    assert Knobs.from_env({"MEGA_EXPERTS_GEMM": "CUDA"}).experts_gemm == "cuda"
    with pytest.raises(KnobError, match="MEGA_EXPERTS_GEMM"):
        Knobs.from_env({"MEGA_EXPERTS_GEMM": "cutlass"})


def test_info_line_names_what_runs():
    assert describe_choice("auto", "triton", "cuda").startswith("Triton (auto")
    assert describe_choice("triton", "triton", "cuda").startswith("Triton")
    assert "unavailable" in describe_choice("cuda", "triton", "cpu")  # this machine has no GPU
    assert describe_choice("cuda", "torch", "cpu").startswith("torch provider")


def test_wrappers_cover_every_token_side():
    src = jit.full_source()
    for n in jit.WGMMA_NS:
        assert f"m64n{n}k32.f32.e4m3.e4m3" in src and f"mm_wgmma_rs<{n}>" in src
    assert jit.full_source(("MM_STAGES=5",)).startswith("#define MM_STAGES 5\n")


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGA_CUDA_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="nvcc"):
        jit.build(nvcc=str(tmp_path / "no-such-nvcc"))


@pytest.mark.skipif(jit.nvcc_path() is None, reason="no nvcc on this machine: the sm_90a build is checked where one is")
def test_builds_for_sm90a_without_spills_and_caches(tmp_path, monkeypatch):
    """nvcc needs no GPU to build sm_90a code: the kernels compile, ptxas reports no spill (the producer
    spilled at 40 / 56 registers before its addresses were hoisted), and the second build is the cache's."""
    monkeypatch.setenv("MEGA_CUDA_CACHE_DIR", str(tmp_path))
    first = jit.build()
    assert first.compiled and first.cubin.exists() and first.cubin.parent == tmp_path
    spills = [line for line in first.ptxas_log.splitlines() if "spill stores" in line]
    assert len(spills) == 2 and all(line.strip().startswith("0 bytes stack frame, 0 bytes spill stores") for line in spills), spills
    assert "serialized" not in first.ptxas_log  # ptxas would say so if the wgmmas could not stay in flight
    again = jit.build()
    assert again.cubin == first.cubin and not again.compiled
