"""Start-up refusals that read vLLM's engine configuration (not one MoE layer's shapes).

Why at start-up: both failures below would otherwise surface deep inside serving — DBO as two
micro-batches interleaving on one P2P workspace, an uncapturable layer as a crash inside CUDA-graph
capture — with nothing naming the flag to change. Each check reads only vLLM's config objects, so
tests build them with vLLM's own argument parser.
"""

from __future__ import annotations

from typing import Any

from megamoe_backend.plan.capture import EngineGraphs


class MegaMoEConfigError(ValueError):
    """A vLLM deployment setting MegaMoE cannot serve; the message names the flag to change."""


def check_no_microbatching(parallel_config: Any) -> None:
    """Refuse vLLM's micro-batching (``--enable-dbo``, ``--ubatch-size N>1``).

    Every MoE layer of one shape shares one P2P workspace (arena, epochs, status word) per process:
    two micro-batches in flight would interleave their dispatches on it. No test shows that right.
    """
    if parallel_config.enable_dbo:
        raise MegaMoEConfigError(
            "--moe-backend megamoe_ep does not support dual-batch overlap: the MoE layers share one dispatch "
            "workspace per shape, which two micro-batches in flight would interleave on. Drop --enable-dbo."
        )
    if parallel_config.ubatch_size > 1:
        raise MegaMoEConfigError(
            f"--moe-backend megamoe_ep does not support micro-batching (--ubatch-size {parallel_config.ubatch_size}): "
            "the MoE layers share one dispatch workspace per shape. Drop --ubatch-size (or set it to 1)."
        )


def engine_captures_graphs(vllm_config: Any) -> bool:
    """Whether vLLM will capture CUDA graphs around the MoE op (--enforce-eager sets the mode NONE;
    PIECEWISE captures the op too: it is not one of vLLM's splitting ops)."""
    from vllm.config import CUDAGraphMode

    model_config = vllm_config.model_config
    if model_config is not None and model_config.enforce_eager:
        return False
    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode != CUDAGraphMode.NONE


def engine_graphs(vllm_config: Any) -> EngineGraphs:
    """vLLM's CUDA-graph setting as the layer takes it: the layer refuses, once its transport is
    settled over the EP group (megamoe_backend/layer/startup.py), a forward vLLM would capture but
    cannot be, naming --enforce-eager."""
    return EngineGraphs(engine_captures_graphs(vllm_config), "--enforce-eager")
