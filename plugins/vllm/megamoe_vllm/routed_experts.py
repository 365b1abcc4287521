"""The one vLLM hook: an out-of-tree ``RoutedExperts`` that swaps in MegaMoE's quant method.

Why this hook (and not the others vLLM offers):
- ``RoutedExperts`` is a ``PluggableLayer``; ``register_oot`` replaces it for every MoE layer of
  every model at construction, without touching model code. Our subclass overrides exactly one
  method, ``_get_quant_method``; with any other ``--moe-backend`` it returns vLLM's own choice, so
  the plugin is inert unless selected, and a model without MoE layers never builds one.
- Replacing ``MoERunner`` instead would mean re-implementing the runner (router, shared experts,
  TP/SP reductions, DBO) — much more surface that changes between vLLM releases.
- A modular kernel (``FusedMoEPrepareAndFinalizeModular`` + ``FusedMoEExpertsModular``) splits
  dispatch from expert math through vLLM's intermediate layouts (quantised activations, expert
  token metadata, workspaces), while MegaMoE is one dispatch -> GEMMs -> combine pipeline with its
  own wire format; and vLLM's kernel oracles pick kernels by backend name with no registry, so we
  would still need this same quant-method hook to get ours chosen.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from .backend_name import is_selected


@lru_cache(maxsize=1)
def process_knobs() -> Any:
    """MEGA_* knobs, read and validated once per process (every layer sees the same choice)."""
    from megamoe_backend.knobs import Knobs

    return Knobs.from_env()


class MegaMoERoutedExperts(RoutedExperts):
    def __init__(self, layer_name: str, params_dtype: Any, moe_config: Any, *args: Any, **kwargs: Any) -> None:
        self._megamoe = is_selected(moe_config.moe_backend)
        if not self._megamoe:
            super().__init__(layer_name, params_dtype, moe_config, *args, **kwargs)
            return
        from vllm.config import get_current_vllm_config

        from .engine_checks import check_no_microbatching
        from .method import check_deployment

        self._megamoe_knobs = process_knobs()  # a bad MEGA_* knob fails the engine start here
        check_deployment(moe_config, self._megamoe_knobs)
        check_no_microbatching(get_current_vllm_config().parallel_config)
        # vLLM's own quant method must be built as for the default backend: it creates the
        # parameters and loaders we reuse, and its backend oracle does not know our name.
        moe_config.moe_backend = "auto"
        try:
            super().__init__(layer_name, params_dtype, moe_config, *args, **kwargs)
        finally:
            moe_config.moe_backend = "megamoe_ep"

    def _get_quant_method(self, prefix: str, quant_config: Any, moe_config: Any) -> Any:
        if not self._megamoe:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        try:
            inner = super()._get_quant_method(prefix, quant_config, moe_config)
        except NotImplementedError as exc:
            # vLLM found no MoE kernel for this checkpoint's format on this platform (e.g. MXFP4
            # on CPU). MegaMoE brings its own experts; it only needs the parameters declared.
            inner = _mxfp4_params_or_raise(quant_config, exc)
        from megamoe_backend.spec import log_override

        from .method import make_method
        from .weights import scheme_choice_of

        # The engine's reading (vLLM 0.33+ DeepSeek V4: A8W4) x the knobs -> the scheme and wire this layer runs.
        choice = scheme_choice_of(inner, self._megamoe_knobs)
        log_override(choice)
        return make_method(inner, moe_config, choice.knobs_for_layer(self._megamoe_knobs), prefix)


def _failed_mxfp4_activation_key(exc: BaseException) -> tuple[bool, Any]:
    """(True, the ``activation_key`` vLLM passed) when ``exc`` was raised inside ``Mxfp4MoEMethod.__init__``.

    Why the traceback: vLLM's DeepSeek V4 config builds ``Mxfp4MoEMethod(moe, activation_key=...)``
    and its kernel oracle, run inside that constructor, raises where it has no MXFP4 kernel (CPU):
    the method object, and with it the engine's reading of the activations, is lost, except as the
    constructor's own argument in the frame that raised. (False, None): the error came from elsewhere
    (e.g. an NVFP4 expert method), which these parameters do not describe.
    """
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

    code = Mxfp4MoEMethod.__init__.__code__
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True, tb.tb_frame.f_locals.get("activation_key")
        tb = tb.tb_next
    return False, None


def _mxfp4_params_or_raise(quant_config: Any, exc: Exception) -> Any:
    """MXFP4ExpertParams (the checkpoint's declared scheme: its parameters) for a Quark MXFP4 or
    DeepSeek V4 (fp4 experts) checkpoint, with the activation key vLLM gave its own method; else re-raise."""
    from megamoe_backend.spec import ConfigError, quant_scheme_from_config

    from .mxfp4_params import MXFP4ExpertParams

    name = quant_config.get_name() if quant_config is not None else None
    if name == "deepseek_v4_fp8":  # V4 routed experts are MXFP4 (vLLM's Mxfp4MoEMethod layout), declared A4W4
        was_mxfp4, activation_key = _failed_mxfp4_activation_key(exc)
        if not was_mxfp4:
            raise exc
        return MXFP4ExpertParams("a4w4", activation_key)  # scheme_choice_of reads the key as from Mxfp4MoEMethod
    raw = getattr(quant_config, "quant_config", None)
    if name != "quark" or not isinstance(raw, dict):
        raise exc
    try:
        scheme = quant_scheme_from_config(raw)
    except ConfigError:
        raise exc from None
    if scheme not in ("a4w4", "a8w4"):
        raise exc
    return MXFP4ExpertParams(scheme)
