"""AMD-specific rules: which aiter runtime serves which arch, and what each one can honour.

Each rule restates a fact of the published aiter / mori code (sources in docs/rocm.md), so the
knob combinations those runtimes would reject or silently reinterpret are caught at startup with
a message naming the knob. Not run on AMD hardware.
"""

from __future__ import annotations

from ..knobs import KnobError

# gfx arch -> fused MegaMoE runtime class in aiter.
RUNTIME_BY_ARCH = {"gfx950": "MegaMoEV2", "gfx1250": "MegaMoEGfx1250"}

# aiter/ops/flydsl/kernels/mega_moe/mega_moe_v2.py (ROCm/aiter 4d06fb8d). Everything its plan builder
# decides (token buckets, fixed-slot geometries, EP and experts-per-rank limits, the P2P wire per bucket)
# is asked of the installed aiter at start-up (rocm_probes.py), not restated here; this is the
# constructor's own check, made before it calls the builder (and check_v2_device below its allocation):
V2_MAX_TOPK = 16  # mega_moe_v2.py:57-58 "MegaMoEV2 topk must be in [1, 16]"

# aiter/ops/flydsl/kernels/mega_moe_gfx1250/mega_moe.py (ROCm/aiter e4048607)
GFX1250_MAX_WORLD_SIZE = 72
GFX1250_MAX_EXPERTS_PER_RANK = 512
GFX1250_WAVE_SIZE = 32  # config.py:6 _WAVE_SIZE; topk must be in [1, wave size]
# The step size from which a quantised gfx1250 combine is named: aiter's own crossover for MegaMoEV2's
# P2P combine (mega_moe_config.py P2P_FP8_MIN_MTPR = 1024: bf16 up to 1024, fp8_blockwise_1x32 above).
GFX1250_QUANT_COMBINE_MIN_TOKENS = 1024
# aiter/ops/shuffle.py shuffle_scale_n32k4 (e4048607, lines 283-288), what moe_shuffle_scale runs on
# gfx1250: scale rows N % 32 == 0 and K // 32 % 4 == 0 (K % 128), for w1 (N=2I, K=H) and w2 (N=H, K=I);
# K % 128 on both GEMMs implies the row condition.
GFX1250_SCALE_K_ALIGN = 128

# mori/ops/dispatch_combine.py (ROCm/mori 624002c8, lines 1485-1506): the blockwise combine quant
# runs on these kernel types only; InterNodeV1 raises ValueError at the first combine.
MORI_BLOCKWISE_COMBINE_KERNELS = ("IntraNode", "IntraNodeLL", "AsyncLL")

# Our combine wire name -> MegaMoEGfx1250's combine_quant name ("mxfp8 is what the mega_moe v2
# path calls fp8_blockwise_1x32", yhl-amd/aiter 22f2e2dc).
GFX1250_COMBINE_QUANT = {"bf16": "none", "fp8_blockwise_1x32": "mxfp8"}


class PlatformError(KnobError):
    """The knobs ask for something this machine (build, GPU, packages) cannot provide."""


def next_power_of_two(n: int) -> int:
    if n <= 0:
        raise ValueError(f"token count must be positive, got {n}")
    return 1 << (n - 1).bit_length()


def aiter_reads_force_a8w4(raw: str | None) -> bool:
    """How aiter's fused_moe reads AITER_FORCE_A8W4 on gfx1250.

    aiter/fused_moe.py: ``os.environ.get("AITER_FORCE_A8W4", "0") in ("1")`` -- ``("1")`` is the
    string "1", so this is substring containment: "1" and the empty string are True, "true"/"yes"
    are False. We model it exactly so a value our knob reader accepts differently is caught.
    """
    value = "0" if raw is None else raw
    return value in "1"


def gfx1250_a_operand(raw_force_a8w4: str | None) -> str:
    """The A operand aiter's grouped GEMM uses on gfx1250: fp8 when AITER_FORCE_A8W4 reads as 1."""
    return "fp8" if aiter_reads_force_a8w4(raw_force_a8w4) else "fp4"


def check_force_a8w4_agrees(knob_value: bool | None, raw: str | None) -> None:
    """Our Knobs and aiter must read AITER_FORCE_A8W4 the same way, or the wire check is moot."""
    aiter_fp8 = aiter_reads_force_a8w4(raw)
    ours_fp8 = bool(knob_value)
    if aiter_fp8 != ours_fp8:
        raise KnobError(
            f"AITER_FORCE_A8W4={raw!r}: MegaMoE reads this as {'1 (fp8 activations)' if ours_fp8 else 'unset/0 (fp4 activations)'} "
            f"but aiter's fused_moe (`in (\"1\")`, a substring test) reads it as {'1 (fp8)' if aiter_fp8 else 'not 1 (fp4)'}; "
            "set AITER_FORCE_A8W4=1 or AITER_FORCE_A8W4=0 (or unset it)"
        )


def check_gfx1250_wire(dispatch_wire: str, a_operand: str, raw_force_a8w4: str | None) -> None:
    """A quantised dispatch wire is the GEMM's A operand; on gfx1250 AITER_FORCE_A8W4 decides it."""
    if dispatch_wire != "bf16" and dispatch_wire != a_operand:
        raise KnobError(
            f"MEGA_DISPATCH_WIRE={dispatch_wire} contradicts AITER_FORCE_A8W4={raw_force_a8w4!r}: on gfx1250 "
            f"aiter's grouped GEMM takes {a_operand} activations, and a quantised wire must carry exactly "
            f"the A operand; use MEGA_DISPATCH_WIRE={a_operand} (or bf16), or set AITER_FORCE_A8W4="
            f"{'1' if dispatch_wire == 'fp8' else '0'}"
        )


def check_gfx1250_quant(math_a_format: str | None, quant: str, a_operand: str, raw_force_a8w4: str | None) -> None:
    """The model's scheme (a8w4 / a4w4) must be what aiter will compute on gfx1250."""
    if math_a_format is not None and math_a_format != a_operand:
        raise KnobError(
            f"the model's quant scheme is {quant} (A operand {math_a_format}) but AITER_FORCE_A8W4="
            f"{raw_force_a8w4!r} makes aiter compute {a_operand} activations on gfx1250; set AITER_FORCE_A8W4="
            f"{'1' if math_a_format == 'fp8' else '0'}"
        )


def check_gfx1250_shapes(hidden: int, inter: int) -> None:
    """aiter's gfx1250 scale shuffle folds scales into 32-row x 4-scale tiles; other shapes raise there.

    K % 128 for both GEMMs (w1: K = hidden, w2: K = intermediate) also gives the rows % 32 it needs.
    """
    bad = [f"{name}={v}" for name, v in (("hidden_size", hidden), ("moe_intermediate_size", inter))
           if v % GFX1250_SCALE_K_ALIGN]
    if bad:
        raise KnobError(
            f"this checkpoint's {' and '.join(bad)} cannot run aiter MegaMoEGfx1250: its weight-scale shuffle "
            f"(moe_shuffle_scale -> shuffle_scale_n32k4) needs hidden and intermediate sizes that are multiples "
            f"of {GFX1250_SCALE_K_ALIGN} (K // 32 % 4 == 0); use MEGA_DISPATCH=nccl to run this model with the "
            "triton experts instead"
        )


def gfx1250_dispatch(requested: str, dispatch_wire: str, mori_scale_row: bool,
                     takes_stage1_fused: bool) -> tuple[str | None, bool, str]:
    """(dispatch kernel or None, stage1_fused, why) for MegaMoEGfx1250; None: it cannot run this wire fused.

    ``requested``: MEGA_DISPATCH (auto | mori | flydsl). A bf16 wire runs aiter's default flydsl
    dispatch unless mori is asked for. A quantised (fp8 / fp4) wire ships sender-quantised rows with
    their E8M0 scale row, which two dispatches can carry:
    - mori's, where the installed mori lays the row down (ROCm/mori#593: ``hip_backend.scale_stride_bytes``,
      which aiter's ``MegaMoEConfig.dispatch_scale_dst_nbytes`` imports, and ``EpDispatchPlan(scale_bytes=)``);
    - aiter's flydsl one with ``stage1_fused=True`` (yhl-amd/aiter 22f2e2dc: "stage1_fused requires
      dispatch_backend='flydsl'" and "an fp8 or fp4 dispatch wire"; the compact plan carries the row
      in the wire row itself), which is how ATOM serves MEGA_DISPATCH=flydsl on such a wire
      (mega_transport_config.mega_dispatch_kwargs, "flydsl there runs aiter's compact plan").
    auto follows ATOM's default for a quantised wire (mori, "what such a wire always ran on",
    mori_v2_prepare_finalize.py ``_MEGA_DISPATCH_BACKEND``) and takes flydsl where mori cannot carry
    the row.
    """
    if dispatch_wire == "bf16":
        kernel = "mori" if requested == "mori" else "flydsl"
        return kernel, False, f"bf16 wire: {kernel} dispatch (MEGA_DISPATCH={requested})"
    flydsl_why = (f"flydsl dispatch with stage1_fused=True (aiter's compact plan carries the {dispatch_wire} rows' "
                  "scale row)")
    no_row = ("the installed mori's EPv2 has no per-token scale row (ROCm/mori#593: "
              "mori.ops.dispatch_combine_v2.hip_backend.scale_stride_bytes, which aiter imports)")
    if requested == "mori":
        if mori_scale_row:
            return "mori", False, f"mori dispatch carries the {dispatch_wire} rows and their scale row (MEGA_DISPATCH=mori)"
        fix = "MEGA_DISPATCH=flydsl" if takes_stage1_fused else "MEGA_DISPATCH_WIRE=bf16"
        return None, False, f"MEGA_DISPATCH=mori with MEGA_DISPATCH_WIRE={dispatch_wire}: {no_row}; set {fix} to fuse"
    if takes_stage1_fused and (requested == "flydsl" or not mori_scale_row):
        return "flydsl", True, flydsl_why + ("" if requested == "flydsl" else f" (MEGA_DISPATCH=auto: {no_row})")
    if not mori_scale_row:
        return None, False, (f"MEGA_DISPATCH_WIRE={dispatch_wire}: the installed aiter's MegaMoEGfx1250 takes no stage1_fused "
                             f"(its flydsl dispatch cannot carry the scale row) and {no_row}; set MEGA_DISPATCH_WIRE=bf16 "
                             "to fuse, or install yhl-amd/aiter 22f2e2dc or a mori with #593")
    if requested == "flydsl":
        return "mori", False, (f"MEGA_DISPATCH=flydsl with MEGA_DISPATCH_WIRE={dispatch_wire}: switched to the mori dispatch, "
                               "the installed aiter's flydsl one takes no stage1_fused and cannot carry the scale row")
    return "mori", False, f"quantised wire ({dispatch_wire}): mori dispatch carries the scale row, ATOM's default (MEGA_DISPATCH=auto)"


def gfx1250_step_combine_quant(built: str, bound: int | None) -> str:
    """The combine wire one MegaMoEGfx1250 step names (its forward's ``combine_quant``).

    22f2e2dc builds the quantised reduce at construction but runs it only on the steps that name it
    ("a quantized wire only pays off once there are enough tokens on it to outweigh the per-token
    quant/dequant pair"; omitted means bf16). ATOM names it on prefill steps only
    (``combine_quant_for_step``), and every rank must name the same one (the combine is P2P). Here the
    step's token bound is the same on every rank; a step above ``GFX1250_QUANT_COMBINE_MIN_TOKENS``
    per rank, or one without a bound (warm-up, as ATOM's no-context case), runs the quantised wire.
    """
    if built == "none" or (bound is not None and bound <= GFX1250_QUANT_COMBINE_MIN_TOKENS):
        return "none"
    return built


def gfx1250_topk_refusal(topk: int) -> str | None:
    """Why MegaMoEGfx1250 cannot route this top-k, or None: its dispatch takes top-k up to the wave size
    (22f2e2dc MegaMoEConfig: "dispatch requires topk in [1, _WAVE_SIZE]", config.py:6 ``_WAVE_SIZE = 32``)."""
    if 0 < topk <= GFX1250_WAVE_SIZE:
        return None
    return f"MegaMoEGfx1250's dispatch takes top-k in [1, {GFX1250_WAVE_SIZE}] (the gfx1250 wave size); this model routes {topk}"


def check_mori_combine_kernel(combine_wire: str, kernel_type: str) -> None:
    """mori's blockwise combine quantisation is intranode-only (and AsyncLL)."""
    if combine_wire != "bf16" and kernel_type not in MORI_BLOCKWISE_COMBINE_KERNELS:
        raise KnobError(
            f"MEGA_COMBINE_WIRE={combine_wire} needs mori's blockwise combine, which runs on "
            f"{'/'.join(MORI_BLOCKWISE_COMBINE_KERNELS)} kernels only; this EP group spans nodes (kernel_type "
            f"{kernel_type}): use MEGA_COMBINE_WIRE=bf16"
        )


def check_v2_device(ep_rank: int | None, device_index: int | None) -> str | None:
    """Why MegaMoEV2 cannot run on this process's GPU, or None: it allocates on ``cuda:<ep_rank>``
    (4d06fb8d mega_moe_v2.py:74 ``self.dev = torch.device("cuda", rank)``; its intranode op too,
    e4048607 flydsl_dispatch_combine_intranode_op.py:412, 555), which is this process's GPU only where the EP rank is the local device
    index (one EP group per node, every GPU visible). Two EP groups per node, or one visible GPU
    per process, put its buffers on another rank's GPU (or none)."""
    if ep_rank is None or device_index is None or ep_rank == device_index:
        return None
    return (f"aiter MegaMoEV2 allocates on cuda:{ep_rank} (its EP rank, mega_moe_v2.py:74) but this process runs on "
            f"cuda:{device_index}: it needs every EP rank on the GPU whose index is its rank (one EP group per node, "
            "all GPUs visible)")


def check_experts_divisible(num_experts: int | None, ep_size: int | None) -> int | None:
    """Both aiter runtimes and mori's config need the same expert count on every rank."""
    if num_experts is None or ep_size is None:
        return None
    if ep_size <= 0:
        raise KnobError(f"EP size must be positive, got {ep_size}")
    if num_experts % ep_size:
        raise KnobError(
            f"{num_experts} routed experts do not divide over EP size {ep_size}: mori's "
            "num_experts_per_rank and aiter's MegaMoE runtimes need an equal count on every rank"
        )
    return num_experts // ep_size
