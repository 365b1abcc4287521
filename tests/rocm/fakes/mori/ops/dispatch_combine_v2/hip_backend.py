"""Fake mori.ops.dispatch_combine_v2.hip_backend, 624002c8 by default; ``install_pr593()`` (called
through ``rocm_helpers.use_scale_row_mori``, undone by monkeypatch) makes it the ROCm/mori#593 shape.

624002c8 ``_unsupported``: ``if cfg.scale_dim and cfg.scale_type_size: bad.append("per-token scales
forwarding")`` (176-177), raised at construction. #593: the module function ``scale_stride_bytes``
(``(scale_bytes + 127) // 128 * 128``, 0 for no row), the op method of the same name, and a gate that
refuses only a row that is not a whole number of dwords ("the row must be a whole number of dwords").
"""

from ... import CALL_LOG

_SCALE_ALIGN = 128  # EpScaleAlign in include/mori/ops/dispatch_combine_v2/ep_cfg.hpp (#593)


def _scale_stride_bytes_593(scale_bytes: int) -> int:
    if scale_bytes <= 0:
        return 0
    return (scale_bytes + _SCALE_ALIGN - 1) // _SCALE_ALIGN * _SCALE_ALIGN


class EpDispatchCombineOpHip:
    """624002c8: no scale rows."""

    def __init__(self, cfg, comm=None) -> None:
        CALL_LOG.append(("v2.EpDispatchCombineOpHip", cfg))
        bad = self._unsupported(cfg)
        if bad:
            raise ValueError("hip backend cannot serve this config:\n  " + "\n  ".join(bad))
        self.cfg = cfg

    def _unsupported(self, cfg) -> list:
        return ["per-token scales forwarding"] if cfg.scale_dim and cfg.scale_type_size else []


class EpDispatchCombineOpHip593(EpDispatchCombineOpHip):
    """#593: scale rows of whole dwords, laid down at ``scale_stride_bytes``."""

    def _unsupported(self, cfg) -> list:
        raw = cfg.scale_dim * cfg.scale_type_size
        return [f"per-token scale row of {raw} B; the row must be a whole number of dwords"] if raw % 4 else []

    def scale_stride_bytes(self) -> int:
        return _scale_stride_bytes_593(self.cfg.scale_dim * self.cfg.scale_type_size)


def install_pr593(monkeypatch) -> None:
    """This module and ep_plans as ROCm/mori#593 has them."""
    import sys

    from . import ep_plans

    here = sys.modules[__name__]
    monkeypatch.setattr(here, "scale_stride_bytes", _scale_stride_bytes_593, raising=False)
    monkeypatch.setattr(here, "EpDispatchCombineOpHip", EpDispatchCombineOpHip593)
    monkeypatch.setattr(ep_plans, "EpDispatchPlan", ep_plans.EpDispatchPlan593)
