"""The HookRegistry hooks ``megamoe_ep`` needs, each with the reason no extension point covers it.

SGLang 0.5.23 offers a runner registry (used: ``register_moe_runner_core``,
``add_moe_runner_backend_choices``) and overridable resolution steps (used: ``handle_mega_moe``),
but the a2a backend is a closed enum with one ``CUSTOMIZED`` member and no registry. These seven
hooks fill exactly that gap; every one is inert unless ``megamoe_ep`` is selected.
"""

from __future__ import annotations

from typing import Any, Callable

from .selection import BACKEND_NAME, is_selected
from .server_args import add_a2a_choice


def a2a_enum_missing(original: Callable, cls: Any, value: Any) -> Any:
    """AROUND ``MoeA2ABackend._missing_``: the string "megamoe_ep" resolves to ``CUSTOMIZED``.

    ``initialize_moe_config`` builds the enum from the published string in every process; the
    enum has no member for out-of-tree backends except ``CUSTOMIZED``.
    """
    if value == BACKEND_NAME:
        return cls.CUSTOMIZED
    return original(cls, value)


def a2a_supports_aiter(original: Callable, self: Any) -> bool:
    """AROUND ``MoeA2ABackend.supports_aiter``: True for megamoe_ep.

    Quant methods whose only runner is AITER (Quark MXFP4 MoE) refuse to construct a layer when
    the a2a backend does not "support aiter" — for ``CUSTOMIZED`` SGLang says it does not. Under
    megamoe_ep that runner is created but never called (see ``run_moe_core``), so construction
    may go ahead on any platform.
    """
    if self.is_customized() and is_selected():
        return True
    return original(self)


def create_dispatcher(original: Callable, moe_runner_config: Any, quant_method: Any) -> Any:
    """AROUND ``create_moe_dispatcher``: MoE layers built under megamoe_ep get MegaMoEDispatcher.

    SGLang's factory raises "Unsupported a2a backend" for ``CUSTOMIZED``; there is no registry.
    It is also the one call inside ``FusedMoE.__init__`` that sees both the quant method and
    (through ``moe_runner_config.layer``) the layer, so it is where the layer's weight
    post-processing is redirected to MegaMoE's conversion (``layer_runtime.take_over_weights``).
    """
    if is_selected():
        from .dispatcher import MegaMoEDispatcher
        from .layer_runtime import take_over_weights

        if moe_runner_config.layer is not None:
            take_over_weights(moe_runner_config.layer, quant_method)
        return MegaMoEDispatcher(moe_runner_config)
    return original(moe_runner_config, quant_method)


def output_is_complete(original: Callable, *, is_tp_path: bool) -> bool:
    """AROUND ``post_experts_output_is_complete``: MegaMoE's combine already summed every token.

    SGLang lists the a2a backends whose combine sums on the source rank by name; without this it
    would all-reduce the complete output once more over the EP group (wrong result).
    """
    if is_selected():
        return True
    return original(is_tp_path=is_tp_path)


def run_moe_core(original: Callable, layer: Any, dispatch_output: Any) -> Any:
    """AROUND ``FusedMoE.run_moe_core``: run the layer's experts through SGLang's MoeRunner with
    the ``megamoe_ep`` runner core, instead of the quant method's own runner.

    Quant methods pick their runner by their own rules (e.g. unquantised -> Triton) and never
    consult registered runner names, so the registry alone does not reach MoE layers. The quant
    method still creates and loads the parameters; the hook only changes who computes.
    """
    from .dispatcher import MegaMoEDispatcher

    if not isinstance(layer.dispatcher, MegaMoEDispatcher):
        return original(layer, dispatch_output)
    from .layer_runtime import megamoe_runner_for

    runner, quant_info = megamoe_runner_for(layer)
    return runner.run(dispatch_output, quant_info)


def mlp_tp_gather(original: Callable, *, moe_a2a_backend: Any = None) -> bool:
    """AROUND ``require_mlp_tp_gather``: True for megamoe_ep under DP attention.

    Its name is misleading (SGLang #30432): for an a2a backend it gathers no hidden states (the MoE
    input stays DP-local) but turns on SGLang's DP-count bookkeeping — every rank sees every DP
    rank's token count (``get_dp_global_num_tokens()``) and the decode graph runner pads all DP
    ranks to the largest rank's bucket. MegaMoE needs both: the token bound it passes to the P2P
    forward must be the same number on every EP rank (dp_bound.py), and so must the graph size
    each rank replays. SGLang answers True the same way for its in-tree flashinfer / mori-EPv2 /
    flashinfer_megamoe backends; for CUSTOMIZED it would return False.
    """
    if _names_megamoe_ep(moe_a2a_backend):
        from sglang.srt.runtime_context import get_parallel

        if get_parallel().attn_dp_enabled:
            return True
    return original(moe_a2a_backend=moe_a2a_backend)


def _names_megamoe_ep(moe_a2a_backend: Any) -> bool:
    """Whether the a2a backend asked about (None: this process's; a draft model may pass its own,
    as a string or enum) is megamoe_ep."""
    if moe_a2a_backend is None:
        return is_selected()
    if isinstance(moe_a2a_backend, str):
        return moe_a2a_backend == BACKEND_NAME
    return moe_a2a_backend.is_customized() and is_selected()


# (target, hook type name, hook) in application order.
HOOKS: tuple[tuple[str, str, Callable], ...] = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "AROUND", add_a2a_choice),
    ("sglang.srt.layers.moe.utils.MoeA2ABackend._missing_", "AROUND", a2a_enum_missing),
    ("sglang.srt.layers.moe.utils.MoeA2ABackend.supports_aiter", "AROUND", a2a_supports_aiter),
    ("sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher", "AROUND", create_dispatcher),
    ("sglang.srt.layers.moe.utils.post_experts_output_is_complete", "AROUND", output_is_complete),
    ("sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.run_moe_core", "AROUND", run_moe_core),
    ("sglang.srt.utils.common.require_mlp_tp_gather", "AROUND", mlp_tp_gather),
)
