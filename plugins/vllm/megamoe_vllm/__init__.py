"""megamoe_vllm: ``--moe-backend megamoe_ep`` for vLLM (entry point ``vllm.general_plugins``).

vLLM calls :func:`register` in every process (API server before CLI parsing, engine core,
workers). It (1) adds ``megamoe_ep`` to the accepted ``--moe-backend`` values and (2) registers
the out-of-tree ``RoutedExperts`` that routes MoE layers through MegaMoE when that backend is
selected. Both steps are idempotent; with any other backend the plugin changes nothing.

Supported vLLM: 0.32.x and 0.33.x (``SUPPORTED_VLLM``). On other versions the plugin logs a
warning and registers nothing, so ``--moe-backend megamoe_ep`` is then refused by vLLM itself.
"""

from __future__ import annotations

import logging

SUPPORTED_VLLM = ((0, 32), (0, 33))  # inclusive (major, minor) range
BACKEND_NAME = "megamoe_ep"

logger = logging.getLogger("megamoe")
_registered = False


def vllm_version_supported(version: str) -> bool:
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED_VLLM[0] <= (major, minor) <= SUPPORTED_VLLM[1]


def register() -> None:
    """vLLM general-plugin entry point."""
    global _registered
    if _registered:
        return
    import vllm

    if not vllm_version_supported(vllm.__version__):
        lo, hi = SUPPORTED_VLLM
        logger.warning(
            "[megamoe] vLLM %s is outside the supported range %d.%d-%d.%d; %s is NOT registered",
            vllm.__version__, *lo, *hi, BACKEND_NAME,
        )
        return
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from .backend_name import add_moe_backend
    from .routed_experts import MegaMoERoutedExperts

    add_moe_backend(BACKEND_NAME)
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get("RoutedExperts") is not MegaMoERoutedExperts:
        RoutedExperts.register_oot(MegaMoERoutedExperts)
    _registered = True


__all__ = ["BACKEND_NAME", "SUPPORTED_VLLM", "register", "vllm_version_supported"]
