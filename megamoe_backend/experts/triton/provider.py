"""TritonExperts: the ``triton`` experts provider (NVIDIA; portable Triton).

Same contract as TorchReferenceExperts (experts/base.py): received rows (bf16, or the MXTensor the
dispatch wire delivered), (row, slot, weight) pairs -> fp32 [P, H] route-weighted outputs per pair,
or (``forward_wire``, what the layer calls) those rows as combine wire rows written by GEMM2 itself.
A forward is five to eleven Triton launches (layout; A converted once per received row, unless bf16
rows feed frag as they are; GEMM1; frag8's A2 row re-scale; GEMM2; each GEMM twice when the tile
config has short tiles, three times with tail riders: ``launch_plan.tile_passes``) and a few
sync-free torch ops, so it can be CUDA-graph captured for a fixed pair count. On Hopper and later these
launches (not the receiver's quantisation of a bf16 wire) use programmatic dependent launch (pdl.py):
each kernel's programs are scheduled while its predecessor finishes and wait for it before touching memory.

This module holds the provider's decisions (decoder, weight storage) and the order of a forward;
the rest has a module each: checks.py (what a forward is handed), launch_plan.py (tile configs,
grids, passes), forward_buffers.py (where intermediates live), launches.py (the kernel launches).
"""

from __future__ import annotations

import logging

import torch

from ...formats import GroupFP8Tensor, MXTensor
from ...formats.wire import WireFormat
from ...knobs.env import check_experts_gemm
from ..base import Activations, ExpertMath, ExpertPairs, ExpertsProvider
from ..fragments import FP8_S_MAX, FoldSpanError
from ..live import LiveRows, SegmentDest
from ..scratch import ExpertsScratch
from ..weights import FRAGMENT_STORAGE, ExpertWeights
from . import triton_available
from .checks import (
    check_block_fp8_math, check_capacity, check_candidates, check_live, check_pairs, check_row_indices, check_weights,
    has_mx_activations, received_rows, require_mx_activations, result_buffer, wire_target,
)
from .config import TileConfig, interpreting
from .forward_buffers import ForwardBuffers
from .launch_plan import LaunchPlan, plan_launches
from .launches import ForwardLaunch, Operand, a2_buffers, a2_operand, convert_a, forward_launch, gemm1, gemm2, quantise_received
from .layout import ExpertLayout, build_layout

DECODERS = ("auto", "frag8", "frag", "split", "dot_scaled", "manual")
FRAG_KIND = {"frag": "bf16", "frag8": "fp8"}  # fragment decoder -> the fragments.py kind it reads
STORAGE_OF = {d: FRAGMENT_STORAGE[k] for d, k in FRAG_KIND.items()}  # ... and that kind's storage name
# What "auto" resolves to for row-major MXFP4 weights on a CUDA GPU (H200 measurements in
# docs/triton.md); weights that went through prepare_weights() are in fragment order and use "frag8"
# (MX activations) or "frag".
GPU_DEFAULT_DECODER = "split"
log = logging.getLogger("megamoe")


class TritonExperts(ExpertsProvider):
    """Grouped MX GEMMs in Triton, and block-FP8 ones (fmt "fp8_block": decoder block_fp8, mainloop.py).

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
    gemm: MEGA_EXPERTS_GEMM as the Knobs hold it (registry.make_provider passes ``knobs.experts_gemm``;
        nothing here reads the environment): "auto" | "triton", both the Triton kernels here ("humming"
        is served by experts/humming/, which registry.make_provider builds where gemm_choice picks it; the
        sm_90a CUDA GEMMs, measured slower in every bucket, moved to benchmarks/research/cuda_gemms:
        "cuda" is refused naming the knob).
    """

    name = "triton"

    def __init__(self, capacity: int | None = None, decoder: str = "auto", config: TileConfig | None = None,
                 gemm: str = "auto") -> None:
        if decoder not in DECODERS:
            raise ValueError(f"decoder={decoder!r}; expected one of {DECODERS}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        self.gemm = check_experts_gemm(gemm)
        if self.gemm == "humming":
            raise ValueError("gemm='humming': humming-kernels' GEMMs run in HummingExperts (experts/humming/); "
                             "registry.make_provider builds it where experts/gemm_choice.py picks it")
        self.capacity = capacity
        self.decoder = decoder
        self.config = config

    @classmethod
    def supports(cls, device: torch.device, math: ExpertMath, weights_fmt: str) -> bool:
        device = torch.device(device)
        if weights_fmt not in ("bf16", "mxfp4", "fp8_block") or not triton_available():
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
        fragments handle (N % 16, K % 64, E8M0 scale range), each time with one WARNING on the
        "megamoe" logger naming what did not fit; decoder="frag" / "frag8" raise instead.
        """
        if weights.fmt != "mxfp4" or self.decoder not in ("auto", "frag", "frag8"):
            return weights
        if self.decoder == "auto" and torch.version.hip is not None:
            return weights
        if self.decoder == "frag8" and math is not None:
            require_mx_activations(math)
        if self.decoder == "auto":
            kinds = ["fp8", "bf16"] if math is not None and has_mx_activations(math) else ["bf16"]
        else:
            kinds = [FRAG_KIND[self.decoder]]
        for i, kind in enumerate(kinds):
            try:
                return weights.as_fragments(kind)
            except ValueError as exc:
                if self.decoder != "auto":
                    raise
                _log_fallback(kind, kinds[i + 1] if i + 1 < len(kinds) else None, exc)
        return weights

    def resolve_decoder(self, weights_fmt: str, storage: str = "rowmajor") -> str:
        """The mainloop DECODE mode for these weights on this backend."""
        if weights_fmt == "fp8_block":  # one decoder: FP8 MMA per 128 x 128 block (mainloop.block_fp8_mainloop)
            if self.decoder != "auto":
                raise ValueError(f"decoder={self.decoder!r} decodes MXFP4 weights; block-FP8 weights run the block_fp8 "
                                 "mainloop: use decoder='auto'")
            return "block_fp8"
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
        out = result_buffer(out, len(pairs), weights.hidden, torch.float32, pairs.weight.device, "fp32 rows")
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
        out, target, out_fmt = wire_target(out, dest, len(pairs), wire, weights.hidden, pairs.weight.device,
                                           "the Triton GEMM2 epilogue")
        self._run(a, pairs, weights, math, target, out_fmt, dest, live, scratch)
        return out

    def _run(
        self, a: Activations, pairs: ExpertPairs, weights: ExpertWeights, math: ExpertMath, out: torch.Tensor, out_fmt: str,
        dest: torch.Tensor | SegmentDest | None = None, live: LiveRows | None = None, scratch: ExpertsScratch | None = None,
    ) -> torch.Tensor:
        """The forward proper; ``out`` is the checked [P, ...] result buffer GEMM2 writes in ``out_fmt``
        ("f32", or the combine wire: "bf16" / "fp8"; gemm2.py), or with ``dest`` the base its byte
        offsets count from. With ``live`` the A conversion runs once over the live rows, then each
        tile config candidate (launch_plan.tile_candidates) builds its layout and runs both GEMMs; a
        candidate the live pair count does not pick finds live_tiles = 0 and its launches exit at once."""
        device, p = pairs.weight.device, len(pairs)
        check_weights(weights, device)
        check_block_fp8_math(weights.fmt, math)
        check_pairs(pairs)
        check_capacity(p, self.capacity)
        a_fmt = math.a_format or "bf16"
        x = received_rows(a, math, weights.hidden, device)
        n_recv = (x.data if isinstance(x, (MXTensor, GroupFP8Tensor)) else x).shape[0]
        bufs = ForwardBuffers(scratch, device, p, n_recv, self.capacity)
        if live is not None and p:
            check_live(live, x, p, device)
        if a_fmt != "bf16" and not isinstance(x, (MXTensor, GroupFP8Tensor)):  # bf16 wire: the receiver quantises (the live rows)
            x = quantise_received(x, a_fmt, bufs, live)
        if p == 0:
            return out
        mode = self.resolve_decoder(weights.fmt, weights.storage)
        if mode == "frag8":
            require_mx_activations(math)
        plan = self._launch_plan(mode, p, weights, live, device)
        check_candidates(plan.candidates, mode, out_fmt, weights.hidden, weights.intermediate)
        check_row_indices(pairs, n_recv)
        fl = forward_launch(weights, pairs, mode, a_fmt, math.swiglu_limit, plan, bufs)
        a_operand = convert_a(fl, x, bufs, live)  # once per received row: GEMM1 reads it through layout.sorted_row
        for cfg, active in plan.candidates:
            layout = build_layout(pairs.slot, weights.num_experts, cfg.block_m, self.capacity, row=pairs.row, live=live,
                                  active=active, all_tiles=not plan.persist, scratch=scratch, pdl=fl.pdl)
            a2, a2_scale = a2_buffers(fl, bufs, layout)
            self._gemm1(fl, layout, cfg, a_operand, a2, a2_scale)
            self._gemm2(fl, layout, cfg, a2_operand(fl, layout, cfg, a2, a2_scale, bufs, live), out, out_fmt, dest)
        return out

    def kernel_key(self, weights: ExpertWeights, pairs: int, live: LiveRows | None, device: torch.device):
        """See ExpertsProvider.kernel_key: the decoder and the launch plan's tile configs and grid kind,
        the compile-time constants the GEMMs specialise on (their row counts are not: gemm1 / gemm2)."""
        mode = self.resolve_decoder(weights.fmt, weights.storage)
        plan = self._launch_plan(mode, pairs, weights, live, device)
        return mode, tuple(cfg for cfg, _ in plan.candidates), plan.persist

    # The three steps a provider with other GEMM kernels replaces (benchmarks/research/cuda_gemms runs the
    # sm_90a CUDA GEMMs through them); everything else of a forward is shared.
    def _launch_plan(self, mode: str, pairs: int, weights: ExpertWeights, live: LiveRows | None,
                     device: torch.device) -> LaunchPlan:
        """The tile configs, grids and passes of this forward (launch_plan.plan_launches)."""
        return plan_launches(self.config, pairs, weights.num_experts, mode, live, device)

    def _gemm1(self, fl: ForwardLaunch, layout: ExpertLayout, cfg: TileConfig, a: Operand, a2: torch.Tensor,
               a2_scale: torch.Tensor) -> None:
        gemm1(fl, layout, cfg, a, a2, a2_scale)

    def _gemm2(self, fl: ForwardLaunch, layout: ExpertLayout, cfg: TileConfig, a2: Operand, out: torch.Tensor,
               out_fmt: str, dest: torch.Tensor | SegmentDest | None) -> None:
        gemm2(fl, layout, cfg, a2, out, out_fmt, dest)


def _log_fallback(kind: str, next_kind: str | None, exc: ValueError) -> None:
    """One WARNING for weights decoder="auto" could not re-lay as ``kind`` fragments: what did not fit
    (for frag8's fold: the tensor, expert, row and the binade spread of its block scales) and which
    slower decoder runs these experts instead (instructions per weight: docs/triton.md)."""
    to = "the frag decoder (bf16 MMA fragments" if next_kind == "bf16" else "the split decoder (row-major weights"
    if isinstance(exc, FoldSpanError):
        log.warning("megamoe: frag8 cannot hold these MXFP4 weights exactly: %s expert %d row %d has block scales "
                    "%d binades apart (block %d: 2**%d, row max 2**%d; frag8 folds at most %d); %s, about 1.5x the "
                    "instructions per weight) runs these experts", exc.tensor, exc.expert, exc.row, exc.spread,
                    exc.block, exc.block_exp, exc.row_max_exp, FP8_S_MAX, to)
    else:
        log.warning("megamoe: %s fragments cannot hold these MXFP4 weights (%s); %s) runs these experts", kind, exc, to)


def select_experts_provider(device: torch.device | str, math: ExpertMath, weights_fmt: str, capacity: int | None = None) -> ExpertsProvider:
    """TritonExperts where it is supported (CUDA + Triton), else the torch reference (CPU)."""
    if TritonExperts.supports(torch.device(device), math, weights_fmt):
        return TritonExperts(capacity=capacity)
    from ..reference import TorchReferenceExperts

    return TorchReferenceExperts()
