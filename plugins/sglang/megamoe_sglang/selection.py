"""Names, version pin and "is megamoe_ep selected here?" — the facts every other module asks.

SGLang keeps the a2a backend in two places: the published server args (``exec.moe.moe_a2a_backend``,
a plain string, identical in every process) and the runtime enum ``MoeA2ABackend`` (closed; it
has a ``CUSTOMIZED`` member reserved for out-of-tree backends). The plugin keeps the string
``"megamoe_ep"`` in the server args and maps it to ``CUSTOMIZED`` in the enum, so "selected" means
both agree.
"""

from __future__ import annotations

BACKEND_NAME = "megamoe_ep"
# SGLang's internals (runner registry, HookRegistry targets, resolution steps) move between patch
# releases; the hooks are verified against exactly these versions.
SUPPORTED_SGLANG = ("0.5.23",)


class MegaMoEConfigError(ValueError):
    """An SGLang deployment setting MegaMoE cannot serve; the message names the flag to change."""


def sglang_version_supported(version: str) -> bool:
    return version in SUPPORTED_SGLANG


def configured_a2a_backend() -> str | None:
    """The a2a backend string this process was published with, or None before publish."""
    try:
        from sglang.srt.runtime_context import get_exec

        return str(get_exec().moe.moe_a2a_backend)
    except Exception:  # not published yet (CLI parsing, unit tests without a server)
        return None


def is_selected() -> bool:
    """True when this process runs MoE layers with ``--moe-a2a-backend megamoe_ep``."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return get_moe_a2a_backend().is_customized() and configured_a2a_backend() == BACKEND_NAME


def check_ep_divides(num_experts: int, ep_size: int) -> None:
    """EP splits whole experts over ranks: the (physical) expert count must divide evenly."""
    if ep_size < 1 or num_experts % ep_size:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME}: --ep-size {ep_size} does not divide the model's "
            f"{num_experts} routed experts (n_routed_experts + --ep-num-redundant-experts); choose an "
            "EP size that divides the expert count"
        )
