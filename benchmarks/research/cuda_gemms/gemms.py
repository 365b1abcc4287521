"""The sm_90a frag8 GEMMs (frag8_sm90.cu) as two launch calls with the Triton frag8 launches' arguments.

``Sm90Frag8Gemms.for_device`` builds (jit.py) and loads (driver.py) the kernels once per device, or
returns the reason they cannot run (not an sm_90 GPU, no nvcc, a failed build), which
experts.CudaFrag8Experts raises. The layout they read must use ``BLOCK_M`` token rows per tile and
no short tiles. Research code (experts.py says why it left the package).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from . import jit
from .driver import Kernel, get_function, load_module

log = logging.getLogger("megamoe")

BLOCK_M = 128  # token rows per tile (frag8_sm90.cu BM): the layout's block_m
BLOCK_N = 256  # weight rows per CTA (BN, MM_BN): GEMM1's 2 * intermediate and GEMM2's hidden must be multiples
BLOCK_K = 128
STAGES = 4  # MM_STAGES
PRODUCER_THREADS = 128


def smem_bytes(stages: int = STAGES, block_n: int = BLOCK_N) -> int:
    """Dynamic shared memory of one CTA: the stage ring (each stage 1024-byte aligned), its mbarriers,
    the row table, alignment slack."""
    stage = -(-(BLOCK_M * BLOCK_K + (block_n // 16) * (2 * 512 + 64)) // 1024) * 1024
    return stages * stage + 2 * stages * 8 + BLOCK_M * 4 + 1024


def _define(defines: tuple[str, ...], name: str, default: int) -> int:
    return next((int(d.split("=")[1]) for d in defines if d.startswith(name + "=")), default)


GROUP_M = 4
OUT_FMT = {"f32": 0, "bf16": 1, "fp8": 2}
A2_FMT = {"fp8": 0, "fp4": 1}


class Params(ctypes.Structure):
    """mm::Params of frag8_sm90.cu, field for field (same order, C layout)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "tile_expert", "row_map", "a", "a_scale", "w_words", "w_fold", "w_row_scale", "route_w", "out", "out_scale", "dest",
    )] + [(name, ctypes.c_int64) for name in (
        "stride_am", "w_words_stride_e", "w_fold_stride_e", "w_rs_stride_e", "stride_om", "stride_osm", "seg_pairs",
        "seg_row_bytes",
    )] + [(name, ctypes.c_int32) for name in (
        "num_m_tiles", "n_tiles", "group_m", "K", "N", "fmt", "dest_mode", "has_limit",
    )] + [("limit", ctypes.c_float)]


def shapes_supported(hidden: int, inter: int) -> bool:
    """GEMM1 (N = 2 * inter, K = hidden) and GEMM2 (N = hidden, K = inter) in whole CTA tiles and K steps."""
    return (2 * inter) % BLOCK_N == 0 and hidden % BLOCK_N == 0 and hidden % BLOCK_K == 0 and inter % BLOCK_K == 0


@dataclass
class Sm90Frag8Gemms:
    gemm1_kernel: Kernel
    gemm2_kernel: Kernel
    build: jit.Build
    block_n: int = BLOCK_N

    _by_device = {}  # documented cache: device index -> Sm90Frag8Gemms, or the reason it is unavailable (str)

    @classmethod
    def for_device(cls, device: torch.device) -> "Sm90Frag8Gemms | str":
        """The loaded kernels for ``device``, or why they cannot run there (logged once per device)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in cls._by_device:
            cls._by_device[index] = cls._load(torch.device("cuda", index))
            got = cls._by_device[index]
            if isinstance(got, str):
                log.warning("megamoe: sm_90a CUDA expert GEMMs unavailable on cuda:%d (%s)", index, got)
            elif got.build.compiled:
                log.info("megamoe: built the sm_90a CUDA expert GEMMs in %.1f s (%s)", got.build.seconds, got.build.cubin)
        return cls._by_device[index]

    @classmethod
    def _load(cls, device: torch.device, defines: tuple[str, ...] = ()) -> "Sm90Frag8Gemms | str":
        if torch.version.hip is not None or not torch.cuda.is_available():
            return "not a CUDA build of torch"
        cap = torch.cuda.get_device_capability(device)
        if cap != (9, 0):
            return f"compute capability {cap[0]}.{cap[1]}, the kernels are sm_90a (Hopper) only"
        try:
            built = jit.build(defines=defines)
            module = load_module(built.cubin, device)
            block_n = _define(defines, "MM_BN", BLOCK_N)
            smem = smem_bytes(_define(defines, "MM_STAGES", STAGES), block_n)
            threads = block_n + PRODUCER_THREADS  # a consumer warpgroup per 128 weight rows + the producer's
            k1 = Kernel(get_function(module, "mm_frag8_gemm1"), "mm_frag8_gemm1", threads, smem)
            k2 = Kernel(get_function(module, "mm_frag8_gemm2"), "mm_frag8_gemm2", threads, smem)
        except (RuntimeError, OSError) as exc:
            return str(exc).splitlines()[0][:300]
        return cls(k1, k2, built, block_n)

    def gemm1(self, layout, a8: torch.Tensor, a_rs: torch.Tensor, w_words: torch.Tensor, w_fold: torch.Tensor,
              w_rs: torch.Tensor, a2: torch.Tensor, a2_scale: torch.Tensor, hidden: int, inter: int, a_fmt: str,
              limit: float | None) -> None:
        """GEMM1 + SwiGLU (+ clamp) -> A2 in ``a_fmt`` (MX per 1x32, sorted rows), as gemm1_swiglu_kernel."""
        p = Params()
        p.tile_expert, p.row_map = layout.tile_expert.data_ptr(), layout.sorted_row.data_ptr()
        p.a, p.a_scale, p.stride_am = a8.data_ptr(), a_rs.data_ptr(), a8.stride(0)
        self._weights(p, w_words, w_fold, w_rs)
        p.out, p.out_scale, p.stride_om, p.stride_osm = a2.data_ptr(), a2_scale.data_ptr(), a2.stride(0), a2_scale.stride(0)
        p.K, p.N, p.fmt = hidden, 2 * inter, A2_FMT[a_fmt]
        p.has_limit, p.limit = int(limit is not None), float(limit) if limit is not None else 0.0
        self._launch(self.gemm1_kernel, p, layout, a8.device)

    def gemm2(self, layout, a2e: torch.Tensor, a2_rs: torch.Tensor, w_words: torch.Tensor, w_fold: torch.Tensor,
              w_rs: torch.Tensor, route_w: torch.Tensor, out: torch.Tensor, stride_om: int, dest_mode: int,
              dest: torch.Tensor, seg_pairs: int, seg_row_bytes: int, hidden: int, inter: int, out_fmt: str) -> None:
        """GEMM2 x route weight -> each pair's row of ``out`` (fp32 / bf16 / fp8 wire; gemm2._row_offsets' DEST modes)."""
        p = Params()
        p.tile_expert, p.row_map = layout.tile_expert.data_ptr(), layout.sorted_pair.data_ptr()
        p.a, p.a_scale, p.stride_am = a2e.data_ptr(), a2_rs.data_ptr(), a2e.stride(0)
        self._weights(p, w_words, w_fold, w_rs)
        p.route_w, p.out, p.stride_om = route_w.data_ptr(), out.data_ptr(), stride_om
        p.dest, p.dest_mode, p.seg_pairs, p.seg_row_bytes = dest.data_ptr(), dest_mode, max(1, seg_pairs), seg_row_bytes
        p.K, p.N, p.fmt = inter, hidden, OUT_FMT[out_fmt]
        self._launch(self.gemm2_kernel, p, layout, route_w.device)

    @staticmethod
    def _weights(p: Params, w_words: torch.Tensor, w_fold: torch.Tensor, w_rs: torch.Tensor) -> None:
        p.w_words, p.w_words_stride_e = w_words.data_ptr(), w_words.stride(0)
        p.w_fold, p.w_fold_stride_e = w_fold.data_ptr(), w_fold.stride(0)
        p.w_row_scale, p.w_rs_stride_e = w_rs.data_ptr(), w_rs.stride(0)

    def _launch(self, kernel: Kernel, p: Params, layout, device: torch.device) -> None:
        if layout.block_m != BLOCK_M:
            raise ValueError(f"the sm_90a GEMMs read {BLOCK_M}-row layout tiles, got block_m={layout.block_m}")
        p.num_m_tiles, p.n_tiles, p.group_m = layout.num_tiles, p.N // self.block_n, GROUP_M
        kernel.launch(layout.num_tiles * p.n_tiles, p, torch.cuda.current_stream(device).cuda_stream)

