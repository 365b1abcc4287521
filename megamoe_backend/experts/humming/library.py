"""humming-kernels behind a small adapter: the one module that imports ``humming``.

Why one module: humming's API is young (0.1.x), and importing it has side effects (it registers torch
library ops, loads its native launcher) and needs ``cuda-bindings``. Everything the provider asks of it
goes through here, in the terms vLLM 0.34 uses it (``fused_moe/experts/fused_humming_moe.py``,
``quantization/utils/humming/moe.py``):

- weights: ``prepare_and_transform_humming_tensors`` with an MXFP4 weight schema (e2m1, E8M0 per 32) and an
  FP8 input schema (e4m3, one dynamic fp32 scale per token row). On Hopper that is humming's fused-E8M0
  W4A8 path: each block scale is folded into the weights' e4m3 conversion as an exponent offset from its
  row's reference, and one scale per weight row ("channel" weight_scale_2) is applied in the epilogue.
  The channel form is forced (vLLM's transform picks it only when a tensor-wide range would round): every
  rank then holds the same layout, so an engine's EPLB can move an expert's rows between ranks.
- block-FP8 weights (DeepSeek V3 / R1 FP8 checkpoints, ``transform_block_fp8``): e4m3 with humming's 128 x 128
  block-scale type (fp32 scales, its SM90 policies overlap the per-block promotion with the next MMAs) and FP8 A
  in 1 x 128 groups: vLLM's ``(kFp8Static128BlockSym, kFp8Dynamic128Sym)`` pair, without the per-row bf16
  expansion of the scales vLLM's fp8 schema makes (so the layer keeps the checkpoint's scale tensors' shapes).
- kernels: ``get_heuristics_config`` gives a list of (lo, hi, tuning) buckets of the valid row count M;
  ``HummingKernel.prepare_kernels`` compiles all of them (NVRTC, cached on disk) at once, at layer build;
  ``launch_kernel`` picks the bucket on the host from ``valid_shape_m`` at each call (a CUDA graph keeps
  the one it captured). The indexed GEMM reads A row ``sorted_ids[r] // top_k`` and writes C row
  ``sorted_ids[r]`` for the ``num_tokens_padded[0]`` sorted rows (read on the device: a persistent grid
  walks those tiles only), each BLOCK_M-row tile with the weights of ``expert_ids[tile]``; a sorted id
  past ``shape_m * top_k`` (the layout's padding, -1 as uint32) is neither read nor written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

KNOB_FIX = "set MEGA_EXPERTS_GEMM=triton to run the project's Triton GEMMs instead"
HEADERS_FIX = ("humming-kernels JIT-compiles its kernels with NVRTC against the CUDA headers: install them "
               "(pip install 'humming-kernels[cu13]' brings cuda-toolkit's; or nvidia-cuda-cccl / a CUDA toolkit) "
               "or point CUDA_HOME at a CUDA toolkit")
COMPUTE = {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"}
LOCKS_PER_SM = 16  # stream-K locks: vLLM sizes 8 a SM (vllm/utils/humming.py); humming checks ~1.1 x CTAs x locks a tile


def probe(device) -> str | None:
    """Why humming-kernels cannot run on ``device``, or None: its import, then the CUDA headers its NVRTC
    JIT needs (humming's own search: /usr/local/cuda*, CUDA_HOME, CUDA_PATH, pip's nvidia packages)."""
    try:
        import humming  # noqa: F401
        from humming.utils.cuda import filter_cuda_paths
    except Exception as exc:  # ImportError, a missing cuda-bindings, a native launcher that does not load
        return f"import humming failed ({type(exc).__name__}: {exc})"
    try:
        filter_cuda_paths(required_headers=["cuda_runtime.h"])
    except RuntimeError as exc:
        return f"no CUDA headers for its NVRTC JIT ({exc}); {HEADERS_FIX}"
    return None


def _humming():
    """The humming modules this adapter calls, imported on first use."""
    import humming
    from humming import dtypes, ops
    from humming.kernel.humming import HummingKernel
    from humming.schema import HummingInputSchema, HummingWeightSchema
    from humming.transform import prepare_layer_config, transform_humming_tensors
    from humming.tune import get_heuristics_config

    return humming, dtypes, ops, HummingKernel, HummingInputSchema, HummingWeightSchema, prepare_layer_config, \
        transform_humming_tensors, get_heuristics_config


def version() -> str:
    return _humming()[0].__version__


@dataclass
class Sublayer:
    """One GEMM of the experts (w13: N = 2I gate/up rows, K = H; w2: N = H, K = I) as humming runs it:
    its LayerConfig (JSON), the tuning buckets and the compiled kernels' launch table (``jit``), and the
    shapes / dtypes of humming's tensors, which the layer keeps as views of ExpertWeights' fields."""

    name: str
    layer_config: str
    tuning: list  # [[lo, hi, tuning config], ...] over the valid row count M
    weight_shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    scale_dtype: torch.dtype
    configs: torch.Tensor | None = None  # int64 [4 x buckets] (lo, hi, kernel id, SMs): launch_kernel's table

    @property
    def compute(self) -> str:
        return json.dumps(COMPUTE)

    def block_m(self, valid_m: int) -> int:
        """The tile height of the kernel launch_kernel picks for ``valid_m`` rows (its rule: lo < M <= hi, hi <= 0
        meaning no upper end); the sorted layout must be padded per expert to this height."""
        for lo, hi, cfg in self.tuning:
            if lo < valid_m <= (hi if hi > 0 else 1 << 30):
                return int(cfg["block_shape"][0])
        raise ValueError(f"humming {self.name}: no tuning bucket holds M={valid_m} ({[t[:2] for t in self.tuning]})")

    def block_ms(self) -> tuple[int, ...]:
        return tuple(sorted({int(cfg["block_shape"][0]) for _, _, cfg in self.tuning}))

    def jit(self, device: torch.device) -> int:
        """Compile (or load from humming's disk cache) every bucket's kernel; returns how many."""
        HummingKernel = _humming()[3]
        with torch.cuda.device(device):
            self.configs = HummingKernel.prepare_kernels(self.layer_config, self.compute, json.dumps(self.tuning), device)
        return self.configs.numel() // 4

    def gemm(self, a, a_scale, weight, scale, scale2, out, sorted_ids, expert_ids, padded_rows, locks, top_k: int,
             valid_m: int) -> None:
        """C[sorted_ids[r]] = a_scale[id // top_k] * (A[id // top_k] . W[expert_ids[r // BM]]) in bf16 (humming's
        indexed GEMM; module docstring), for the padded_rows[0] sorted rows."""
        ops = _humming()[2]
        ops.launch_kernel(
            configs=self.configs, inputs=a, weight=weight.view(torch.int32).view(self.weight_shape),
            weight_scale=scale.view(self.scale_dtype).view(self.scale_shape), weight_scale_2=scale2,
            input_scale=a_scale, outputs=out, sorted_ids=sorted_ids, expert_ids=expert_ids,
            num_tokens_padded=padded_rows, locks=locks, top_k=top_k, valid_shape_m=valid_m)


def transform(name: str, packed: torch.Tensor, scales: torch.Tensor, chunk: int = 8):
    """MXFP4 [E, N, K/2] uint8 (even K in the low nibble) + E8M0 [E, N, K/32] -> (Sublayer, weight, scale,
    scale2): humming's repacked weight and folded scale offsets as uint8 tensors of the input shapes (the
    same bytes: 4 bits a weight, 1 byte a block) and the bf16 [E, N] row scales. ``chunk`` experts at a
    time (each row's transform is its own in the channel form), so the peak beside the result is a chunk's
    temporaries, not the layer's."""
    _, dtypes, _, _, InputSchema, WeightSchema, *_ = _humming()
    weight_schema = WeightSchema(b_dtype=dtypes.float4e2m1, bs_dtype=dtypes.float8e8m0, weight_scale_group_size=32,
                                 weight_scale_2_type="channel")
    input_schema = InputSchema(a_dtype=dtypes.float8e4m3, input_quant_mode="dynamic_token")

    def check(full):
        if not full.use_fused_e8m0_scale:  # the W4A8 path this adapter is written for (humming's Hopper FP8 path)
            raise RuntimeError(f"humming {name}: expected its fused-E8M0 W4A8 layout on this GPU (sm_{full.sm_version})")

    return _transform(name, packed, packed.shape[2] * 2, {"weight": packed, "weight_scale": scales.view(torch.float8_e8m0fnu)},
                      scales, weight_schema, input_schema, check, chunk, row_scales=True)


def transform_block_fp8(name: str, weight: torch.Tensor, scales: torch.Tensor, chunk: int = 8):
    """Block-FP8 e4m3 [E, N, K] + fp32 [E, N/128, K/128] (one scale per 128 x 128 block, the checkpoint's) ->
    (Sublayer, weight, scale, None): humming's repacked e4m3 bytes and its order of the block scales, in the
    input shapes and dtypes (one copy). humming's schema for DeepSeek V3 / R1 FP8 experts with FP8 activations
    in 1 x 128 groups (vLLM's ``(kFp8Static128BlockSym, kFp8Dynamic128Sym)``): e4m3 weights, fp32 block scales
    (``weight_scale_type`` block, 128 x 128), e4m3 A with one dynamic fp32 scale per 1 x 128 group."""
    _, dtypes, _, _, InputSchema, WeightSchema, *_ = _humming()
    weight_schema = WeightSchema(b_dtype=dtypes.float8e4m3, bs_dtype=dtypes.float32, weight_scale_group_size=128,
                                 weight_scale_group_size_n=128, weight_scale_type="block")
    input_schema = InputSchema(a_dtype=dtypes.float8e4m3, input_scale_group_size=128, input_scale_dtype=dtypes.float32,
                               input_quant_mode="dynamic_group")

    def check(full):
        if not full.is_block_weight_scale:
            raise RuntimeError(f"humming {name}: expected its 128 x 128 block-scale layout, got {full.weight_scale_type}")

    scales = scales.float()
    return _transform(name, weight, weight.shape[2], {"weight": weight, "weight_scale": scales}, scales, weight_schema,
                      input_schema, check, chunk, row_scales=False)


def _transform(name, weight, k: int, tensors: dict, scales, weight_schema, input_schema, check, chunk: int,
               row_scales: bool):
    """The sublayer's tensors through humming's transform, ``chunk`` experts at a time, written back into tensors
    of the shapes and dtypes of ``weight`` and ``scales`` (humming's layouts keep their byte counts; a transform that changes them is
    an error, not a second copy); (Sublayer, weight, scale, bf16 [E, N] row scales or None)."""
    *_, prepare_layer_config, transform_tensors, heuristics = _humming()
    e, n = weight.shape[0], weight.shape[1]
    device = weight.device
    with torch.cuda.device(device):
        def config(experts: int):
            return prepare_layer_config(shape_n=n, shape_k=k, weight_schema=weight_schema, input_schema=input_schema,
                                        num_experts=experts, torch_dtype=torch.bfloat16, device=device)

        full = config(e)
        check(full)
        w_out = torch.empty_like(weight)
        s_out = torch.empty_like(scales)
        scale2 = torch.empty(e, n, dtype=torch.bfloat16, device=device) if row_scales else None
        part = out = None
        for e0 in range(0, e, chunk):
            e1 = min(e, e0 + chunk)
            part = part if part is not None and part.num_experts == e1 - e0 else config(e1 - e0)
            out = transform_tensors(part, {"weight": tensors["weight"][e0:e1].contiguous().view(torch.int32),
                                           "weight_scale": tensors["weight_scale"][e0:e1].contiguous()})
            for got, dst, what in ((out["weight"], w_out, "weight"), (out["weight_scale"], s_out, "weight_scale")):
                if got.numel() * got.element_size() != dst[e0:e1].numel() * dst.element_size():
                    raise RuntimeError(f"humming {name}: its {what} layout has {got.numel() * got.element_size()} bytes "
                                       f"for {e1 - e0} experts, the input {dst[e0:e1].numel() * dst.element_size()}")
                dst[e0:e1].view(-1).view(torch.uint8).copy_(got.reshape(-1).view(torch.uint8))
            if row_scales:
                scale2[e0:e1].copy_(out["weight_scale_2"].reshape(e1 - e0, n))
            elif out.get("weight_scale_2") is not None:
                raise RuntimeError(f"humming {name}: unexpected weight_scale_2 for block scales")
        tuning = heuristics(full, gemm_type="indexed", device=device)
    layer = Sublayer(name, full.to_str(), [list(t) for t in tuning], (e, *out["weight"].shape[1:]),
                     (e, *out["weight_scale"].shape[1:]), out["weight_scale"].dtype)
    return layer, w_out, s_out, scale2


def jit(sublayers, device: torch.device) -> tuple[int, float]:
    """Compile every sublayer's kernels before the first forward (the layer's build, ahead of any bounded
    wait of a peer); (kernels, seconds). A failure names the knob and the fix."""
    start = time.perf_counter()
    try:
        kernels = sum(s.jit(device) for s in sublayers)
    except Exception as exc:
        raise RuntimeError(f"[megamoe] humming-kernels could not compile its kernels ({type(exc).__name__}: {exc}); "
                           f"{HEADERS_FIX}; or {KNOB_FIX}") from exc
    return kernels, time.perf_counter() - start


def locks(device: torch.device) -> torch.Tensor:
    """Zeroed stream-K locks (humming's kernels leave them zero), one set per device."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms * LOCKS_PER_SM, dtype=torch.int32, device=device)
