"""Facts and knobs builders shared by the ROCm-path tests (importable: tests/rocm is on sys.path)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

from megamoe_backend.knobs import Knobs
from megamoe_backend.platform import MoEShape, RocmAsk
from megamoe_backend.platform.facts import AiterCaps, PackageInfo, PlatformFacts

# The two checkpoints vLLM 0.34's aiter_mega_moe serves (spec/presets.py): DeepSeek V4 Pro (384 experts,
# 48 per rank at EP 8: aiter's fixed-slot geometry) and R1 MXFP4 (256 experts, 32 per rank: not).
V4_PRO = MoEShape(hidden=7168, inter=3072, topk=6)
R1 = MoEShape(hidden=7168, inter=2048, topk=8)
V4_FLASH = MoEShape(hidden=5120, inter=2304, topk=6)  # 384 experts


def rocm_ask(shape=V4_PRO, ep_rank=0, device_index=None, **kw) -> RocmAsk:
    """The layer's start-up question for selection; the probes ask the (fake) installed aiter / mori."""
    return RocmAsk(shape=shape, ep_rank=ep_rank, device_index=device_index, **kw)


def use_scale_row_mori(fakes, monkeypatch) -> None:
    """A mori with ROCm/mori#593's per-token scale row: ``hip_backend.scale_stride_bytes`` and
    ``EpDispatchPlan(scale_bytes=)`` (the 624002c8 fake has neither)."""
    import mori.ops.dispatch_combine_v2.hip_backend as hip

    hip.install_pr593(monkeypatch)


def use_a4w4_plan_builder(fakes, monkeypatch) -> None:
    """aiter's A4W4 revision of mega_moe_config.py: ``build_mega_moe_bundle_plan(..., a_dtype=, p2p_quant=)``."""
    cfg = fakes.aiter.ops.flydsl.kernels.mega_moe.mega_moe_config
    monkeypatch.setattr(cfg, "build_mega_moe_bundle_plan", cfg.build_mega_moe_bundle_plan_a4w4)


def packages(**importable) -> dict:
    names = ("mori", "aiter", "flydsl", "triton")
    versions = {"mori": "1.2.4", "aiter": "0.1.10.dev", "flydsl": "0.1", "triton": "3.6.0"}
    return {n: PackageInfo(n, bool(importable.get(n, False)), versions[n] if importable.get(n) else None) for n in names}


V2_CAPS = AiterCaps(  # ROCm/aiter 4d06fb8d MegaMoEV2
    v2_init=("rank", "world_size", "model_dim", "inter_dim", "experts", "topk", "quant", "w1", "w1_scale", "w2",
             "w2_scale", "max_tok_per_rank", "mega_scheme", "swiglu_limit", "fanout_masks"),
    v2_forward=("x_bf16", "wts", "topk_ids", "stream", "slice_output", "mask_invalid_slots", "w1", "w1_scale", "w2",
                "w2_scale", "config_tokens"),
)
GFX1250_INIT_OLD = ("communicator", "rank", "world_size", "model_dim", "inter_dim", "experts", "topk",
                    "max_tokens_per_rank", "activation", "gate_mode", "quant_type", "hidden_pad", "intermediate_pad",
                    "swiglu_limit", "situ_beta", "situ_linear_beta", "dispatch_backend")
GFX1250_INIT_NEW = GFX1250_INIT_OLD + ("dispatch_wire", "stage1_fused", "combine_quant")
GFX1250_CAPS_OLD = AiterCaps(gfx1250_init=GFX1250_INIT_OLD, gfx1250_forward=("hidden_states", "topk_weights", "topk_ids"))
GFX1250_CAPS_NEW = AiterCaps(gfx1250_init=GFX1250_INIT_NEW, gfx1250_forward=("hidden_states", "topk_weights", "topk_ids", "combine_quant"))


def rocm_facts(arch="gfx950", caps=None, force_a8w4=None, **pkgs) -> PlatformFacts:
    pk = dict(mori=True, aiter=True, flydsl=True, triton=True)
    pk.update(pkgs)
    if caps is None:
        caps = V2_CAPS if arch == "gfx950" else GFX1250_CAPS_NEW
    return PlatformFacts(
        device="rocm", torch_build="rocm", torch_version="2.9.0+rocm7.0", hip_version="7.0.0", gfx_arch=arch,
        gpu_count=8, packages=packages(**pk), aiter_caps=caps, aiter_force_a8w4_raw=force_a8w4,
    )


def cuda_facts(triton=True) -> PlatformFacts:
    return PlatformFacts(device="cuda", torch_build="cuda", torch_version="2.9.0+cu128", cuda_version="12.8",
                         gpu_count=8, packages=packages(triton=triton))


def cpu_facts(**pkgs) -> PlatformFacts:
    return PlatformFacts(device="cpu", torch_build="cpu", torch_version="2.13.0+cpu", packages=packages(**pkgs))


def knobs(**kw) -> Knobs:
    return Knobs(**kw)


def loose_knobs(**kw):
    """Knobs with a value the core reader does not accept yet (e.g. MEGA_DISPATCH=flydsl)."""
    base = dict(dispatch_wire="bf16", combine_wire="bf16", transport="auto", max_tokens_per_rank=8192, aiter_force_a8w4=None)
    base.update(kw)
    return SimpleNamespace(**base)


@dataclass(frozen=True)
class FakeGroup:
    """An EP process group: the global ranks it holds, in group-rank order."""

    ranks: tuple[int, ...] = (0, 1)


@dataclass
class FakeDist:
    """torch.distributed's group semantics for one rank: ``src`` of broadcast_object_list is a *global*
    rank and must belong to the group (torch: ValueError "Global rank N is not part of group",
    distributed_c10d.get_group_rank). Non-root ranks receive ``received`` (a well-formed 128-byte id)."""

    rank: int = 0  # this process's rank in the group
    log: list = field(default_factory=list)
    received: object = b"U" * 128

    def get_rank(self, group) -> int:
        return self.rank

    def get_world_size(self, group) -> int:
        return len(group.ranks)

    def get_global_rank(self, group, group_rank: int) -> int:
        return group.ranks[group_rank]

    def broadcast_object_list(self, box, src, group) -> None:
        if src not in group.ranks:
            raise ValueError(f"Global rank {src} is not part of group {group}")
        self.log.append(("broadcast_object_list", type(box[0]).__name__, src, group))
        if group.ranks.index(src) != self.rank:
            box[0] = self.received


def run_ranks(fn, ep: int, timeout_s: float = 300.0) -> list:
    """``fn(rank)`` for every EP rank, one thread each (the fake mori fabric's collectives wait for all);
    the first error of any rank is raised."""
    out, errors = [None] * ep, []

    def work(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 (surfaced below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(ep)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout_s)
    if errors:
        raise errors[0]
    return out
