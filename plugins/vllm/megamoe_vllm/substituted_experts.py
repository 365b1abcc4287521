"""vLLM 0.33+'s ``SubstitutedRoutedExperts`` (MoNE-pruned checkpoints) under ``--moe-backend megamoe_ep``: refused at start-up.

Why a second out-of-tree class: vLLM's ``FusedMoEFactory`` builds ``SubstitutedRoutedExperts`` instead of
``RoutedExperts`` when the checkpoint replaces experts by constants (MoNE: config.json ``approximate_experts``,
or ``compression_config.transform_config.expert_substitution``; layer.py ~398-411 in 0.33, ~403-416 in 0.34).
``PluggableLayer`` swaps classes by *name*, so the plugin's ``RoutedExperts`` replacement never reaches it,
and vLLM then fails deep inside its kernel oracle with ``moe_backend='megamoe_ep' is not supported``, naming
nothing about the checkpoint. MegaMoE cannot serve such a layer: vLLM's substitution itself runs only with
unquantised vLLM experts (an ``isinstance`` check on ``UnquantizedFusedMoEMethod``), without expert or data
parallelism -- the deployments MegaMoE exists for. So this class, registered for that name, refuses at layer
construction (every rank builds every layer: every rank refuses the same way), naming the checkpoint feature
and the fix. With any other ``--moe-backend`` it is vLLM's class unchanged. vLLM 0.32 has no substitution
(nothing registered); 0.34 substitutes no other class (its ``routed_experts_cls`` choices read in
docs/vllm.md, "Quant scheme: the engine's reading").
"""

from __future__ import annotations

from typing import Any

from .backend_name import BACKEND_NAME, is_selected
from .engine_checks import MegaMoEConfigError

SUBSTITUTED_CLASS = "SubstitutedRoutedExperts"
_CLASS_CACHE: dict[type, type] = {}  # vLLM's class -> our subclass of it (one per process, for op_registry_oot)


def substitution_refusal(layer_name: str, substitution: Any) -> MegaMoEConfigError:
    """The start-up error for one MoNE-pruned layer (``substitution``: vLLM's ConstantExpertSubstitution)."""
    ids = list(getattr(substitution, "substituted_expert_ids", ()))
    shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
    return MegaMoEConfigError(
        f"--moe-backend {BACKEND_NAME} cannot serve MoE layer {layer_name}: the checkpoint is MoNE-pruned (expert "
        f"substitution: config.json approximate_experts or compression_config.transform_config.expert_substitution "
        f"replaces {len(ids)} expert(s) of this layer by constants: {shown}). vLLM builds SubstitutedRoutedExperts "
        "for it, which runs only on vLLM's own unquantised MoE kernels without expert or data parallelism. Serve "
        f"this checkpoint without --moe-backend {BACKEND_NAME}, or use the checkpoint without substituted experts."
    )


def _refusing_class(base: type) -> type:
    """Our subclass of vLLM's ``SubstitutedRoutedExperts`` (``base``), built once per process."""
    cls = _CLASS_CACHE.get(base)
    if cls is None:

        class MegaMoESubstitutedRoutedExperts(base):  # type: ignore[misc, valid-type]
            """vLLM's class, except under --moe-backend megamoe_ep: a start-up refusal naming the checkpoint feature."""

            def __init__(self, layer_name: str, params_dtype: Any, moe_config: Any, *args: Any, **kwargs: Any) -> None:
                if is_selected(moe_config.moe_backend):
                    raise substitution_refusal(layer_name, kwargs.get("expert_substitution"))
                super().__init__(layer_name, params_dtype, moe_config, *args, **kwargs)

        cls = _CLASS_CACHE[base] = MegaMoESubstitutedRoutedExperts
    return cls


def register_substituted_experts() -> bool:
    """Register the refusing class for vLLM's ``SubstitutedRoutedExperts`` (idempotent); False on a vLLM without it."""
    try:
        from vllm.model_executor.layers.fused_moe.expert_substitution import SubstitutedRoutedExperts
    except ImportError:  # vLLM 0.32: no expert substitution
        return False
    from vllm.model_executor.custom_op import op_registry_oot

    cls = _refusing_class(SubstitutedRoutedExperts)
    if op_registry_oot.get(SUBSTITUTED_CLASS) is not cls:
        SubstitutedRoutedExperts.register_oot(cls)
    return True


__all__ = ["SUBSTITUTED_CLASS", "register_substituted_experts", "substitution_refusal"]
