"""Fake aiter.ops.shuffle: the four helpers MegaMoE calls, real signatures, recorded.

Each returns a copy of its input (the permutation itself is aiter's business); tests check the
arguments: which tensor, gate_up / is_guinterleave flags, 2-D vs 3-D scales, experts_cnt. On
gfx1250 the moe_* helpers keep the shape checks of what they run there (ROCm/aiter e4048607,
aiter/ops/shuffle.py): shuffle_weight's 16-row / 32-byte tiles (196-197) and shuffle_scale_n32k4's
32-row / 4-scale tiles (283-288, "B-scale K//32 must be divisible by 4 (K%128==0)").
"""

from aiter import CALL_LOG
from aiter.jit.utils.chip_info import get_gfx


def _record(name, src, **kw):
    CALL_LOG.append((name, tuple(src.shape), src.dtype, kw, src.clone()))
    return src.clone()


def shuffle_weight_a16w4(src, NLane: int, gate_up: bool):
    return _record("shuffle_weight_a16w4", src, NLane=NLane, gate_up=gate_up)


def shuffle_scale_a16w4(src, experts_cnt: int, gate_up: bool):
    return _record("shuffle_scale_a16w4", src, experts_cnt=experts_cnt, gate_up=gate_up)


def moe_shuffle_weight(src, experts_cnt=None, is_guinterleave=False, gate_up=False, layout=(16, 16)):
    if get_gfx() == "gfx1250":
        assert src.shape[-2] % layout[0] == 0, f"{src.shape[-2]} % {layout[0]} == {src.shape[-2] % layout[0]}"
        bk = 2 * layout[1]
        assert src.shape[-1] % bk == 0, f"{src.shape[-1]} % {bk} == {src.shape[-1] % bk}"
    return _record("moe_shuffle_weight", src, experts_cnt=experts_cnt, is_guinterleave=is_guinterleave, gate_up=gate_up, layout=layout)


def moe_shuffle_scale(src, experts_cnt=None, is_guinterleave=False, gate_up=False):
    if get_gfx() == "gfx1250":
        n, k_scale = src.shape[-2] if src.ndim == 3 else src.shape[0] // experts_cnt, src.shape[-1]
        if n % 32 != 0:
            raise ValueError(f"B-scale rows must be divisible by 32, got {n}")
        if k_scale % 4 != 0:
            raise ValueError(f"B-scale K//32 must be divisible by 4 (K%128==0), got {k_scale}")
    return _record("moe_shuffle_scale", src, experts_cnt=experts_cnt, is_guinterleave=is_guinterleave, gate_up=gate_up)
