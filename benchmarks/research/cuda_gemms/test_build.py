"""The sm_90a CUDA GEMMs' build (jit.py) on any machine: the generated wgmma wrappers, a missing
compiler, and (where nvcc is installed; no GPU needed) a spill-free sm_90a build that caches.

    PYTHONPATH=.:benchmarks/research python3 -m pytest benchmarks/research/cuda_gemms/test_build.py -q
"""

from __future__ import annotations

import pytest

from cuda_gemms import jit


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


def test_the_research_provider_raises_where_its_kernels_cannot_run():
    """No fallback: on a CPU tensor the forward refuses before any launch, naming why."""
    import torch

    from megamoe_backend.experts import ExpertMath, ExpertPairs, quantize_expert_weights
    from megamoe_backend.formats import quantize_mx

    from cuda_gemms.experts import CudaFrag8Experts

    g = torch.Generator().manual_seed(0)
    w = quantize_expert_weights(torch.randn(2, 512, 256, generator=g), torch.randn(2, 256, 256, generator=g), "mxfp4")
    math = ExpertMath("a8w4", 10.0)
    prov = CudaFrag8Experts()
    pairs = ExpertPairs(torch.arange(4), torch.tensor([0, 1, 0, 1]), torch.ones(4))
    with pytest.raises(RuntimeError, match="the sm_90a CUDA expert GEMMs cannot run .*(interpreter|CUDA device)"):
        prov.forward(quantize_mx(torch.randn(4, 256, generator=g), "fp8"), pairs, prov.prepare_weights(w, math), math)
