"""Fake aiter.ops.flydsl.kernels.mega_moe.mega_moe_config (ROCm/aiter 4d06fb8d): the plan builder.

``build_mega_moe_bundle_plan(mtpr, *, experts_per_rank, model_dim, inter_dim, world_size)`` is what
vLLM 0.34's ``DeepseekV4AiterMegaMoEExperts._uses_fixed_slot`` calls
(vllm/models/deepseek_v4/amd/mega_moe.py:179-190) and what MegaMoEV2's constructor calls
(mega_moe_v2.py:61-67). Its rules, restated from 4d06fb8d and failing as it fails (ValueError):
- ``mtpr`` a positive power of two that is one of ``TOKEN_BUCKETS`` (lines 13-29; "has no exact
  token bucket" above 32768);
- ``select_mega_moe_config`` for every bucket: world_size in [1, 8]; experts per rank <= 256
  (``MAX_FANOUT_EXPERTS_PER_RANK``, line 46); world * (experts per rank + 1) <= 1024 segments
  (``MAX_FANOUT_SEGMENTS``, line 45); DeepSeek-V4.1-Flash (5120, 2304, 384 experts) only at EP 2 / 4
  ("DeepSeek-V4.1-Flash MegaMoE requires EP2 or EP4"), whose buckets are ``FLASH_TOKEN_BUCKETS``;
- ``fixed_slot_dispatch`` (``_use_fixed_slots``): (EP, experts per rank) in {(8, 48), (2, 192),
  (4, 96)} and mtpr <= ``FIXED_SLOT_MAX_MTPR`` (``AITER_MEGA_FIXED_SLOT_MAX_MTPR``, default 255, read
  at import, line 35) or, at EP 2 / 4, ``envs.fixed_slot_max_mtpr(512 / 1024)``;
- the P2P (combine) wire of every entry: "none" (bf16) while ``mtpr_config_class(mtpr) <= 1024``
  (``P2P_FP8_MIN_MTPR``, line 32), "fp8_blockwise_1x32" above.
Kernel tile choices are not modelled: an entry holds its bucket and its P2P wire only.

``build_mega_moe_bundle_plan_a4w4`` is the A4W4 revision's builder (tests install it under the real
name): keyword ``a_dtype`` ("fp8" | "fp4", ``SUPPORTED_ACTIVATION_DTYPES``) and ``p2p_quant`` ("auto" |
"none" | "fp8_blockwise_1x32"); an fp4 plan starts the fp8 P2P combine at mtpr >= 1024.
"""

from bisect import bisect_left
from dataclasses import dataclass
from functools import cache

from . import envs

TOKEN_BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
FLASH_TOKEN_BUCKETS = tuple(range(1, 65)) + (96, 128, 192) + TOKEN_BUCKETS[7:]
P2P_FP8_MIN_MTPR = 1024
FIXED_SLOT_MAX_MTPR = envs.AITER_MEGA_FIXED_SLOT_MAX_MTPR
MAX_MTPR_CLASS = 32768
REFERENCE_EXPERTS_PER_RANK = 48
MAX_FANOUT_SEGMENTS = 1024
MAX_FANOUT_EXPERTS_PER_RANK = 256
_FLASH = (5120, 2304, 384)  # (model_dim, inter_dim, experts): DeepSeek-V4.1-Flash


@dataclass(frozen=True)
class MegaMoEConfig:
    p2p_quant: str


@dataclass(frozen=True)
class MegaMoEBundleEntry:
    token_bucket: int
    config: MegaMoEConfig


@dataclass(frozen=True)
class MegaMoEBundlePlan:
    mtpr: int
    fixed_slot_dispatch: bool
    entries: tuple


def nearest_token_bucket(tokens: int, buckets=TOKEN_BUCKETS) -> int:
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    index = bisect_left(buckets, tokens)
    if index == 0:
        return buckets[0]
    if index == len(buckets):
        return buckets[-1]
    lower, upper = buckets[index - 1], buckets[index]
    return upper if upper - tokens <= tokens - lower else lower


def mtpr_config_class(mtpr: int) -> int:
    return mtpr if mtpr <= P2P_FP8_MIN_MTPR else MAX_MTPR_CLASS


def _use_fixed_slots(mtpr: int, world_size: int, experts_per_rank: int) -> bool:
    geometry = (world_size, experts_per_rank)
    if geometry in ((2, 192), (4, 96)):
        limit = envs.fixed_slot_max_mtpr(512 if world_size == 2 else 1024)
    else:
        limit = FIXED_SLOT_MAX_MTPR
    return mtpr <= limit and geometry in ((8, 48), (2, 192), (4, 96))


def _is_flash(model_dim, inter_dim, experts_per_rank, world_size) -> bool:
    return (model_dim, inter_dim, experts_per_rank * world_size) == _FLASH


def select_mega_moe_config(tokens, mtpr, *, experts_per_rank=REFERENCE_EXPERTS_PER_RANK, model_dim=7168,
                           inter_dim=3072, world_size=8) -> MegaMoEConfig:
    if mtpr <= 0 or mtpr & (mtpr - 1):
        raise ValueError(f"mtpr={mtpr} must be a positive power of two")
    if tokens > mtpr:
        raise ValueError(f"tokens={tokens} exceeds mtpr={mtpr}")
    if experts_per_rank <= 0:
        raise ValueError(f"experts_per_rank must be positive, got {experts_per_rank}")
    if _is_flash(model_dim, inter_dim, experts_per_rank, world_size) and world_size not in (2, 4):
        raise ValueError("DeepSeek-V4.1-Flash MegaMoE requires EP2 or EP4")
    if not 0 < world_size <= 8:
        raise ValueError(f"world_size must be in [1, 8], got {world_size}")
    if model_dim <= 0 or inter_dim <= 0:
        raise ValueError(f"invalid model shape {model_dim}x{inter_dim}")
    if experts_per_rank > MAX_FANOUT_EXPERTS_PER_RANK:
        raise ValueError(f"MegaMoE v2 fanout pair ids support at most {MAX_FANOUT_EXPERTS_PER_RANK} experts per rank")
    total_segments = world_size * experts_per_rank + world_size
    if total_segments > MAX_FANOUT_SEGMENTS:
        raise ValueError(f"MegaMoE v2 fanout needs {total_segments} segments, exceeding the {MAX_FANOUT_SEGMENTS}-segment "
                         "route metadata limit")
    return MegaMoEConfig(p2p_quant="none" if mtpr_config_class(mtpr) <= P2P_FP8_MIN_MTPR else "fp8_blockwise_1x32")


@cache
def build_mega_moe_bundle_plan(mtpr: int, *, experts_per_rank: int = REFERENCE_EXPERTS_PER_RANK, model_dim: int = 7168,
                               inter_dim: int = 3072, world_size: int = 8) -> MegaMoEBundlePlan:
    from aiter import CALL_LOG

    CALL_LOG.append(("build_mega_moe_bundle_plan", dict(mtpr=mtpr, experts_per_rank=experts_per_rank,
                                                        model_dim=model_dim, inter_dim=inter_dim, world_size=world_size)))
    if mtpr <= 0 or mtpr & (mtpr - 1):
        raise ValueError(f"mtpr={mtpr} must be a positive power of two")
    token_buckets = FLASH_TOKEN_BUCKETS if _is_flash(model_dim, inter_dim, experts_per_rank, world_size) else TOKEN_BUCKETS
    buckets = tuple(b for b in token_buckets if b <= mtpr)
    if not buckets or buckets[-1] != mtpr:
        raise ValueError(f"mtpr={mtpr} has no exact token bucket")
    entries = tuple(
        MegaMoEBundleEntry(b, select_mega_moe_config(b, mtpr, experts_per_rank=experts_per_rank, model_dim=model_dim,
                                                     inter_dim=inter_dim, world_size=world_size))
        for b in buckets
    )
    return MegaMoEBundlePlan(mtpr=mtpr, fixed_slot_dispatch=_use_fixed_slots(mtpr, world_size, experts_per_rank),
                             entries=entries)


ACTIVATION_DTYPES = ("fp4", "fp8")
_BUILD_FP8 = build_mega_moe_bundle_plan.__wrapped__  # 4d06fb8d's, whatever tests bind the public name to


@cache
def build_mega_moe_bundle_plan_a4w4(mtpr: int, *, a_dtype: str = "fp8", p2p_quant: str = "auto",
                                    experts_per_rank: int = REFERENCE_EXPERTS_PER_RANK, model_dim: int = 7168,
                                    inter_dim: int = 3072, world_size: int = 8) -> MegaMoEBundlePlan:
    from aiter import CALL_LOG

    if a_dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"unsupported a_dtype={a_dtype!r}")
    plan = _BUILD_FP8(mtpr, experts_per_rank=experts_per_rank, model_dim=model_dim,
                                                  inter_dim=inter_dim, world_size=world_size)
    CALL_LOG[-1][1].update(a_dtype=a_dtype, p2p_quant=p2p_quant)
    if a_dtype != "fp4" or p2p_quant != "auto":
        return plan
    wire = "fp8_blockwise_1x32" if mtpr >= P2P_FP8_MIN_MTPR else "none"
    entries = tuple(MegaMoEBundleEntry(e.token_bucket, MegaMoEConfig(p2p_quant=wire)) for e in plan.entries)
    return MegaMoEBundlePlan(mtpr=plan.mtpr, fixed_slot_dispatch=plan.fixed_slot_dispatch, entries=entries)
