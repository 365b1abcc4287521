"""Fake mori.ops.dispatch_combine_v2 (mori EPv2), as far as MegaMoE and aiter's MegaMoEGfx1250 ask it
one thing: can its dispatch carry a per-token scale row?

Two published shapes, the default the older one (tests install the other with
``rocm_helpers.use_scale_row_mori``):
- ROCm/mori 624002c8: ``hip_backend.py`` has no ``scale_stride_bytes`` and its gate refuses a config
  with ``scale_dim and scale_type_size`` ("per-token scales forwarding", hip_backend.py:176-177);
  ``ep_plans.EpDispatchPlan`` takes no ``scale_bytes=``.
- ROCm/mori#593 ("forward a per-token scale row with dispatch"): ``hip_backend.py`` gains the module
  function ``scale_stride_bytes(scale_bytes)`` (the caller's row padded to ``_SCALE_ALIGN = 128``,
  EpScaleStride in ep_cfg.hpp) and the method ``EpDispatchCombineOpHip.scale_stride_bytes()``; the
  gate accepts scale rows of whole dwords; ``EpDispatchPlan`` takes ``scale_bytes=``.
In neither is ``scale_stride_bytes`` a field or property of ``EpDispatchCombineConfig``
(dispatch_combine_op.py), which is where an earlier revision of this project looked.
"""

from .dispatch_combine_op import EpDispatchCombineConfig, EpDispatchCombineOp

__all__ = ["EpDispatchCombineConfig", "EpDispatchCombineOp"]
