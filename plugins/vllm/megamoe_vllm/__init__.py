"""megamoe_vllm: ``--moe-backend megamoe_ep`` for vLLM (entry point ``vllm.general_plugins``).

vLLM calls :func:`register` in every process (API server before CLI parsing, engine core,
workers). It (1) adds ``megamoe_ep`` to the accepted ``--moe-backend`` values and (2) registers
the out-of-tree ``RoutedExperts`` that routes MoE layers through MegaMoE when that backend is
selected. Both steps are idempotent; with any other backend the plugin changes nothing.

Which vLLM (``SUPPORTED_VLLM``, decided by :func:`version_verdict`): 0.32.x, 0.33.x and 0.34.x are
tested and register. A newer release logs a WARNING naming the tested range and then registers,
unless the plugin finds a known break in it (``vllm_contract.contract_breaks``: a name the plugin
uses is gone, an override no longer matches vLLM's signature or call sites), in which case it logs
the break and registers nothing. Older than 0.32 is refused. Whenever nothing is registered,
vLLM itself refuses ``--moe-backend megamoe_ep`` (invalid choice), and the log says why.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

SUPPORTED_VLLM = ((0, 32), (0, 34))  # inclusive (major, minor) range tested in CI (docs/vllm.md)
BACKEND_NAME = "megamoe_ep"

logger = logging.getLogger("megamoe")
_registered = False


def _tested_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    return f"{lo_major}.{lo_minor}-{hi_major}.{hi_minor}"


def parse_major_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string ("0.34.0", "0.33.1+cpu", "0.35.0rc1", "0.36.0.dev3+g1a2b"),
    or None when it does not start with two numbers."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def vllm_version_supported(version: str) -> bool:
    """Inside the tested range."""
    mm = parse_major_minor(version)
    return mm is not None and SUPPORTED_VLLM[0] <= mm <= SUPPORTED_VLLM[1]


@dataclass(frozen=True)
class VersionVerdict:
    """What register() does on a vLLM version, before looking for breaks.

    ``action``: "register" (tested), "try" (newer or unreadable: warn, then register unless a
    known break is found) or "refuse" (older than the tested range). ``message``: the log line.
    """

    version: str
    action: str
    message: str | None = None


def version_verdict(version: str) -> VersionVerdict:
    mm = parse_major_minor(version)
    tested = _tested_range()
    if mm is not None and SUPPORTED_VLLM[0] <= mm <= SUPPORTED_VLLM[1]:
        return VersionVerdict(version, "register")
    if mm is not None and mm < SUPPORTED_VLLM[0]:
        return VersionVerdict(version, "refuse", (
            f"[megamoe] vLLM {version} is older than {SUPPORTED_VLLM[0][0]}.{SUPPORTED_VLLM[0][1]}, the oldest "
            f"release the plugin supports (tested: {tested}); {BACKEND_NAME} is NOT registered, so vLLM will "
            f"refuse --moe-backend {BACKEND_NAME}. Upgrade vLLM to {tested}."))
    seen = "newer than" if mm is not None else "a version the plugin cannot read, outside"
    return VersionVerdict(version, "try", (
        f"[megamoe] vLLM {version} is {seen} the tested range {tested}; registering {BACKEND_NAME} "
        f"anyway after checking every vLLM name and hook the plugin uses (a break found is logged and "
        f"then nothing is registered). Tested releases: {tested}."))


def register() -> None:
    """vLLM general-plugin entry point."""
    global _registered
    if _registered:
        return
    import vllm

    verdict = version_verdict(vllm.__version__)
    if verdict.action == "refuse":
        logger.warning(verdict.message)
        return
    if verdict.action == "try":
        logger.warning(verdict.message)
    from .vllm_contract import contract_breaks

    try:
        breaks = contract_breaks()
    except Exception as exc:  # noqa: BLE001 - a vLLM the check cannot even read is a break, not a crashed vLLM start
        breaks = [f"the check of vLLM's names and hooks itself failed: {exc!r}"]
    if breaks:
        logger.warning(
            "[megamoe] vLLM %s: %s is NOT registered (vLLM will refuse --moe-backend %s): the plugin found "
            "%d known break(s) with this vLLM (tested: %s):\n  - %s",
            vllm.__version__, BACKEND_NAME, BACKEND_NAME, len(breaks), _tested_range(), "\n  - ".join(breaks),
        )
        return
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from .backend_name import add_moe_backend
    from .routed_experts import MegaMoERoutedExperts

    # The layer class first: should widening the name fail below, vLLM refuses the flag; a name
    # accepted without the layer class would let vLLM's own kernel oracles meet "megamoe_ep".
    if op_registry_oot.get("RoutedExperts") is not MegaMoERoutedExperts:
        RoutedExperts.register_oot(MegaMoERoutedExperts)
    from .substituted_experts import register_substituted_experts

    register_substituted_experts()  # vLLM 0.33+: MoNE-pruned checkpoints are refused at start-up, by name
    add_moe_backend(BACKEND_NAME)
    _registered = True


__all__ = ["BACKEND_NAME", "SUPPORTED_VLLM", "VersionVerdict", "parse_major_minor", "register",
           "version_verdict", "vllm_version_supported"]
