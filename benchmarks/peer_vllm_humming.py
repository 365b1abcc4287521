"""Peer ``vllm_humming``: vLLM 0.34's Hopper MXFP4 MoE experts, as vLLM runs them for DeepSeek V4.

On Hopper, vLLM 0.33 / 0.34 run DeepSeek V4's MXFP4 experts through humming-kernels
(``Mxfp4MoeBackend.HUMMING``); without EP the experts class is ``HummingIndexedExperts``
(``fused_moe/experts/fused_humming_moe.py``), and ``fused_moe/oracle/mxfp4.py`` runs the checkpoint's MXFP8
activations "as block FP8 (group 128) on Hopper" (activation key ``kFp8Dynamic128Sym``). This peer is
that path, step for step, with vLLM's own functions where they import without an engine:

weights (``load``), as ``convert_to_mxfp4_moe_kernel_format`` -> ``convert_to_humming_moe_kernel_format``
(``quantization/utils/humming/moe.py``) prepares them:
  - weight schema ``BaseWeightSchema.from_config({"quant_method": "mxfp4"})`` (humming's MXFP4 schema),
    ``convert_humming`` with the gated stacks ``[I, I]`` (w13) / ``[H]`` (w2);
  - input schema ``quant_key_to_input_schema(kFp8Dynamic128Sym)`` (vLLM's: e4m3, fp32 scale per 128
    columns, dynamic group), ``convert_humming``, then ``check_and_fallback_input_schema(...,
    allow_fallback=False)`` as the oracle calls it;
  - ``prepare_and_transform_humming_tensors`` (pad N to 256, K to 128, bf16, no bias), the whole layer at
    once as vLLM does;
  - tuning ``get_heuristics_config`` with vLLM's compute config (``use_batch_invariant`` =
    ``envs.VLLM_BATCH_INVARIANT``, ``use_f16_accum`` = ``envs.VLLM_HUMMING_USE_F16_ACCUM``: both False
    by default, gemm type ``indexed``), locks ``create_humming_locks``.
  Re-expressed here (vLLM's versions need a ``RoutedExperts`` layer and a vLLM config): the sequence of
  those calls (``_process_single_sublayer`` without its parameter bookkeeping) and the oracle's choice of
  the input schema (``_humming_input_schema`` reads the vLLM config for a user override; none here).
  The bench's MXFP4 bytes go in unchanged; only the GEMM1 rows move to vLLM's ``[gate; up]`` order
  (``to_vllm_mxfp4``; humming's ``binary_split`` activation reads gate = first half, up = second).

per call (``bind``), what ``HummingIndexedExperts.apply`` runs behind vLLM's no-EP prepare step:
  1. the prepare step's block-FP8 quantisation (``_prequantizes_dispatch_activation`` is True for this
     key, so vLLM quantises before the experts: ``moe_kernel_quantize_input`` -> ``_fp8_quantize`` ->
     ``per_token_group_quant_fp8(x, 128)``, row-major fp32 scales [T, H/128], ue8m0 off on Hopper).
     vLLM prefers its CUDA op ``_C.per_token_group_fp8_quant`` there; the carried bundle (.engine-gpu)
     has that op's sm_90 image zeroed, so this peer launches vLLM's own Triton fallback kernel
     (``fp8_utils._per_token_group_quant_fp8``, the launch re-expressed with the fallback's arguments):
     same bytes out except the scale's last ulp in some groups, a similar one-pass kernel in time;
  2. ``moe_align_block_size`` (vLLM's, ``_moe_C``) at the w13 tuning bucket's BLOCK_M for
     ``valid_shape_m`` = T * top_k (``pick_block_size``: vLLM's loop, 64 if no bucket holds M), and again
     at the w2 bucket's BLOCK_M when it differs;
  3. ``humming_forward`` w13 (vLLM's ``vllm.utils.humming`` facade -> humming), FP8 input + its scales;
  4. ``may_process_input`` w2 with DeepSeek V4's activation, ``get_humming_activation(SILU,
     ApplyMoEActivationConfig(clamp_limit=swiglu_limit))`` (vLLM's: the clamped SiLU, alpha 1, beta 0,
     limit 10): SwiGLU + FP8 group-128 quantisation in one humming kernel;
  5. ``humming_forward`` w2 (top_k 1 over the pair rows);
  6. ``moe_fused_mul_sum`` (vLLM's Triton finalize): the route-weighted sum per token, bf16 out.

Buffers are allocated once in ``bind`` (the shapes ``get_buffer_metas`` gives); the routing-dependent host
values (``valid_shape_m``, block sizes) are fixed there, so the call is capturable in one CUDA graph the
way the bench times peers. Not covered: EP (vLLM then runs ``HummingGroupedExperts``, another GEMM type).

Block-FP8 twin (``vllm_humming_block_fp8``, ``make_peer("fp8_block")``): the same six steps on a DeepSeek V3 / R1
FP8 checkpoint's experts (e4m3, fp32 ``weight_scale_inv`` per 128 x 128 block, rows [gate; up]), with the weight
schema ``_humming_fp8_weight_schema`` gives for them (``{"quant_method": "fp8", "weight_block_size": [128, 128]}``:
humming repeats each block scale over its 128 rows, in bf16) and the same group-128 FP8 activations, i.e. humming's
``(kFp8Static128BlockSym, kFp8Dynamic128Sym)`` pair. vLLM runs it with ``--moe-backend humming`` and an FP8 input
config (``VLLM_HUMMING_INPUT_QUANT_CONFIG``; without one humming reads bf16 activations); its Hopper default for
block-FP8 is Triton at ep_size 1 and FlashInfer CUTLASS under EP (``oracle/fp8.py``). It answers how fast
humming's block-FP8 GEMMs run on these shapes, beside the project's and vLLM's Triton ones.

Needs: the vLLM 0.34 bundle (``. .engine-gpu/setup_device.sh .engine-gpu``), humming-kernels (``.whl``),
a CUDA sm_90 GPU; otherwise the peer is skipped with the reason.
"""

from __future__ import annotations

import json
import math

import torch

from megamoe_backend.experts import ExpertWeights

PEER = "vllm_humming"
# weights fmt -> (peer name, humming weight schema config as vLLM builds it for that checkpoint)
SCHEMES = {"mxfp4": (PEER, {"quant_method": "mxfp4"}),
           "fp8_block": ("vllm_humming_block_fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})}
GROUP = 128  # kFp8Dynamic128Sym: one fp32 scale per 128 activation columns
DEFAULT_BLOCK = 64  # HummingIndexedExperts: "No tuning config found ... using default block_size=64"
BUNDLE_FIX = ("on the GPU machine: . .engine-gpu/setup_device.sh .engine-gpu (vLLM 0.34 bundle) and "
              "pip install --no-deps --target /tmp/site .whl/*.whl (humming-kernels) on PYTHONPATH")


def pick_block_size(tuning, valid_m: int, default: int = DEFAULT_BLOCK) -> int:
    """BLOCK_M of the first tuning bucket (lo, hi, config) with lo < valid_m <= hi, else ``default``:
    HummingIndexedExperts.prepare_humming_moe_kwargs's loop, as written (no special case for hi <= 0)."""
    for lo, hi, cfg in tuning:
        if lo < valid_m <= hi:
            return int(cfg["block_shape"][0])
    return default


def valid_shape_m(tokens: int, topk: int, local_experts: int, global_experts: int) -> int:
    """HummingExpertsBase.estimate_local_valid_shape_m without DP metadata."""
    return math.ceil(tokens * topk * local_experts / global_experts)


def to_vllm_mxfp4(w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bench's MXFP4 weights as vLLM's MXFP4 MoE checkpoint tensors: w13 [E, 2I, H/2] uint8 rows
    [gate; up] (even element in the low nibble, as the project), E8M0 scales [E, 2I, H/32] uint8, w2
    [E, H, I/2] / [E, H, I/32]. Bytes unchanged; only GEMM1 rows move."""
    if w.fmt != "mxfp4":
        raise ValueError(f"{PEER}: needs MXFP4 expert weights, got fmt={w.fmt!r}")
    w = w.as_rowmajor()

    def plain(t: torch.Tensor) -> torch.Tensor:
        if w.gate_up_layout == "interleaved":  # [g0, u0, g1, u1, ...] -> [gate; up]
            return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()
        return t.contiguous()

    return plain(w.w1), plain(w.w1_scale), w.w2.contiguous(), w.w2_scale.contiguous()


def checkpoint_tensors(w: ExpertWeights) -> tuple[dict, dict]:
    """The sublayers' checkpoint tensors as vLLM hands them to humming's schema: MXFP4 (``to_vllm_mxfp4``) ->
    ``weight`` / ``weight_scale``; block-FP8 -> ``weight`` [E, N, K] e4m3 / ``weight_scale_inv`` [E, N/128, K/128]
    fp32 (plain [gate; up] rows, as the checkpoint and the project's fp8_block weights hold them)."""
    if w.fmt == "mxfp4":
        w13, s13, w2, s2 = to_vllm_mxfp4(w)
        return {"weight": w13, "weight_scale": s13}, {"weight": w2, "weight_scale": s2}
    if w.fmt == "fp8_block":
        if w.gate_up_layout != "plain":
            raise ValueError(f"{SCHEMES['fp8_block'][0]}: block-FP8 weights must hold [gate; up] rows")
        return ({"weight": w.w1.contiguous(), "weight_scale_inv": w.w1_scale.float().contiguous()},
                {"weight": w.w2.contiguous(), "weight_scale_inv": w.w2_scale.float().contiguous()})
    raise ValueError(f"{PEER}: weights fmt {w.fmt!r}; expected one of {tuple(SCHEMES)}")


def _unavailable(reason: str, name: str = PEER):
    from .peer_api import PeerUnavailable

    return PeerUnavailable(f"{name}: {reason}")


def _import_stack() -> dict:
    """vLLM 0.34's and humming's functions this peer calls; PeerUnavailable with the reason if any is missing."""
    try:
        import vllm
        from vllm import envs
        from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig, MoEActivation
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
        from vllm.model_executor.layers.fused_moe.moe_fused_mul_sum import moe_fused_mul_sum
        from vllm.model_executor.layers.quantization.utils.fp8_utils import _per_token_group_quant_fp8
        from vllm.model_executor.layers.quantization.utils.humming.activation import get_humming_activation
        from vllm.model_executor.layers.quantization.utils.humming.schema import (
            check_and_fallback_input_schema,
            quant_key_to_input_schema,
        )
        from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max, kFp8Dynamic128Sym
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
        raise _unavailable(f"import vLLM 0.34 failed ({type(exc).__name__}: {str(exc)[:200]}); {BUNDLE_FIX}") from None
    try:
        import humming
        from vllm.utils import humming as vh

        stack = {name: getattr(vh, name) for name in (
            "BaseWeightSchema", "GemmType", "prepare_and_transform_humming_tensors", "get_heuristics_config",
            "humming_forward", "may_process_input", "create_humming_locks")}
    except Exception as exc:  # noqa: BLE001
        raise _unavailable(f"import humming (through vllm.utils.humming) failed ({type(exc).__name__}: "
                           f"{str(exc)[:200]}); {BUNDLE_FIX}") from None
    stack.update(vllm=vllm, envs=envs, humming=humming, ApplyMoEActivationConfig=ApplyMoEActivationConfig,
                 MoEActivation=MoEActivation, moe_align_block_size=moe_align_block_size,
                 moe_fused_mul_sum=moe_fused_mul_sum, quant_kernel=_per_token_group_quant_fp8,
                 get_humming_activation=get_humming_activation,
                 check_and_fallback_input_schema=check_and_fallback_input_schema,
                 quant_key_to_input_schema=quant_key_to_input_schema, get_fp8_min_max=get_fp8_min_max,
                 kFp8Dynamic128Sym=kFp8Dynamic128Sym)
    return stack


def _env_flag(envs, name: str) -> bool:
    try:
        return bool(getattr(envs, name))
    except Exception:  # noqa: BLE001 - an env var vLLM 0.34 does not define: its default off
        return False


def make_peer(fmt: str = "mxfp4"):
    """The peer for weights ``fmt`` (SCHEMES), or PeerUnavailable: imports first (the reason a CPU box gives),
    then the GPU. Any other failure while making it is a skip with its reason too: the bench must not stop."""
    from .peer_api import PeerUnavailable

    try:
        return _make_peer(fmt)
    except PeerUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _unavailable(f"could not be made ({type(exc).__name__}: {str(exc)[:300]})", SCHEMES[fmt][0]) from None


def _make_peer(fmt: str):
    from .peer_api import Peer, require_cuda

    peer_name, schema_config = SCHEMES[fmt]
    stack = _import_stack()
    try:
        from megamoe_backend.experts.humming import library
    except Exception:  # noqa: BLE001
        library = None
    device = require_cuda(peer_name)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise _unavailable(f"sm_{major}{minor}: the peer is vLLM's Hopper (sm_90) humming path", peer_name)
    if library is not None:
        why = library.probe(device)
        if why:
            raise _unavailable(why, peer_name)

    class VllmHumming(Peer):
        name = peer_name
        weights_fmt = fmt

        def __init__(self) -> None:
            super().__init__()
            self.s, self.device = stack, device
            self.version = f"vllm {stack['vllm'].__version__} + humming-kernels {stack['humming'].__version__}"
            self.batch_invariant = _env_flag(stack["envs"], "VLLM_BATCH_INVARIANT")
            self.f16_accum = _env_flag(stack["envs"], "VLLM_HUMMING_USE_F16_ACCUM")
            self.compute = {"use_batch_invariant": self.batch_invariant, "use_f16_accum": self.f16_accum,
                            "gemm_type": stack["GemmType"].INDEXED.value}
            self.config = (f"HummingIndexedExperts (no EP): {fmt} weights (humming schema {json.dumps(schema_config)}) x "
                           f"FP8 e4m3 group-128 "
                           f"activations (kFp8Dynamic128Sym), compute {json.dumps(self.compute)}, tuning "
                           "get_heuristics_config (no autotuner); A quant: vLLM's Triton per_token_group_quant_fp8 "
                           "kernel (the bundle zeroes the CUDA op vLLM prefers); one CUDA graph")
            self.scope = ("whole MoE call: block-FP8 A quant + moe_align_block_size + w13 GEMM + SwiGLU(limit)/FP8 "
                          "quant + w2 GEMM + moe_fused_mul_sum (bf16 token rows in and out)")
            self.layers = None
            self.blocks: dict[int, tuple[int, int]] = {}

        def release(self):
            self.layers = None
            self.loaded_key = None

        def _sublayer(self, name, tensors, shape_n, shape_k, stacks_n, num_experts):
            s = self.s
            weight = tensors["weight"]
            weight_schema = s["BaseWeightSchema"].from_config(dict(schema_config))
            wschema, tensors = weight_schema.convert_humming(
                tensors=tensors, shape_n_stacks=stacks_n, shape_k_stacks=[shape_k], param_dtype=torch.bfloat16,
                num_experts=num_experts)
            ischema = s["quant_key_to_input_schema"](s["kFp8Dynamic128Sym"])
            ischema, in_tensors = ischema.convert_humming(
                tensors=tensors, shape_n_stacks=stacks_n, shape_k_stacks=[shape_k], param_dtype=torch.bfloat16,
                num_experts=num_experts)
            ischema = s["check_and_fallback_input_schema"](weight_schema=wschema, input_schema=ischema,
                                                           param_dtype=torch.bfloat16, allow_fallback=False)
            tensors = {k: v for k, v in tensors.items() if k not in ("input_scale", "input_scale_2")}
            config, out = s["prepare_and_transform_humming_tensors"](
                tensors=tensors, shape_n=shape_n, shape_k=shape_k, pad_n_to_multiple=256, pad_k_to_multiple=128,
                input_schema=ischema, weight_schema=wschema, has_bias=False, num_experts=num_experts,
                torch_dtype=torch.bfloat16, device=weight.device)
            tuning = s["get_heuristics_config"](layer_config=config, use_f16_accum=self.f16_accum,
                                                use_batch_invariant=self.batch_invariant,
                                                gemm_type=s["GemmType"].INDEXED)
            mode = config.input_quant_mode
            if not (mode.should_quantize and mode.has_group_scale and config.input_scale_group_size == GROUP):
                raise RuntimeError(f"{peer_name} {name}: humming config is not FP8 group-{GROUP} input "
                                   f"({mode}, group {config.input_scale_group_size})")
            return {"config": config, "tensors": out, "tuning": tuning, "tuning_str": json.dumps(tuning),
                    "hadamard": getattr(wschema, "hadamard_block_size", 1)}

        def load(self, weights, shape, *, max_tokens, ep_size=1, ep_rank=0):
            from .peer_api import weights_key

            if ep_size != 1:
                raise RuntimeError(f"{peer_name}: EP ranks not covered (vLLM runs HummingGroupedExperts under EP)")
            key = weights_key(weights)
            self.experts, self.shape, self.ep_size, self.ep_rank = weights.num_experts, shape, 1, 0
            if key == self.loaded_key and self.layers is not None:
                return
            self.release()
            torch.cuda.empty_cache()
            t13, t2 = checkpoint_tensors(weights.to(self.device))
            e, inter, hidden = weights.num_experts, shape.intermediate, shape.hidden
            with torch.cuda.device(self.device):
                l13 = self._sublayer("w13", t13, 2 * inter, hidden, [inter, inter], e)
                del t13
                l2 = self._sublayer("w2", t2, hidden, inter, [hidden], e)
                del t2
                self.locks = self.s["create_humming_locks"](self.device)
            act_cfg = self.s["ApplyMoEActivationConfig"](clamp_limit=shape.swiglu_limit)
            self.activation = self.s["get_humming_activation"](self.s["MoEActivation"].SILU, act_cfg)
            self.layers = {"w13": l13, "w2": l2}
            self.blocks = {}
            self.loaded_key = key

        def _forward(self, name, inputs, input_scale, input_scale_2, outputs, **kw):
            layer = self.layers[name]
            t = layer["tensors"]
            return self.s["humming_forward"](
                layer["config"], inputs=inputs, weight=t["weight"], weight_scale=t.get("weight_scale"),
                zero_point=t.get("zero_point"), bias=t.get("bias"), weight_scale_2=t.get("weight_scale_2"),
                input_scale=input_scale, input_scale_2=input_scale_2, outputs=outputs, locks=self.locks,
                compute_config=json.dumps(self.compute), tuning_config=layer["tuning_str"], **kw)

        def bind(self, x, ids, weights):
            s, dev = self.s, x.device
            x = x.contiguous()
            t, k = ids.shape
            hidden, inter = self.shape.hidden, self.shape.intermediate
            if hidden % GROUP:
                raise RuntimeError(f"{peer_name}: hidden {hidden} is not a multiple of {GROUP}")
            ids32, w32 = ids.to(torch.int32).contiguous(), weights.float().contiguous()
            vm = valid_shape_m(t, k, self.experts, self.experts)
            bs1 = pick_block_size(self.layers["w13"]["tuning"], vm)
            bs2 = pick_block_size(self.layers["w2"]["tuning"], vm)
            self.blocks[t] = (bs1, bs2)
            c13, c2 = self.layers["w13"]["config"], self.layers["w2"]["config"]
            gate_up_dim = c13.shape_n - c13.pad_shape_n
            fp8 = torch.float8_e4m3fn
            xq = torch.empty(t, hidden, dtype=fp8, device=dev)
            xs = torch.empty(t, hidden // GROUP, dtype=torch.float32, device=dev)
            gate_up = torch.empty(t * k, gate_up_dim, dtype=torch.bfloat16, device=dev)
            qdown = torch.empty(t * k, inter, dtype=fp8, device=dev)
            down = torch.empty(t * k, hidden, dtype=torch.bfloat16, device=dev)
            out = torch.empty(t, hidden, dtype=torch.bfloat16, device=dev)
            fp8_min, fp8_max = s["get_fp8_min_max"]()
            mode2 = c2.input_quant_mode
            hb2 = self.layers["w2"]["hadamard"]
            e = self.experts

            def call():
                # 1. prepare: per_token_group_quant_fp8(x, 128) (vLLM's Triton fallback launch, row-major scales)
                s["quant_kernel"][(x.numel() // GROUP,)](
                    x, xq, xs, GROUP, x.shape[1], x.stride(0), 1e-10, fp8_min=fp8_min, fp8_max=fp8_max,
                    use_ue8m0=False, BLOCK=GROUP, num_warps=1, num_stages=1)
                # 2. align at the w13 (and w2) bucket's BLOCK_M
                sorted1, experts1, padded1 = s["moe_align_block_size"](
                    topk_ids=ids32, block_size=bs1, num_experts=e, expert_map=None, ignore_invalid_experts=True)
                sorted2, experts2, padded2 = (sorted1, experts1, padded1) if bs2 == bs1 else s["moe_align_block_size"](
                    topk_ids=ids32, block_size=bs2, num_experts=e, expert_map=None, ignore_invalid_experts=True)
                # 3. w13
                self._forward("w13", xq, xs, None, gate_up, sorted_ids=sorted1, expert_ids=experts1,
                              num_tokens_padded=padded1, valid_shape_m=vm, top_k=k)
                # 4. SwiGLU(limit) + FP8 group-128 quant (HummingExpertsBase.process_input("w2", ...))
                inputs2, group_scales, token_scales = s["may_process_input"](
                    c2, inputs=gate_up, outputs=qdown, token_scales=None, hadamard_block_size=hb2, layout="normal",
                    expert_tokens=None, scatter_idx=None, num_valid_tokens=None, **self.activation)
                scale2 = group_scales if mode2.has_group_scale else token_scales
                scale2_2 = token_scales if mode2.has_secondary_scale else None
                # 5. w2
                self._forward("w2", inputs2, scale2, scale2_2, down, sorted_ids=sorted2, expert_ids=experts2,
                              num_tokens_padded=padded2, valid_shape_m=vm, top_k=1)
                # 6. finalize
                s["moe_fused_mul_sum"](inputs=down.view(t, k, -1), topk_weights=w32, topk_ids=ids32,
                                       expert_map=None, outputs=out)
                return out

            return call

        def tactic(self, tokens):
            bs = self.blocks.get(tokens)
            return "" if bs is None else f"humming heuristics, BLOCK_M w13 {bs[0]} / w2 {bs[1]}"

    return VllmHumming()


def main(argv: list[str] | None = None) -> int:
    """Smoke run of this peer alone: ``python -m benchmarks.peer_vllm_humming --out X.json [--experts 48]
    [--tokens 8 1024]``; DSV4-Pro expert shapes, the bench's weights / routing / per-token relL2 (bench
    experts' TokenCheck), timed by peers.time_peer (warm, relL2, CUDA graph). Writes JSON after each step;
    a skip or an error is recorded, never raised."""
    import time
    import traceback

    from . import peer_api as peers
    from .peer_api import smoke_parser

    ap = smoke_parser("peer_vllm_humming")
    args = ap.parse_args(argv)
    t0 = time.time()
    rec: dict = {"args": vars(args), "results": []}

    def save():
        rec["wall_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)

    from dataclasses import asdict

    try:
        ready, skipped = [make_peer()], []
    except peers.PeerUnavailable as exc:
        ready, skipped = [], [peers.Skipped(PEER, str(exc))]
    rec["peers"] = peers.describe(ready, skipped)
    save()
    if not ready:
        print(json.dumps(rec, default=str))
        return 0
    peer = ready[0]
    try:
        from .bench_data import TokenCheck, make_routing, make_weights
        from .references import check_tokens

        dev = torch.device("cuda", torch.cuda.current_device())
        fp4, bf16 = make_weights(args.experts, args.hidden, args.intermediate, dev, 0)
        shape = peers.PeerShape(args.hidden, args.intermediate, args.topk, args.swiglu_limit)
        s = time.time()
        peer.load(fp4, shape, max_tokens=max(args.tokens))
        torch.cuda.synchronize()
        rec["load_s"] = round(time.time() - s, 1)
        rec["tuning"] = {n: [[lo, hi, cfg.get("block_shape")] for lo, hi, cfg in layer["tuning"]]
                         for n, layer in peer.layers.items()}
        save()
        for tokens in args.tokens:
            x, pairs = make_routing(tokens, args.experts, args.topk, args.hidden, dev, tokens)
            check = TokenCheck(x, pairs, bf16, args.swiglu_limit, check_tokens(tokens, peers.CHECK_TOKENS, 0, dev))
            ids, w = pairs.slot.view(tokens, args.topk), pairs.weight.view(tokens, args.topk)
            rec["results"].append(asdict(peers.time_peer(peer, x, ids, w, check.of_tokens)))
            save()
    except Exception as exc:  # noqa: BLE001 - recorded
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["trace"] = traceback.format_exc()[-3000:]
    save()
    print(json.dumps({k: v for k, v in rec.items() if k != "trace"}, default=str)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
