"""TritonExperts: the ``triton`` experts provider (NVIDIA; portable Triton).

Same contract as TorchReferenceExperts (experts/base.py): received rows (bf16, or the MXTensor the
dispatch wire delivered), (row, slot, weight) pairs -> fp32 [P, H] route-weighted outputs per pair,
or (``forward_wire``, what the layer calls) those rows as combine wire rows written by GEMM2 itself.
A forward is five to eleven Triton launches (layout; A converted once per received row, unless bf16
rows feed frag as they are; GEMM1; frag8's A2 row re-scale; GEMM2; each GEMM twice when the tile
config has short tiles, three times with tail riders: ``tile_passes``) and a few sync-free torch ops,
so it can be CUDA-graph captured for a fixed pair count.
"""

from __future__ import annotations

import logging
from math import prod as math_prod

import torch
import triton

from ...formats import MX_BLOCK, MXTensor
from ...formats.wire import WireFormat
from ..base import Activations, ExpertMath, ExpertPairs, ExpertsProvider
from ..fragments import FP8_K
from ..live import LiveRows, SegmentDest
from ..scratch import ExpertsScratch, scratch_counters, scratch_empty
from ..weights import FRAGMENT_STORAGE, ExpertWeights
from . import triton_available
from .config import TileConfig, _table, default_config, interpreting, reduction_block
from .layout import max_tiles

DECODERS = ("auto", "frag8", "frag", "split", "dot_scaled", "manual")
FRAG_KIND = {"frag": "bf16", "frag8": "fp8"}  # fragment decoder -> the fragments.py kind it reads
STORAGE_OF = {d: FRAGMENT_STORAGE[k] for d, k in FRAG_KIND.items()}  # ... and that kind's storage name
# What "auto" resolves to for row-major MXFP4 weights on a CUDA GPU (H200 measurements in
# docs/triton.md); weights that went through prepare_weights() are in fragment order and use "frag8"
# (MX activations) or "frag".
GPU_DEFAULT_DECODER = "split"
# Who runs the frag8 GEMMs (MEGA_EXPERTS_GEMM / TritonExperts(gemm=...)): "triton" the Triton kernels;
# "cuda" the sm_90a CUDA kernels (experts/cuda: JIT-built with nvcc at first use; an error where they
# cannot run); "auto" the CUDA kernels on an sm_90 GPU where they build, in the buckets where they were
# measured faster (CUDA_AUTO_MIN_ROWS rows per local expert and up), else Triton; where they cannot
# build or load, one log line and Triton.
GEMMS = ("auto", "triton", "cuda")
# No bucket yet: on the H200 the CUDA kernels are correct (bit for bit the Triton GEMMs at DSV4-Pro
# shapes) but slower in every bucket measured (docs/triton.md, "The sm_90a CUDA GEMMs"), so auto keeps
# Triton and never builds them; MEGA_EXPERTS_GEMM=cuda opts in.
CUDA_AUTO_MIN_ROWS = float("inf")
_CUDA_FALLBACKS_LOGGED: set[str] = set()  # documented cache: reasons already logged (one line each per process)
log = logging.getLogger(__name__)
# The tile config of a forward on the CUDA GEMMs: only block_m (128-row layout tiles, no short tiles)
# and the K step reach the kernels; the weight tile is theirs (256 rows).
CUDA_CONFIG = TileConfig(block_m=128, block_n1=256, block_n2=256, block_k=128, num_warps=4, num_stages=4)


class TritonExperts(ExpertsProvider):
    """Grouped MX GEMMs in Triton.

    capacity: most (row, expert) pairs one forward may carry (e.g. MTPR x top-k x ep_size); a larger
        batch raises instead of dropping rows. None: no limit (eager use).
    decoder: how MXFP4 weights are decoded (mainloop.py): "frag8" (A8W4 / A4W4: FP8 tensor cores,
        weights re-laid as e4m3 MMA fragments with the block scales folded in by PRMT table lookups,
        activations over one scale per row; the fastest), "frag" (bf16 MMA register fragments, 13
        instructions per 8 weights, exact; any activations), "split" (PTX decode of row-major weights,
        A pre-split), "dot_scaled" (tl.dot_scaled), "manual" (explicit Triton decode), "auto" (what
        prepare_weights could re-lay the weights for: frag8, else frag, else split).
        Under TRITON_INTERPRET=1 frag and split run their portable decode; dot_scaled is unavailable.
    config: fixed TileConfig, else chosen per bucket by config.default_config.
    """

    name = "triton"

    def __init__(self, capacity: int | None = None, decoder: str = "auto", config: TileConfig | None = None,
                 gemm: str | None = None) -> None:
        if decoder not in DECODERS:
            raise ValueError(f"decoder={decoder!r}; expected one of {DECODERS}")
        if gemm is None:  # the knob (the layer builds its provider without the Knobs)
            from ...knobs.env import experts_gemm_from_env

            gemm = experts_gemm_from_env()
        if gemm not in GEMMS:
            raise ValueError(f"MEGA_EXPERTS_GEMM / gemm={gemm!r}; expected one of {GEMMS}")
        self.gemm = gemm
        self.last_gemm: str | None = None
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        self.capacity = capacity
        self.decoder = decoder
        self.config = config

    @classmethod
    def supports(cls, device: torch.device, math: ExpertMath, weights_fmt: str) -> bool:
        device = torch.device(device)
        if weights_fmt not in ("bf16", "mxfp4") or not triton_available():
            return False
        if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device) >= (9, 0)

    def prepare_weights(self, weights: ExpertWeights, math: ExpertMath | None = None) -> ExpertWeights:
        """MXFP4 weights -> fragment storage (once per layer, same memory plus one fp32 per row for
        frag8): FP8 MMA fragments (frag8) when ``math`` has MX activations (A8W4 / A4W4; what "auto"
        picks there, the fastest on H200 in every bucket), else bf16 MMA fragments (frag).

        decoder="auto" falls back to bf16 fragments when a row's block scales span more than frag8
        folds exactly, and to row-major weights (split decoder) when a shape or scale is outside what
        fragments handle (N % 16, K % 64, E8M0 scale range); decoder="frag" / "frag8" raise instead.
        """
        if weights.fmt != "mxfp4" or self.decoder not in ("auto", "frag", "frag8"):
            return weights
        if self.decoder == "auto" and torch.version.hip is not None:
            return weights
        if self.decoder == "frag8" and math is not None:
            _require_mx_activations(math)
        if self.decoder == "auto":
            kinds = ["fp8", "bf16"] if math is not None and _has_mx_activations(math) else ["bf16"]
        else:
            kinds = [FRAG_KIND[self.decoder]]
        for kind in kinds:
            try:
                return weights.as_fragments(kind)
            except ValueError:
                if self.decoder != "auto":
                    raise
        return weights

    def resolve_decoder(self, weights_fmt: str, storage: str = "rowmajor") -> str:
        """The mainloop DECODE mode for these weights on this backend."""
        if storage == STORAGE_OF["frag8"]:
            if self.decoder not in ("auto", "frag8"):
                raise ValueError(f"weights are in fp8 fragment storage (prepare_weights); decoder={self.decoder!r} cannot "
                                 "read them: use decoder='frag8' or pass weights.as_rowmajor()")
            return "frag8"
        if storage == STORAGE_OF["frag"]:
            if self.decoder not in ("auto", "frag"):
                raise ValueError(f"weights are in fragment storage (prepare_weights); decoder={self.decoder!r} reads row-major "
                                 "weights: use decoder='frag' or pass weights.as_rowmajor()")
            return "frag"
        if self.decoder == "dot_scaled" and interpreting():
            raise ValueError("decoder='dot_scaled' cannot run under TRITON_INTERPRET=1 (the interpreter lacks tl.dot_scaled)")
        if weights_fmt == "bf16":  # nothing to decode: plain bf16 MMA (dot_scaled path), manual in the interpreter
            return "manual" if interpreting() else "dot_scaled"
        if self.decoder == "auto":
            if interpreting():
                return "split"
            # the split decoder's inline PTX is NVIDIA-only; ROCm builds of Triton get tl.dot_scaled (untested here)
            return "dot_scaled" if torch.version.hip is not None else GPU_DEFAULT_DECODER
        if self.decoder in ("split", "frag", "frag8") and torch.version.hip is not None and not interpreting():
            raise ValueError(f"decoder={self.decoder!r} uses NVIDIA PTX; use 'dot_scaled' or 'manual' on ROCm")
        if self.decoder in ("frag", "frag8"):
            raise ValueError(f"decoder={self.decoder!r} reads weights in fragment storage: pass TritonExperts.prepare_weights(weights)")
        return self.decoder

    def forward(
        self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See ExpertsProvider.forward; ``out`` optionally supplies the fp32 [P, H] result buffer."""
        out = _result_buffer(out, len(pairs), weights.hidden, torch.float32, pairs.weight.device, "fp32 rows")
        return self._run(a, pairs, weights, math, out, "f32")

    def forward_wire(
        self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, wire: WireFormat,
        *, out: torch.Tensor | None = None, dest: torch.Tensor | SegmentDest | None = None, live: LiveRows | None = None,
        scratch: ExpertsScratch | None = None,
    ) -> torch.Tensor:
        """See ExpertsProvider.forward_wire: GEMM2's epilogue writes the combine wire row itself (bf16, or
        fp8 + E8M0 per 1x32 via the same block quantiser as quant.py), so the fp32 rows are never
        stored. ``out`` optionally supplies the uint8 [P, row_bytes] buffer (e.g. a transport's).

        ``dest`` (int64 [P]): pair p's row goes to byte ``dest[p]`` from ``out``'s first byte instead
        of row p of ``out`` (a transport's destination table: the device P2P forward points each row
        at its source rank's combine region; the experts never learn about ranks). ``out`` is then a
        flat uint8 base, and the table must keep every row inside memory the caller owns. A
        ``SegmentDest`` says the same per segment of pairs (experts/live.py), with no table to write.

        ``live`` (experts/live.py): only the rows at the head of each segment are live this forward
        (a count on the device); every kernel then runs a fixed grid that walks the live work only,
        and the tile config follows ``live.config_pairs`` (else it is picked on the device).

        ``scratch`` (experts/scratch.py): the intermediates live there, reserved for ``capacity`` pairs,
        so a forward allocates nothing once one has run (the layer's forwards pass their workspace's)."""
        if wire.mx not in (None, "fp8"):
            raise ValueError(f"combine wire {wire.name!r}: the Triton GEMM2 epilogue writes bf16 or fp8_blockwise_1x32 rows")
        if dest is None:
            out = _result_buffer(out, len(pairs), wire.row_bytes(weights.hidden), torch.uint8, pairs.weight.device,
                                 f"{wire.name} combine wire rows at hidden={weights.hidden}")
        else:
            _check_dest(dest, out, len(pairs), pairs.weight.device)
        if wire.mx is None:
            self._run(a, pairs, weights, math, out.view(torch.bfloat16), "bf16", dest, live, scratch)
        else:
            self._run(a, pairs, weights, math, out, "fp8", dest, live, scratch)
        return out

    def _run(
        self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, out: torch.Tensor, out_fmt: str,
        dest: torch.Tensor | SegmentDest | None = None, live: LiveRows | None = None, scratch: ExpertsScratch | None = None,
    ) -> torch.Tensor:
        """The forward proper; ``out`` is the checked [P, ...] result buffer GEMM2 writes in ``out_fmt``
        ("f32", or the combine wire: "bf16" / "fp8"; gemm2.py), or with ``dest`` the base its byte
        offsets count from. With ``live`` the A conversion runs once over the live rows, then each
        tile config candidate (tile_candidates) builds its layout and runs both GEMMs; a candidate the
        live pair count does not pick finds live_tiles = 0 and its launches exit at once."""
        from .gather import gather_split_kernel, rowscale_e4m3_kernel, rowscale_piece
        from .gemm1 import gemm1_swiglu_kernel
        from .gemm2 import gemm2_weighted_kernel
        from .layout import build_layout, capacity_reserve
        from .layout_kernels import live_rows_args
        from .quant import quantize_rows

        hidden, inter, n_exp = weights.hidden, weights.intermediate, weights.num_experts
        device = pairs.weight.device
        _check_weights(weights, device)
        _check_pairs(pairs)
        p = len(pairs)
        if self.capacity is not None and p > self.capacity:
            raise ValueError(
                f"{p} routed pairs exceed TritonExperts capacity {self.capacity} "
                "(MEGA_MAX_TOKENS_PER_RANK x top-k x ep_size); rows are never dropped: raise the capacity"
            )
        a_fmt = math.a_format or "bf16"
        x = _received_rows(a, math, hidden, device)
        n_recv = x.data.shape[0] if isinstance(x, MXTensor) else x.shape[0]
        # sizes at capacity (experts/scratch.py reserves them once): pairs, and received rows (pairs per row fixed)
        p_cap = max(p, self.capacity or 0)
        per_row = p // n_recv if p and n_recv else 0  # k in the layer's forwards; 0: no pairs to size rows by
        recv_cap = max(n_recv, p_cap // per_row) if per_row else n_recv

        def buf(name, shape, dtype, rows_cap):
            return scratch_empty(scratch, name, shape, dtype, device, rows_cap * math_prod(shape[1:]))

        if live is not None and p:
            _check_live(live, x, p, device)
        if a_fmt != "bf16" and not isinstance(x, MXTensor):  # bf16 wire: the receiver quantises (the live rows)
            qdata = buf("a_mx", (n_recv, hidden if a_fmt == "fp8" else hidden // 2), torch.uint8, recv_cap)
            qscale = buf("a_mx_scale", (n_recv, hidden // MX_BLOCK), torch.uint8, recv_cap)
            x = quantize_rows(x, a_fmt, name="received rows", out=(qdata, qscale), live=live,
                              programs=None if live is None else persistent_grid(device))
        if p == 0:
            return out

        mode = self.resolve_decoder(weights.fmt, weights.storage)
        cuda = self._cuda_gemms(mode, device, hidden, inter, p, n_exp, live)
        self.last_gemm = "triton" if cuda is None else "cuda"  # what the last forward ran (benchmarks label it)
        if cuda is not None:
            candidates = ((CUDA_CONFIG, ALL_COUNTS),)
        elif live is not None:
            candidates = tile_candidates(self.config, p // live.segments, n_exp, mode, live.config_pairs)
        else:
            candidates = ((self.config or default_config(p, n_exp, mode), ALL_COUNTS),)
        _check_candidates(candidates, mode, out_fmt, hidden, inter)
        use_asm = device.type == "cuda" and not interpreting()
        a_data, a_scale = _operand(x, a_fmt, mode == "dot_scaled")  # A once per received row: GEMM1 reads layout.sorted_row
        if n_recv == 0:
            raise ValueError(f"{p} routed pairs but no received rows: pairs.row must index the received rows")
        if pairs.row.device.type == "cpu" and (int(pairs.row.min()) < 0 or int(pairs.row.max()) >= n_recv):
            # checked where it costs no device synchronisation (as layout.py does for slots); the layer builds rows itself
            raise ValueError(f"pairs.row out of range [0, {n_recv}) of the received rows: "
                             f"min {int(pairs.row.min())}, max {int(pairs.row.max())}")
        bk1 = reduction_block(hidden, candidates[0][0].block_k)  # the split layout of A (one block_k: _check_candidates)
        persist = cuda is None and persistent_gemms(live, p, n_exp, candidates[0][0].block_m)
        cap = persistent_grid(device) if live is not None else None
        # the persistent GEMMs' shared item counter + arrival count (mainloop.persistent_items): one pair
        # serves every launch, each leaves it zero for the next (stream order); unused by one-tile programs
        claims = scratch_counters(scratch, "gemm_claims", 2, device) if persist else pairs.slot
        a_rs = w1_rs = w2_rs = pairs.weight  # row scales: frag8 only (the kernels ignore them otherwise)
        if mode == "frag8":
            _require_mx_activations(math)
            # A once per received row (GEMM1 reads it through layout.sorted_row): not a copy per pair
            a8 = buf("a8", (n_recv, hidden), torch.uint8, recv_cap)
            a_rs = buf("a_rs", (n_recv,), torch.float32, recv_cap)
            # 2 warps per row: fastest of 1 / 2 / 4 / 8 at 8192 tokens, within noise of them at 1024 (benchmarks/research/rowscale_ab.py)
            rowscale_e4m3_kernel[(_grid(n_recv, cap),)](
                pairs.row, a_data, a_data.stride(0), a_scale, a_scale.stride(0),
                a8, a8.stride(0), a_rs, hidden, A_FMT=a_fmt, SORTED=False,
                NB=triton.next_power_of_2(hidden // MX_BLOCK), PK=rowscale_piece(hidden), HW_CVT=use_asm, num_warps=2,
                **({} if live is None else live_rows_args(live)),  # walk the live received rows
            )
            e4m3 = torch.uint8 if interpreting() else torch.float8_e4m3fn  # typed for the FP8 MMA loads
            a_data, a_scale = a8.view(e4m3), a8
            w1_rs, w2_rs = weights.w1_row_scale, weights.w2_row_scale
        elif mode in ("split", "frag") and (mode == "split" or a_fmt != "bf16"):  # bf16 rows in natural order are frag's A
            # one program per received row (not walking LiveRows: the default decoders at DeepSeek shapes are frag8 for MX
            # activations and none for bf16 rows; stale rows are converted and never read)
            a_split = buf("a_split", (n_recv, hidden), torch.bfloat16, recv_cap)
            gather_split_kernel[(n_recv, 1)](  # one program per received row, all of K
                a_data, a_data.stride(0), a_scale, a_scale.stride(0), a_split, a_split.stride(0), hidden,
                A_FMT=a_fmt, BK=bk1, NB=triton.next_power_of_2(hidden // bk1), SPLIT=mode == "split",
                HW_CVT=use_asm, num_warps=8,
            )
            a_data = a_scale = a_split
        w1s = weights.w1_scale if weights.fmt == "mxfp4" else weights.w1
        w2s = weights.w2_scale if weights.fmt == "mxfp4" else weights.w2
        dest_mode, dest_ptr, seg_pairs, seg_row_bytes, dest_align = _dest_args(dest, pairs)
        limit = math.swiglu_limit
        for cfg, active in candidates:
            if mode == "frag8":  # hidden / intermediate % 128 == 0: checked when the weights were re-laid
                bk1 = bk2 = FP8_K
            else:
                bk1, bk2 = reduction_block(hidden, cfg.block_k), reduction_block(inter, cfg.block_k)
            layout = build_layout(pairs.slot, n_exp, cfg.block_m, self.capacity, row=pairs.row, live=live, active=active,
                                  all_tiles=not persist, scratch=scratch)
            gemm_cap = persistent_grid(device, cfg) if persist else None
            rows = layout.num_rows
            rows_cap = capacity_reserve(p_cap, n_exp, cfg.block_m)[2]  # every candidate's A2 in the same buffers
            if mode in ("split", "frag") or (mode != "frag8" and a_fmt == "bf16"):
                a2 = buf("a2", (rows, inter), torch.bfloat16, rows_cap)
                a2_scale = a2
            else:  # frag8: GEMM1 writes A2 in the A format (MX per 32, as the reference); rowscale_e4m3 then re-scales it
                a2 = buf("a2", (rows, inter if a_fmt == "fp8" else inter // 2), torch.uint8, rows_cap)
                a2_scale = buf("a2_scale", (rows, inter // MX_BLOCK), torch.uint8, rows_cap)
            live_tiles = layout.live_tiles if layout.live_tiles is not None else pairs.weight
            common = dict(DECODE=mode, USE_ASM=use_asm, BM=cfg.block_m, GROUP_M=cfg.group_m, F32_DOT=interpreting(),
                          TAIL_M=cfg.tail_m, TAIL_RIDE=cfg.tail_ride, PERSIST=persist, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages)

            n1 = triton.cdiv(2 * inter, cfg.block_n1)
            passes = () if cuda is not None else tile_passes(cfg, mode)
            if cuda is not None:
                cuda.gemm1(layout, a_data, a_rs, weights.w1, w1s, w1_rs, a2, a2_scale, hidden, inter, a_fmt, limit)
            for tile_pass in passes:
                gemm1_swiglu_kernel[(_grid(layout.num_tiles * n1, gemm_cap),)](
                    layout.tile_expert, layout.sorted_row, layout.num_tiles, live_tiles, claims,
                    a_data, a_data.stride(0), a_scale, a_scale.stride(0),
                    weights.w1, weights.w1.stride(0), weights.w1.stride(1), w1s, w1s.stride(0), w1s.stride(1),
                    w1_rs, w1_rs.stride(0), a_rs,
                    a2, a2.stride(0), a2_scale, a2_scale.stride(0),
                    hidden, inter, float(limit) if limit is not None else 0.0,
                    W_FMT=weights.fmt, A_FMT=a_fmt, PLAIN=weights.gate_up_layout == "plain", HAS_LIMIT=limit is not None,
                    BN=cfg.block_n1, BK=bk1, BK2=bk2, PASS=tile_pass, W_FULL=whole_weight_tiles(2 * inter, cfg.block_n1),
                    **common, **_register_cap(cfg, tile_pass, persist),
                )
            a2_rs = pairs.weight  # frag8 only
            if mode == "frag8":
                a2e = a2 if a_fmt == "fp8" else buf("a2e", (rows, inter), torch.uint8, rows_cap)  # fp8: in place
                a2_rs = buf("a2_rs", (rows,), torch.float32, rows_cap)
                rowscale_e4m3_kernel[(_grid(rows, cap),)](
                    layout.sorted_pair, a2, a2.stride(0), a2_scale, a2_scale.stride(0), a2e, a2e.stride(0), a2_rs,
                    inter, A_FMT=a_fmt, SORTED=True, NB=triton.next_power_of_2(inter // MX_BLOCK), PK=rowscale_piece(inter),
                    HW_CVT=use_asm, num_warps=2,
                    **({} if live is None else dict(live_ptr=live_tiles, BM=cfg.block_m, PERSIST=True)),
                )
                a2_data, a2_s, a2_fmt = a2e.view(e4m3), a2e, a_fmt
            elif mode in ("split", "frag"):
                a2_data, a2_s, a2_fmt = a2, a2, "bf16"
            else:
                a2_data, a2_s = _operand(MXTensor(a2, a2_scale, a_fmt) if a_fmt != "bf16" else a2, a_fmt, mode == "dot_scaled")
                a2_fmt = a_fmt
            n2 = triton.cdiv(hidden, cfg.block_n2)
            if cuda is not None:
                cuda.gemm2(layout, a2_data, a2_rs, weights.w2, w2s, w2_rs, pairs.weight, out,
                           out.stride(0) if dest is None else 0, dest_mode, dest_ptr, seg_pairs, seg_row_bytes, hidden, inter,
                           out_fmt)
            for tile_pass in passes:
                gemm2_weighted_kernel[(_grid(layout.num_tiles * n2, gemm_cap),)](
                    layout.tile_expert, layout.sorted_pair, pairs.weight, layout.num_tiles, live_tiles, claims,
                    a2_data, a2_data.stride(0), a2_s, a2_s.stride(0),
                    weights.w2, weights.w2.stride(0), weights.w2.stride(1), w2s, w2s.stride(0), w2s.stride(1),
                    w2_rs, w2_rs.stride(0), a2_rs,
                    out, out.stride(0) if dest is None else 0, dest_ptr, seg_pairs, seg_row_bytes,
                    inter, hidden,
                    W_FMT=weights.fmt, A_FMT=a2_fmt, BN=cfg.block_n2, BK=bk2, PASS=tile_pass, OUT_FMT=out_fmt,
                    W_FULL=whole_weight_tiles(hidden, cfg.block_n2), DEST=dest_mode, DEST_ALIGN=dest_align, **common,
                    **_register_cap(cfg, tile_pass, persist),
                )
        return out


    def _cuda_gemms(self, mode: str, device: torch.device, hidden: int, inter: int, pairs: int, num_experts: int,
                    live: LiveRows | None):
        """The sm_90a CUDA GEMMs (experts/cuda) for this forward, or None for the Triton ones.

        They serve frag8 weights on an sm_90 GPU, shapes in whole 256-row weight tiles, and every forward
        but the persistent one (live rows without a bound: its grids walk a count on the device, which
        only the Triton launches do). Where gemm="cuda" asks for them and they cannot run, the Triton
        GEMMs run instead, with one log line per reason (a build failure is logged by gemms.py)."""
        if self.gemm == "triton" or mode != "frag8":
            return None
        rows = (live.config_pairs if live is not None and live.config_pairs is not None else pairs) / max(1, num_experts)
        if self.gemm == "auto" and (self.config is not None or rows < CUDA_AUTO_MIN_ROWS):
            return None  # an explicit Triton tile config, or a bucket where Triton was measured faster: no build
        from ..cuda.gemms import Sm90Frag8Gemms, shapes_supported

        if device.type != "cuda" or interpreting():
            why = "under the Triton interpreter" if interpreting() else f"without a CUDA device ({device})"
        elif not shapes_supported(hidden, inter):
            why = f"at hidden={hidden} / intermediate={inter} (not whole 256-row weight tiles and 128-wide K steps)"
        elif live is not None and live.config_pairs is None:
            why = "for live rows without a token bound (that forward runs persistent Triton grids)"
        else:
            got = Sm90Frag8Gemms.for_device(device)  # logs once per device why it cannot load
            return None if isinstance(got, str) else got
        if why not in _CUDA_FALLBACKS_LOGGED:
            _CUDA_FALLBACKS_LOGGED.add(why)
            log.warning("megamoe: MEGA_EXPERTS_GEMM=%s: the sm_90a CUDA expert GEMMs cannot run %s; the Triton GEMMs do",
                        self.gemm, why)
        return None


def _result_buffer(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                   what: str) -> torch.Tensor:
    """The caller's result buffer, checked (contiguous [rows, cols] of dtype on device), or a new one."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype, device=device)
    if out.shape != (rows, cols) or out.dtype != dtype or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out: expected contiguous {str(dtype).removeprefix('torch.')} [{rows}, {cols}] ({what}) on {device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _check_dest(dest: torch.Tensor | SegmentDest, out: torch.Tensor | None, pairs: int, device: torch.device) -> None:
    if out is None or out.dtype != torch.uint8 or not out.is_contiguous() or out.device != device:
        raise ValueError("out: with dest= the base of the destination table must be a contiguous uint8 buffer on "
                         f"{device}, got {None if out is None else (tuple(out.shape), out.dtype, out.device)}")
    if isinstance(dest, SegmentDest):
        base = dest.base
        if base.dtype != torch.int64 or base.dim() != 1 or not base.is_contiguous() or base.device != device:
            raise ValueError(f"dest.base: expected contiguous int64 [segments] byte offsets on {device}, got "
                             f"{tuple(base.shape)} {base.dtype} on {base.device}")
        if dest.seg_pairs < 1 or base.shape[0] * dest.seg_pairs < pairs:
            raise ValueError(f"dest: {base.shape[0]} segments of {dest.seg_pairs} pairs do not cover the {pairs} pairs")
        if dest.align < 1 or dest.align & (dest.align - 1) or dest.row_bytes % dest.align:
            raise ValueError(f"dest.align={dest.align} must be a power of two dividing dest.row_bytes={dest.row_bytes}")
        return
    if dest.dtype != torch.int64 or tuple(dest.shape) != (pairs,) or not dest.is_contiguous() or dest.device != device:
        raise ValueError(f"dest: expected contiguous int64 [{pairs}] byte offsets on {device}, got "
                         f"{tuple(dest.shape)} {dest.dtype} on {dest.device}")


DEST_VECTOR_BYTES = 16  # the widest store GEMM2's epilogue issues: alignment beyond it buys nothing


def _dest_args(dest, pairs: ExpertPairs) -> tuple[int, torch.Tensor, int, int, int]:
    """GEMM2's (DEST mode, pointer, seg_pairs, seg_row_bytes, DEST_ALIGN) for a destination (gemm2._row_offsets)."""
    if dest is None:
        return 0, pairs.row, 1, 0, 1
    if isinstance(dest, SegmentDest):
        return 2, dest.base, dest.seg_pairs, dest.row_bytes, min(dest.align, DEST_VECTOR_BYTES)
    return 1, dest, 1, 0, 1


def _check_live(live: LiveRows, x, pairs: int, device: torch.device) -> None:
    """LiveRows must tile the received rows into segments, with the pairs in row-major order (k per row)."""
    n_recv = (x.data if isinstance(x, MXTensor) else x).shape[0]
    c = live.counts
    if c.dtype != torch.int64 or c.dim() != 1 or c.device != device or not c.is_contiguous():
        raise ValueError(f"live.counts: expected contiguous int64 [segments] on {device}, got {tuple(c.shape)} {c.dtype} "
                         f"on {c.device}")
    if live.segments * live.seg_rows != n_recv or n_recv == 0 or pairs % n_recv:
        raise ValueError(f"live: {live.segments} segments x {live.seg_rows} rows must be the {n_recv} received rows, "
                         f"each with the same number of pairs ({pairs} pairs)")


def _check_candidates(candidates, mode: str, out_fmt: str, hidden: int, inter: int) -> None:
    """What every tile config of a forward must allow, checked before any launch."""
    for cfg, _ in candidates:
        if out_fmt == "fp8" and cfg.block_n2 < MX_BLOCK:
            raise ValueError(f"the fp8_blockwise_1x32 combine wire is quantised per 1x32 block of a GEMM2 tile: "
                             f"TileConfig.block_n2={cfg.block_n2} must be >= {MX_BLOCK}")
        if mode in ("frag", "frag8") and min(reduction_block(hidden, cfg.block_k), reduction_block(inter, cfg.block_k)) < 64:
            raise ValueError(f"decoder={mode!r} needs block_k >= 64 dividing hidden={hidden} and intermediate={inter}")
        if mode == "frag8" and cfg.block_k < FP8_K:
            raise ValueError(f"decoder='frag8' steps K by {FP8_K} (its weights' K chunk, fragments.fp8_k_order): "
                             f"TileConfig.block_k={cfg.block_k} must be >= {FP8_K}")
    if mode == "split" and len({cfg.block_k for cfg, _ in candidates}) > 1:
        raise ValueError("decoder='split' lays A out per block_k: the tile config candidates must share block_k")


ALL_COUNTS = (-1, 2**31 - 1)  # (lo, hi]: a layout that serves every live pair count


def tile_candidates(config: TileConfig | None, seg_pairs: int, num_experts: int, mode: str,
                    config_pairs: int | None) -> tuple[tuple[TileConfig, tuple[int, int]], ...]:
    """The tile configs of a forward over live rows, each with the live pair counts (lo, hi] it serves.

    A bound (``config_pairs``, the engine's DP-padded batch x top-k) or a fixed config gives one. With
    no bound the host knows only the region (``seg_pairs``: one source's share, what a rank receives
    when every rank fills its region), so one per bucket up to the region's runs: the smallest (decode) for up to
    its limit of pairs per expert, the next buckets' over theirs, up to the region's; each layout finds on the device
    whether the live count is its own (build_layout ``active``), the others' GEMMs exit at once."""
    if config is not None:
        return ((config, ALL_COUNTS),)
    if config_pairs is not None:
        return ((default_config(config_pairs, num_experts, mode), ALL_COUNTS),)
    table = _table(mode)
    avg = seg_pairs / max(1, num_experts)
    last = next((i for i, (limit, _) in enumerate(table) if avg <= limit), len(table) - 1)
    out, lo = [], ALL_COUNTS[0]
    for i in range(last + 1):  # every bucket up to the region's, each over its own live pair range
        hi = ALL_COUNTS[1] if i == last else int(table[i][0] * num_experts)
        cfg = default_config(max(lo, 0) + 1 if i else 0, num_experts, mode)
        if out and out[-1][0] == cfg:
            out[-1] = (cfg, (out[-1][1][0], hi))
        else:
            out.append((cfg, (lo, hi)))
        lo = hi
    return tuple(out)


# A bounded forward runs persistent GEMMs when its tiles are prefill-sized (at least this tall) and its
# region holds at least this many times the tiles of the pairs its bound sizes (persistent_gemms)
BOUNDED_PERSIST_BLOCK_M = 128
BOUNDED_PERSIST_RATIO = 4.0


def persistent_gemms(live: LiveRows | None, region_pairs: int, num_experts: int, block_m: int) -> bool:
    """Whether the GEMMs run persistent grids over the live tiles the layout counted (mainloop.persistent_items)
    instead of one program per tile of the region.

    Without live rows the pairs are the work: one program per tile, as at ep_size 1. Live rows without
    a bound: the region is the capacity (MTPR), so always persistent. With a bound the region still
    holds ep x bound rows, because any source may send all its tokens to this rank, while a step fills
    about bound x top-k pairs, so one program per tile launches mostly programs with no tile where the
    region dwarfs that. Measured on the H200 (one emulated step per rank, A8W4, uniform routing,
    benchmarks/results/h200_bounded_grid_ab.json; persistent / tile grid): EP 8 prefill tiles (BM 128)
    at 5.7x / 7.2x the bound's tiles 0.98 / 0.95 (2048 / 8192 tokens: the tile grid's GEMM2 +12 / +18 %),
    at 3.3x 1.03; decode tiles at 1.5-4.5x 0.98-1.02; EP 2 (1.2-2x) 1.00-1.08. The persistent loop has
    a cost of its own (GEMM1 +10 % at EP 2 / 8192; its prefill kernels spill more), which only a large share of
    empty programs repays."""
    if live is None:
        return False
    if live.config_pairs is None:
        return True
    worst, expected = max_tiles(region_pairs, num_experts, block_m), max_tiles(live.config_pairs, num_experts, block_m)
    return block_m >= BOUNDED_PERSIST_BLOCK_M and worst >= BOUNDED_PERSIST_RATIO * expected


_SMS: dict[int, int] = {}  # documented cache: multiprocessor count per CUDA device index


def persistent_grid(device: torch.device, cfg: TileConfig | None = None) -> int:
    """Programs of a persistent launch (a fixed grid that loops over the live work): about one resident
    wave, so a launch with nothing live (a tile config the live count did not pick) costs one wave of
    programs that exit. GEMMs (``cfg``): 3 CTAs per SM up to 64-row tiles (frag8 decode / mid configs
    fit 3), 2 for 128-row tiles; the row-rescale kernels (2 warps, no shared memory): 8 per SM. Under
    the interpreter 3 programs, so its tests stride."""
    if device.type != "cuda" or interpreting():
        return 3
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    per_sm = 8 if cfg is None else (3 if cfg.block_m <= 64 else 2)
    return per_sm * _SMS[index]


def _grid(programs: int, cap: int | None) -> int:
    return max(1, programs if cap is None else min(programs, cap))


def tile_passes(cfg: TileConfig, mode: str) -> tuple[str, ...]:
    """The launches of each GEMM (mainloop.claim_tile): with tail_m the short tiles run in a launch
    of their own at height tail_m (compiled apart: one kernel holding both heights was measured
    nondeterministic for A8W4 GEMM1 on the H200, docs/triton.md); with tail_ride the short tiles that
    follow a full tile of their expert ride in that tile's K loop, in a third launch."""
    if not cfg.tail_m:
        return ("full",)
    if not cfg.tail_ride:
        return ("full", "short")
    if mode not in ("frag", "frag8"):
        raise ValueError(f"TileConfig.tail_ride needs a fragment decoder (frag / frag8), not {mode!r}")
    return ("full", "ride", "short")


def whole_weight_tiles(n: int, block_n: int) -> bool:
    """The GEMM's weight tiles all lie inside its N rows (true at DeepSeek shapes), so the K loops load
    them without a row mask (W_FULL, mainloop.frag_mainloop_ride)."""
    return n % block_n == 0


def _register_cap(cfg: TileConfig, tile_pass: str, persistent: bool = False) -> dict:
    """Launch option for one tile pass's ptxas register cap (TileConfig.launch_registers), or none."""
    r = cfg.launch_registers(tile_pass, persistent)
    return {"maxnreg": r} if r else {}


def _has_mx_activations(math: ExpertMath) -> bool:
    """frag8 feeds e4m3 activations to the FP8 tensor cores: only A8W4 / A4W4 have them."""
    return math.a_format in ("fp8", "fp4")


def _require_mx_activations(math: ExpertMath) -> None:
    if not _has_mx_activations(math):
        raise ValueError(f"decoder='frag8' needs MX activations (A8W4 / A4W4); quant={math.quant} has bf16 A")


def _operand(x, a_fmt: str, dot_scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales) pointers for the kernels; fp8 data is viewed as float8 for tl.dot_scaled."""
    if a_fmt == "bf16":
        return x, x
    data = x.data.view(torch.float8_e4m3fn) if (a_fmt == "fp8" and dot_scaled) else x.data
    return data, x.scales


def _received_rows(a: Activations, math: ExpertMath, hidden: int, device: torch.device):
    if isinstance(a, MXTensor):
        if a.fmt != math.a_format:
            raise ValueError(
                f"received {a.fmt} rows but quant={math.quant} needs A operand {math.a_format or 'bf16'} "
                "(MEGA_DISPATCH_WIRE must match the expert GEMM's A operand)"
            )
        payload = hidden if a.fmt == "fp8" else hidden // 2
        for name, t, cols in (("received rows (data)", a.data, payload), ("received rows (scales)", a.scales, hidden // MX_BLOCK)):
            if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != cols:
                raise ValueError(f"{name}: expected uint8 [N, {cols}] for hidden={hidden}, got {tuple(t.shape)} {t.dtype}")
            if t.stride(1) != 1:
                raise ValueError(f"{name}: must be contiguous along the hidden dim, got strides {t.stride()}")
            if t.device != device:
                raise ValueError(f"{name}: on {t.device}, pairs on {device}")
        if a.data.shape[0] != a.scales.shape[0]:
            raise ValueError(f"received rows: data has {a.data.shape[0]} rows, scales {a.scales.shape[0]}")
        return a
    if a.dim() != 2 or a.shape[1] != hidden:
        raise ValueError(f"received rows: expected [N, {hidden}], got {tuple(a.shape)}")
    if a.dtype != torch.bfloat16:
        raise ValueError(f"received rows: expected bfloat16 (the bf16 wire), got {a.dtype}")
    if not a.is_contiguous():
        raise ValueError(f"received rows: must be contiguous, got strides {a.stride()} for shape {tuple(a.shape)}")
    if a.device != device:
        raise ValueError(f"received rows: on {a.device}, pairs on {device}")
    return a


def _check_pairs(pairs: ExpertPairs) -> None:
    p = pairs.row.shape[0]
    for name, t, dtype in (("pairs.row", pairs.row, torch.int64), ("pairs.slot", pairs.slot, torch.int64), ("pairs.weight", pairs.weight, torch.float32)):
        if t.dim() != 1 or t.shape[0] != p:
            raise ValueError(f"{name}: expected shape [{p}], got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")


def _check_weights(w: ExpertWeights, device: torch.device) -> None:
    """ExpertWeights validates shapes at construction; this re-checks what the kernels rely on."""
    e, two_i = w.w1.shape[0], w.w1.shape[1]
    h, i = w.hidden, w.intermediate
    if h % MX_BLOCK or i % MX_BLOCK:
        raise ValueError(f"hidden={h} and intermediate={i} must be multiples of {MX_BLOCK} for the Triton experts")
    if w.fmt == "mxfp4":
        expect = (("w1", w.w1, (e, two_i, h // 2)), ("w1_scale", w.w1_scale, (e, two_i, h // MX_BLOCK)),
                  ("w2", w.w2, (e, h, i // 2)), ("w2_scale", w.w2_scale, (e, h, i // MX_BLOCK)))
        dtype = torch.uint8
    else:
        expect = (("w1", w.w1, (e, two_i, h)), ("w2", w.w2, (e, h, i)))
        dtype = torch.bfloat16
    for name, t, shape in expect:
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"weights.{name}: expected {dtype} of shape {shape}, got {got}")
        if t.stride(-1) != 1:
            raise ValueError(f"weights.{name}: must be contiguous along K (stride(-1) == 1), got strides {t.stride()}")
        if t.device != device:
            raise ValueError(f"weights.{name}: on {t.device}, pairs on {device}")


def select_experts_provider(device: torch.device | str, math: ExpertMath, weights_fmt: str, capacity: int | None = None) -> ExpertsProvider:
    """TritonExperts where it is supported (CUDA + Triton), else the torch reference (CPU)."""
    if TritonExperts.supports(torch.device(device), math, weights_fmt):
        return TritonExperts(capacity=capacity)
    from ..reference import TorchReferenceExperts

    return TorchReferenceExperts()
