"""The MoE kernels a user would run instead of this project, timed beside its figures in the same run.

What a vLLM / SGLang user serving MXFP4 experts on Hopper gets when they do not pick ``megamoe_ep``:

- ``flashinfer_humming``: FlashInfer's CUTLASS SM90 fused MoE, ``CutlassHummingConfig`` (MXFP4 weights x
  FP8 activations quantised per token inside the call), through ``flashinfer.fused_moe.MoELayer``: SGLang
  0.5.23's opt-in on Hopper (``--flashinfer-mxfp4-moe-precision fp8``), not vLLM's default;
- ``flashinfer_w4a16``: the same with ``CutlassW4A16Config`` (MXFP4 weights x bf16 activations): SGLang
  0.5.23's default on Hopper (``flashinfer_mxfp4``);
- ``triton_kernels``: OpenAI triton_kernels ``matmul_ogs`` with its ragged routing metadata, as vLLM's
  Triton MXFP4 MoE path calls it (GEMM1 gathers the token rows and fuses the SwiGLU, GEMM2 scatters
  with the route weights, then the top-k reduce), on the Hopper value / scale swizzles;
- ``vllm_humming``: vLLM 0.34's own Hopper MXFP4 experts path for DeepSeek V4 (humming-kernels'
  HummingIndexedExperts, block-FP8 group-128 activations), from the carried vLLM bundle
  (benchmarks/peer_vllm_humming.py): vLLM 0.33 / 0.34's default on Hopper;
- ``flashinfer_megamoe_sm90``: FlashInfer 0.7.4's fused SM90 MegaMoE (``flashinfer.moe_ep``, MXFP4 weights x
  FP8 activations, one CuTe DSL kernel: dispatch + FC1 + SwiGLU + FC2 + combine) at ep_size 1, through its
  ``MoEEpLayer`` (benchmarks/peer_flashinfer_megamoe.py): no engine's default yet (neither vLLM 0.34 nor
  SGLang 0.5.23 enables it on Hopper); it needs the FlashInfer 0.7.4 bundle, not the 0.7.2 one above.

For block-FP8 experts (``bench experts --schemes fp8_block``; weights_fmt "fp8_block"):

- ``vllm_humming_block_fp8``: the same humming path on a DeepSeek V3 / R1 FP8 checkpoint's experts (128 x 128
  weight blocks x group-128 FP8 activations), vLLM's ``--moe-backend humming`` (not its Hopper default, which
  is Triton at ep_size 1: peer_vllm_block_fp8.py, run beside every fp8_block case);
- ``deepgemm_block_fp8``: DeepGEMM's m-grouped FP8 GEMMs (SM90 1D2D) in the contiguous layout, built from source on
  the GPU machine (benchmarks/peer_deepgemm_block_fp8.py): vLLM's ``--moe-backend deep_gemm`` and SGLang's DeepEP
  normal-mode runner call these GEMMs; GEMM1 / GEMM2 alone in ``stages_us``.

benchmarks/engine_ratios.py names them the same way in the table a user reads.

Each is timed the way its users run it: FlashInfer autotuned on the first call of each token bucket
(``flashinfer.autotune(True)``, optionally with its tactic cache file), then captured in one CUDA graph
and replayed; matmul_ogs (heuristic tile flags, no autotuner) JIT-compiled on the first call, then
graphed. The call timed is the peer's whole MoE: bf16 token rows and precomputed top-k (ids, weights)
in, one bf16 route-weighted row per token out, as the project's layer; where FlashInfer's API allows,
its two GEMMs are also timed alone through the GEMM profiler its autotuner uses (``stages_us``: at the
same token count, on that profiler's own routing).

Weights: the bench's own MXFP4 weights, moved byte for byte into each peer's logical layout
(benchmarks/peer_weights.py), then through the peer's own device-side preparation (Humming's E8M0 range
clamp and the SM90 interleaves; triton_kernels' ``convert_layout``), so relL2 against the bench's fp32
reference measures the peer's arithmetic.

An EP rank (``bench layer --emulate``): the peer holds that rank's local experts and runs the tokens
that reach the rank with their global top-k ids, the pairs on other ranks left out (FlashInfer's flat
``cutlass_fused_moe`` with ``ep_size`` / ``ep_rank``, as vLLM calls it under EP: ``MoELayer``'s CUTLASS
runners take no EP shard; matmul_ogs with those slots marked -1, as vLLM's expert map does), returning
the rank's partial sum per token.

Why one module, and lazy imports: a peer that is not importable (no FlashInfer on this host, no GPU, a
CPU CI) is listed as skipped with the reason and nothing else changes; FlashInfer and triton_kernels
are imported only by the peers' constructors.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass

import torch

from megamoe_backend.experts import ExpertWeights

from .peer_api import (CHECK_TOKENS, Peer, PeerResult, PeerShape, PeerUnavailable, Skipped, describe,  # noqa: F401
                       peer_line, require_cuda, smoke_parser, time_peer, weights_key)
from .peer_weights import to_flashinfer, to_triton_kernels
from .timing import time_fn

PEER_NAMES = ("flashinfer_humming", "flashinfer_w4a16", "triton_kernels", "vllm_humming",  # MXFP4 experts
              "flashinfer_megamoe_sm90")
BLOCK_FP8_PEER_NAMES = ("vllm_humming_block_fp8", "deepgemm_block_fp8")  # block-FP8 experts (bench experts --schemes fp8_block)
PEERS_README = "../shared/peers/README.md"
HUMMING_EPILOGUE_COMPENSATION = 64.0  # FlashInfer: residual x 2^6 into quant-scale slots 1 / 4 (prepare.py)
PREPARE_CHUNK_EXPERTS = 8  # Humming's payload rewrite widens codes to int64: bound its temporaries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", nargs="*", choices=PEER_NAMES + BLOCK_FP8_PEER_NAMES, default=None,
                        help="also time the peers a user would run instead (all importable MXFP4 ones without names; "
                             f"{PEERS_README} says how to carry them to the GPU); absent ones are listed as skipped")
    parser.add_argument("--peer-tune-cache", default=None, metavar="JSON",
                        help="FlashInfer's autotune cache file (flashinfer.autotune(cache=...)): read on entry, "
                             "written after each tuned bucket, so a later bench of the same run reuses the tactics")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


class FlashInferCutlass(Peer):
    """FlashInfer's CUTLASS SM90 fused MoE, Humming (MXFP4 x FP8) or W4A16 (MXFP4 x bf16)."""

    def __init__(self, kind: str, tune_cache: str | None = None) -> None:
        super().__init__()
        if kind not in ("humming", "w4a16"):
            raise ValueError(f"FlashInferCutlass kind={kind!r}; expected 'humming' or 'w4a16'")
        self.kind, self.name, self.tune_cache = kind, f"flashinfer_{kind}", tune_cache
        try:
            import flashinfer
            from flashinfer import fused_moe
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
            raise PeerUnavailable(f"{self.name}: import flashinfer failed ({type(exc).__name__}: {str(exc)[:200]}); on the "
                                  f"H200 device source .peers/flashinfer/setup_device.sh ({PEERS_README})") from None
        self.fi, self.fm = flashinfer, fused_moe
        self.version = f"flashinfer-python {flashinfer.__version__}"
        self.backend_cfg = fused_moe.CutlassHummingConfig() if kind == "humming" else fused_moe.CutlassW4A16Config()
        self.device = require_cuda(self.name)
        major, minor = torch.cuda.get_device_capability(self.device)
        if not type(self.backend_cfg).supported(major * 10 + minor):
            raise PeerUnavailable(f"{self.name}: {self.backend_cfg!r} does not run on sm_{major}{minor} (SM90 only)")
        self.config = (f"MoELayer({self.backend_cfg!r}), SwiGLU(alpha=1, beta=0, limit), autotuned per bucket "
                       "(flashinfer.autotune(True) on the first call), one CUDA graph; EP rank: flat cutlass_fused_moe "
                       "(ep_size, ep_rank)")
        self.scope = ("whole MoE call: permute + " + ("FP8 per-token quant + " if kind == "humming" else "")
                      + "GEMM1 + SwiGLU + GEMM2 + finalize (bf16 token rows in and out)")
        self.view: dict | None = None
        self.layer = None
        self.flat_tactics: dict[int, dict] = {}  # tokens -> {"gemm1": tactic, "gemm2": tactic} the flat call ran
        self.layer_state = None

    # weights: FlashInfer's own device-side preparation on the bench's bytes
    def _native_view(self, w: ExpertWeights) -> dict:
        fi = to_flashinfer(w.to(self.device))
        fm = self.fm
        if self.kind == "w4a16":
            return {"fc1_expert_weights": fm.interleave_moe_weights_for_sm90_mixed_gemm(fi.w1, "fp4"),
                    "fc2_expert_weights": fm.interleave_moe_weights_for_sm90_mixed_gemm(fi.w2, "fp4"),
                    "fc1_expert_scales": fm.interleave_moe_scales_for_sm90_mixed_gemm(fi.w1_scale),
                    "fc2_expert_scales": fm.interleave_moe_scales_for_sm90_mixed_gemm(fi.w2_scale)}
        view = {}
        for gemm, (codes, scales) in (("fc1", (fi.w1, fi.w1_scale)), ("fc2", (fi.w2, fi.w2_scale))):
            parts = [fm.preprocess_moe_weights_for_sm90_mixed_gemm_humming(codes[a:a + PREPARE_CHUNK_EXPERTS],
                                                                            scales[a:a + PREPARE_CHUNK_EXPERTS])
                     for a in range(0, codes.shape[0], PREPARE_CHUNK_EXPERTS)]  # the range clamp is per expert
            view[f"{gemm}_expert_weights"] = torch.cat([p[0] for p in parts])
            view[f"{gemm}_expert_scales"] = torch.cat([p[1] for p in parts])
            view[f"{gemm}_residual_scale"] = (torch.cat([p[2] for p in parts]) * HUMMING_EPILOGUE_COMPENSATION).contiguous()
        view["fc2_act_global"] = torch.ones((), dtype=torch.float32, device=self.device)
        return view

    def load(self, weights, shape, *, max_tokens, ep_size=1, ep_rank=0):
        key = weights_key(weights)
        if key != self.loaded_key:
            self.release()  # free the previous set before the next one is made
            torch.cuda.empty_cache()
            self.view = self._native_view(weights)
            self.loaded_key = key
        state = (key, shape, max(8192, _next_pow2(max_tokens)), ep_size, ep_rank)
        if state == self.layer_state:
            return  # the same MoELayer: its per-bucket winners (the autotuned tactics) stay
        self.experts, self.shape, self.ep_size, self.ep_rank = weights.num_experts, shape, ep_size, ep_rank
        self.ceiling, self.layer_state = state[2], state
        fm = self.fm
        self.activation = (fm.SwiGLU(alpha=1.0, beta=0.0, limit=float(shape.swiglu_limit))
                           if shape.swiglu_limit is not None else fm.SwiGLU())
        self.layer = None
        if ep_size == 1:
            quant = (fm.QuantConfig(weight=fm.QuantFormat.MXFP4, activation=fm.QuantFormat.FP8PerTensor)
                     if self.kind == "humming" else fm.QuantConfig(weight=fm.QuantFormat.MXFP4))
            config = fm.MoEConfig(routing=fm.RoutingConfig(num_experts=self.experts, top_k=shape.topk), quant=quant,
                                  experts=fm.ExpertConfig(intermediate_size=shape.intermediate),
                                  activation=self.activation, backend=fm.BackendOptions(candidates=(self.backend_cfg,)),
                                  execution=fm.ExecutionConfig(tune_max_num_tokens=self.ceiling))
            self.layer = fm.MoELayer(config, device=self.device)
            self.pack = fm.MoEWeightPack()
            self.pack.prepare_for(self.layer.runners[0].backend_key, self.view)

    def release(self):
        self.view = self.layer = self.layer_state = self.pack = None
        self.loaded_key = None

    def bind(self, x, ids, weights):
        ids32, w32 = ids.to(torch.int32).contiguous(), weights.float().contiguous()
        if self.layer is not None:
            act = self.fm.MoEActivationPack(x.contiguous(), None, ids32, w32)
            return lambda: self.layer(act, self.pack)
        return self._flat_call(x.contiguous(), ids32, w32)

    def _flat_call(self, x, ids32, w32):
        """An EP rank: ``cutlass_fused_moe`` with ``ep_size`` / ``ep_rank`` (global ids in, the rank's
        local experts' partial sums out), its workspace and output allocated once here.

        Tuned at exactly the rank's token count: the flat call's autotuner otherwise profiles every
        bucket up to ``tune_max_num_tokens`` (the next power of two of the tokens that reach the rank,
        up to 65536 at EP 8 x 8192), minutes per case. ``flashinfer.autotune(tuning_buckets=...)`` is
        FlashInfer's own way to tune the sizes a caller knows it will run ("passing those exact sizes
        yields the best results"); every call enters it (host-side only, so a CUDA-graph capture
        records the tuned tactic), and inside ``warm``'s ``autotune(True)`` it profiles that one bucket."""
        fm, v, n = self.fm, self.view, self.experts
        buckets = (int(x.shape[0]),)
        humming = self.kind == "humming"
        scales = ([v["fc1_expert_scales"].view(torch.int32), v["fc1_residual_scale"], v["fc2_act_global"],
                   v["fc2_expert_scales"].view(torch.int32), v["fc2_residual_scale"]] if humming else
                  [v["fc1_expert_scales"].view(torch.int32), v["fc2_expert_scales"].view(torch.int32)])
        act = {k: torch.full((n,), val, dtype=torch.float32, device=self.device)
               for k, val in (("swiglu_alpha", self.activation.alpha), ("swiglu_beta", self.activation.beta),
                              ("swiglu_limit", self.activation.limit))}
        ws = torch.empty(fm.cutlass_fused_moe_workspace_size(
            x.shape[0], self.shape.hidden, self.shape.intermediate, n * self.ep_size, self.shape.topk,
            x_dtype=torch.bfloat16, weight_dtype=torch.uint8, ep_size=self.ep_size, ep_rank=self.ep_rank,
            use_w4_group_scaling=True, use_wfp4afp8_humming=humming, device=self.device),
            dtype=torch.uint8, device=self.device)
        out = torch.empty(x.shape[0], self.shape.hidden, dtype=torch.bfloat16, device=self.device)

        def call():
            # look up (inside warm: tune) this one bucket; record what the tuner handed out
            with self.fi.autotune(False, tuning_buckets=buckets), self._recording_tactics(buckets[0]):
                fm.cutlass_fused_moe(x, ids32, w32, v["fc1_expert_weights"], v["fc2_expert_weights"], torch.bfloat16,
                                     scales, ep_size=self.ep_size, ep_rank=self.ep_rank, output=out,
                                     use_w4_group_scaling=True, use_wfp4afp8_humming=humming,
                                     tune_max_num_tokens=self.ceiling, workspace_buffer=ws, **act)
            return out

        return call

    def warm(self, call):
        with (self.fi.autotune(True, cache=self.tune_cache) if self.tune_cache else self.fi.autotune(True)):
            return call()

    def _winner(self, tokens: int):
        if self.layer is None:
            return None
        from flashinfer.fused_moe.utils import map_to_hybrid_bucket

        bucket = map_to_hybrid_bucket(tokens, self.ceiling)
        for key, (runner, tactic) in self.layer._winners.items():  # MoELayer's per-bucket winner cache
            if key[0] == bucket:
                return runner, tactic
        return None

    @contextlib.contextmanager
    def _recording_tactics(self, tokens: int):
        """Record the (gemm1, gemm2) tactics FlashInfer's tuner hands the flat call at ``tokens``
        (``self.flat_tactics``): its ``choose_one`` returns -1 when it falls back to the default tactic
        (OOM while profiling, a bucket it did not tune), a tuned winner otherwise, from memory or from
        the cache file. The tuner is a process-wide singleton; its method is wrapped for this one call."""
        from flashinfer.autotuner import AutoTuner

        tuner = AutoTuner.get()
        choose_one, seen = tuner.choose_one, self.flat_tactics.setdefault(tokens, {})

        def recording(custom_op, *args, **kwargs):
            runner, tactic = choose_one(custom_op, *args, **kwargs)
            seen[custom_op.rsplit("::", 1)[-1]] = tactic
            return runner, tactic

        own = "choose_one" in vars(tuner)  # an instance attribute already (not the class's method)
        tuner.choose_one = recording
        try:
            yield
        finally:
            if own:
                tuner.choose_one = choose_one
            else:
                del tuner.choose_one  # the class's method again

    def tactic(self, tokens):
        if self.layer is None:
            got = self.flat_tactics.get(tokens, {})
            return (f"flat cutlass_fused_moe, autotuned at exactly {tokens} tokens (tuning_buckets): (gemm1, gemm2) = "
                    f"({got.get('gemm1', '?')}, {got.get('gemm2', '?')})")
        won = self._winner(tokens)
        return "" if won is None else f"{won[0].backend_key} (gemm1, gemm2) = {won[1]}"

    def untuned(self, tokens):
        got = self.flat_tactics.get(tokens, {})
        tuned = ({"gemm1", "gemm2"} <= got.keys() and -1 not in got.values() if self.layer is None
                 else self._winner(tokens) is not None)
        return "" if tuned else (f"FlashInfer kept no autotuned winner at {tokens} tokens: it ran its default tactic "
                                 "(its log says why: OOM while profiling, or a bucket it did not tune)")

    def stages_us(self, x):
        """GEMM1 and GEMM2 alone at this token count with the winning tactics, through the GEMM profiler
        FlashInfer's autotuner times them with (its own balanced routing, not the bench's)."""
        won = self._winner(x.shape[0])
        if won is None or not isinstance(won[1], (tuple, list)):
            return {}
        runner, (t1, t2) = won
        inner, v = runner._inner, self.view
        inputs = [x, v["fc1_expert_weights"], None, v["fc2_expert_weights"], None]
        out = {"routing": "FlashInfer's GEMM profiler (balanced), same token count"}
        for stage, tactic in ((1, t1), (2, t2)):
            inner.forward(inputs, tactic=tactic, do_preparation=True, gemm_idx=stage)
            out[f"gemm{stage}"], _ = time_fn(lambda s=stage, t=tactic: inner.forward(inputs, tactic=t, gemm_idx=s),
                                             use_graph=False)
        return out


@dataclass(frozen=True)
class SortedRouting:
    """The pairs of [T, k] local ids sorted by expert, as matmul_ogs' routing metadata indexes them: its
    bitmatrix metadata's ``col_sorted_indx`` (``combine``) and ``row_sorted_indx`` (``dispatch``)."""

    hist: torch.Tensor  # int32 [E]: pairs per local expert
    combine: torch.Tensor  # int32 [T*k]: sorted position -> flat pair index t*k + j (-1 past the local pairs)
    dispatch: torch.Tensor  # int32 [T*k]: flat pair index -> sorted position (-1: the pair is on another rank)
    gate_scal: torch.Tensor  # fp32 [T*k]: route weights in sorted order


def sorted_routing(local_ids: torch.Tensor, weights: torch.Tensor, n_exp: int) -> SortedRouting:
    """SortedRouting of ``local_ids`` [T, k] (-1: a pair on another rank), built on the device without a
    host sync (stable sort by expert, scatter-add counts), so the whole MoE call stays capturable.

    matmul_ogs reads it as: GEMM1 row s = x[combine[s] // k] (GatherIndx(src=combine, dst=dispatch));
    GEMM2 writes row s to pair slot combine[s], times gate_scal[s] (ScatterIndx(src=dispatch,
    dst=combine)); the top-k reduce sums the k slots of a token where dispatch != -1. Why not the
    snapshot's own ``SparseMatrix`` path: its bitmatrix metadata kernel needs a power-of-2 top-k
    (``tl.arange(0, 32 * k)``), DeepSeek's is 6 (vLLM patches that kernel; a peer is run as shipped)."""
    flat = local_ids.reshape(-1)
    key = torch.where(flat < 0, n_exp, flat)
    order = torch.sort(key, stable=True).indices  # sorted position -> flat pair index
    hist = torch.zeros(n_exp + 1, dtype=torch.int32, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))[:n_exp]
    combine = torch.where(key[order] < n_exp, order, -1).to(torch.int32)
    dispatch = torch.empty_like(combine).scatter_(0, order, torch.arange(flat.numel(), dtype=torch.int32,
                                                                          device=flat.device))
    dispatch = torch.where(flat < 0, -1, dispatch)
    return SortedRouting(hist, combine, dispatch, weights.reshape(-1).float()[order])


class TritonKernelsOGS(Peer):
    """OpenAI triton_kernels ``matmul_ogs`` MoE, as vLLM's Triton MXFP4 path calls it (module docstring)."""

    name = "triton_kernels"

    def __init__(self) -> None:
        super().__init__()
        try:
            import triton
            from triton_kernels import matmul_ogs as ogs
            from triton_kernels import tensor as tkt
            from triton_kernels.numerics import InFlexData
            from triton_kernels.tensor_details import layout
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
            raise PeerUnavailable(f"{self.name}: import triton_kernels failed ({type(exc).__name__}: {str(exc)[:200]}); "
                                  f"put .peers/triton_kernels on PYTHONPATH ({PEERS_README})") from None
        self.ogs, self.tkt, self.layout, self.InFlexData = ogs, tkt, layout, InFlexData
        self.version = f"triton_kernels of triton {triton.__version__}"
        self.device = require_cuda(self.name)
        self.config = ("matmul_ogs x bf16 / w MXFP4 on make_default_matmul_mxfp4_w(_scale)_layout(mx_axis=1, num_warps=8); "
                       "GEMM1 gather + fused DeepSeek SwiGLU (FnSpecs epilogue), GEMM2 scatter + route weights + top-k "
                       "reduce; routing metadata: stable sort by expert + make_ragged_tensor_metadata (the snapshot's "
                       "bitmatrix path needs a power-of-2 top-k)")
        self.scope = "whole MoE call: routing metadata + GEMM1 + SwiGLU + GEMM2 + top-k reduce (bf16 token rows in and out)"

    def _swizzled(self, t: torch.Tensor, layout_pair, dtype=None):
        cls, opts = layout_pair
        return self.tkt.convert_layout(self.tkt.wrap_torch_tensor(t, dtype=dtype), cls, **opts)

    def load(self, weights, shape, *, max_tokens, ep_size=1, ep_rank=0):
        key = weights_key(weights)
        if key != self.loaded_key:
            self.release()
            torch.cuda.empty_cache()
            tk = to_triton_kernels(weights.to(self.device))
            value = self.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            scale = self.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            fp4 = self.tkt.FP4
            self.w1, self.w2 = self._swizzled(tk.w1, value, fp4), self._swizzled(tk.w2, value, fp4)
            flex = self.ogs.FlexCtx(rhs_data=self.InFlexData())
            self.pc1 = self.ogs.PrecisionConfig(weight_scale=self._swizzled(tk.w1_scale, scale), flex_ctx=flex)
            self.pc2 = self.ogs.PrecisionConfig(weight_scale=self._swizzled(tk.w2_scale, scale), flex_ctx=flex)
            self.loaded_key = key
        from .peer_swiglu import fused_activation

        self.experts, self.shape, self.ep_size, self.ep_rank = weights.num_experts, shape, ep_size, ep_rank
        self.activation = fused_activation(shape.swiglu_limit)

    def routing(self, local_ids: torch.Tensor, weights: torch.Tensor):
        """(RoutingData, GatherIndx, ScatterIndx) of [T, k] local ids (sorted_routing) with the peer's
        ragged metadata: what vLLM builds from its bitmatrix, with the same index conventions."""
        r = sorted_routing(local_ids, weights, self.experts)
        ragged = self.tkt.make_ragged_tensor_metadata(r.hist, local_ids.numel())
        rd = self.ogs.RoutingData(r.gate_scal, r.hist, self.experts, local_ids.shape[1], ragged)
        return rd, self.ogs.GatherIndx(r.combine, r.dispatch), self.ogs.ScatterIndx(r.dispatch, r.combine)

    def bind(self, x, ids, weights):
        lo = self.ep_rank * self.experts
        here = (ids >= lo) & (ids < lo + self.experts)
        local = torch.where(here, ids - lo, -1).contiguous()
        w = weights.float().contiguous()
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.shape.hidden, dtype=torch.bfloat16, device=x.device)
        ogs = self.ogs

        def call():
            rd, gather, scatter = self.routing(local, w)
            inter = ogs.matmul_ogs(x, self.w1, None, rd, gather_indx=gather, precision_config=self.pc1,
                                   fused_activation=self.activation)
            return ogs.matmul_ogs(inter, self.w2, None, rd, scatter_indx=scatter, precision_config=self.pc2,
                                  gammas=rd.gate_scal, y=out)

        return call

    def tactic(self, tokens):
        return "matmul_ogs opt_flags heuristics (no autotuner)"

    def release(self):
        self.w1 = self.w2 = self.pc1 = self.pc2 = None
        self.loaded_key = None


def run_peers(ready: list[Peer], weights: ExpertWeights, shape: PeerShape, x: torch.Tensor, ids: torch.Tensor,
              route_weights: torch.Tensor, check, *, max_tokens: int, ep_size: int = 1, ep_rank: int = 0) -> list[PeerResult]:
    """Each ready peer loaded with ``weights`` (a no-op when it holds them already) and timed on one
    routing (time_peer); a peer whose weights fail to load gets a result with the error. A load that
    runs out of GPU memory first releases every peer's converted weights (they are made again when next
    needed) and tries once more: the peers' copies of 192 experts do not fit beside each other on an H100."""
    out = []
    for peer in ready:
        try:
            try:
                peer.load(weights, shape, max_tokens=max_tokens, ep_size=ep_size, ep_rank=ep_rank)
            except torch.cuda.OutOfMemoryError:
                release_all(ready)
                peer.load(weights, shape, max_tokens=max_tokens, ep_size=ep_size, ep_rank=ep_rank)
        except Exception as exc:  # noqa: BLE001 - recorded in the JSON
            r = PeerResult(peer.name, weights.num_experts, x.shape[0], 0, ep_size, ep_rank, version=peer.version,
                           config=peer.config, scope=peer.scope, error=f"load: {type(exc).__name__}: {str(exc)[:400]}")
            peer.loaded_key = None
            print(peer_line(r), flush=True)
            out.append(r)
            continue
        out.append(time_peer(peer, x, ids, route_weights, check))
    return out


def release_all(ready: list[Peer]) -> None:
    """Every peer's converted weights dropped and the allocator's cache returned: when a load runs out of
    memory, and after the emulated rank's peers ran (bench_layer_emulated.link_peers)."""
    for peer in ready:
        peer.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_peer(name: str, tune_cache: str | None = None) -> Peer:
    """The peer ``name`` (PEER_NAMES), or PeerUnavailable saying why it cannot run here."""
    if name == "flashinfer_humming":
        return FlashInferCutlass("humming", tune_cache)
    if name == "flashinfer_w4a16":
        return FlashInferCutlass("w4a16", tune_cache)
    if name == "triton_kernels":
        return TritonKernelsOGS()
    if name in ("vllm_humming", "vllm_humming_block_fp8"):  # vLLM 0.34's humming experts: peer_vllm_humming.py
        from .peer_vllm_humming import make_peer as make_vllm_humming

        return make_vllm_humming("mxfp4" if name == "vllm_humming" else "fp8_block")
    if name == "deepgemm_block_fp8":  # DeepGEMM's m-grouped FP8 GEMMs: peer_deepgemm_block_fp8.py
        from .peer_deepgemm_block_fp8 import make_peer as make_deepgemm

        return make_deepgemm()
    if name == "flashinfer_megamoe_sm90":  # FlashInfer 0.7.4's fused SM90 MegaMoE: peer_flashinfer_megamoe.py
        from .peer_flashinfer_megamoe import make_peer as make_flashinfer_megamoe

        return make_flashinfer_megamoe()
    raise ValueError(f"unknown peer {name!r}; expected one of {PEER_NAMES + BLOCK_FP8_PEER_NAMES}")


def select(names: list[str] | None, tune_cache: str | None = None) -> tuple[list[Peer], list[Skipped]]:
    """The peers asked for (``names``: [] or None = all) that can run here, and the others with the reason."""
    ready, skipped = [], []
    for name in names or PEER_NAMES:
        try:
            ready.append(make_peer(name, tune_cache))
        except PeerUnavailable as exc:
            skipped.append(Skipped(name, str(exc)))
    for s in skipped:
        print(f"  peer skipped: {s.reason}", file=sys.stderr)
    return ready, skipped
