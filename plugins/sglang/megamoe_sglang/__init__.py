"""megamoe_sglang: ``--moe-a2a-backend megamoe_ep`` for SGLang (entry point ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls :func:`register` (no arguments) in every process — launcher,
schedulers, detokenizer — then ``HookRegistry.apply_hooks()``. ``SGLANG_PLUGINS=megamoe_ep``
whitelists it. :func:`register` uses SGLang's extension points where they exist:

- runner registry: ``register_moe_runner_core("megamoe_ep", MegaMoERunnerCore)`` and
  ``add_moe_runner_backend_choices(["megamoe_ep"])`` (``--moe-runner-backend megamoe_ep`` alias);
- resolution steps: ``register_resolution_hook("handle_mega_moe")`` (alias, knob and EP checks) and
  ``("validate_mega_moe_token_budget_for_model")`` (per-rank tokens vs MEGA_MAX_TOKENS_PER_RANK);
- HookRegistry: AROUND hooks for what has no extension point (see :mod:`.hooks`).

It does not touch SGLang's in-tree ``megamoe`` (DeepGEMM / FlyDSL): different name, and every
hook passes through unless ``megamoe_ep`` is selected. Supported SGLang: ``SUPPORTED_SGLANG``; on
other versions it logs a warning and registers nothing, so SGLang itself then refuses
``megamoe_ep`` as an invalid choice.
"""

from __future__ import annotations

import logging

from .selection import BACKEND_NAME, SUPPORTED_SGLANG, MegaMoEConfigError, is_selected, sglang_version_supported

logger = logging.getLogger("megamoe")
_registered = False


def register() -> None:
    """SGLang general-plugin entry point (``megamoe_sglang:register``). Idempotent."""
    global _registered
    if _registered:
        return
    from importlib.metadata import version

    sglang_version = version("sglang")
    if not sglang_version_supported(sglang_version):
        logger.warning(
            "[megamoe] SGLang %s is not a supported version (%s); %s is NOT registered",
            sglang_version, ", ".join(SUPPORTED_SGLANG), BACKEND_NAME,
        )
        return
    from sglang.srt.arg_groups.choices import MOE_RUNNER_BACKEND_CHOICES, add_moe_runner_backend_choices
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.layers.moe.moe_runner.runner import register_moe_runner_core
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .hooks import HOOKS
    from .runner import MegaMoERunnerCore
    from .server_args import RESOLUTION_STEP, resolve_megamoe_ep
    from .token_budget import RESOLUTION_STEP as BUDGET_STEP
    from .token_budget import validate_megamoe_ep_token_budget

    register_moe_runner_core(BACKEND_NAME, MegaMoERunnerCore)
    if BACKEND_NAME not in MOE_RUNNER_BACKEND_CHOICES:
        add_moe_runner_backend_choices([BACKEND_NAME])
    register_resolution_hook(RESOLUTION_STEP)(resolve_megamoe_ep)
    register_resolution_hook(BUDGET_STEP)(validate_megamoe_ep_token_budget)
    for target, kind, hook in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
    _registered = True


__all__ = ["BACKEND_NAME", "SUPPORTED_SGLANG", "MegaMoEConfigError", "is_selected", "register", "sglang_version_supported"]
