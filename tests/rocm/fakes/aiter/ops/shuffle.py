"""Fake aiter.ops.shuffle: the four helpers MegaMoE calls, real signatures, recorded.

Each returns a copy of its input (the permutation itself is aiter's business); tests check the
arguments: which tensor, gate_up / is_guinterleave flags, 2-D vs 3-D scales, experts_cnt.
"""

from aiter import CALL_LOG


def _record(name, src, **kw):
    CALL_LOG.append((name, tuple(src.shape), src.dtype, kw, src.clone()))
    return src.clone()


def shuffle_weight_a16w4(src, NLane: int, gate_up: bool):
    return _record("shuffle_weight_a16w4", src, NLane=NLane, gate_up=gate_up)


def shuffle_scale_a16w4(src, experts_cnt: int, gate_up: bool):
    return _record("shuffle_scale_a16w4", src, experts_cnt=experts_cnt, gate_up=gate_up)


def moe_shuffle_weight(src, experts_cnt=None, is_guinterleave=False, gate_up=False, layout=(16, 16)):
    return _record("moe_shuffle_weight", src, experts_cnt=experts_cnt, is_guinterleave=is_guinterleave, gate_up=gate_up, layout=layout)


def moe_shuffle_scale(src, experts_cnt=None, is_guinterleave=False, gate_up=False):
    return _record("moe_shuffle_scale", src, experts_cnt=experts_cnt, is_guinterleave=is_guinterleave, gate_up=gate_up)
