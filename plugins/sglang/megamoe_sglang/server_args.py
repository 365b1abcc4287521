"""Server-argument side of ``megamoe_ep``: the CLI choice and the resolution step.

SGLang parses flags (``prepare_server_args``) on any machine, then *resolves* them
(``ServerArgs.resolve_once``, a fixed pipeline of named steps) in the launcher. The plugin:

- adds ``megamoe_ep`` to ``--moe-a2a-backend`` (an inline choice list, no public adder: a hook
  on ``ServerArgs.add_cli_args``) and to ``--moe-runner-backend`` (``add_moe_runner_backend_choices``);
- wraps the overridable resolution step ``handle_mega_moe`` (SGLang's own place for the in-tree
  ``megamoe`` alias): it first turns ``--moe-runner-backend megamoe_ep`` into ``--moe-a2a-backend
  megamoe_ep``, then runs SGLang's step unchanged (the in-tree ``megamoe`` keeps its own checks),
  then validates a ``megamoe_ep`` deployment — MEGA_* knobs, EP/TP sizes, expert count — and
  places shared experts outside the routed experts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from .selection import BACKEND_NAME, MegaMoEConfigError, check_ep_divides

logger = logging.getLogger("megamoe")

RESOLUTION_STEP = "handle_mega_moe"


def add_a2a_choice(original: Callable, parser: Any) -> Any:
    """AROUND ``ServerArgs.add_cli_args``: let argparse accept ``--moe-a2a-backend megamoe_ep``."""
    result = original(parser)
    for action in parser._actions:
        if action.dest == "moe_a2a_backend" and action.choices is not None and BACKEND_NAME not in action.choices:
            action.choices = [*action.choices, BACKEND_NAME]
    return result


def _model_expert_count(model_path: str) -> int | None:
    """n_routed_experts from a local checkpoint's config.json (None for hub ids / dummy models)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    n = cfg.get("n_routed_experts")
    return int(n) if n else None


def check_deployment(cfg: Any) -> None:
    """Startup checks for a megamoe_ep deployment; every error names the flag or knob to change."""
    from megamoe_backend.knobs import Knobs

    Knobs.from_env()  # KnobError names the MEGA_* variable
    if cfg.enable_two_batch_overlap or cfg.enable_single_batch_overlap:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME} has no two-batch / single-batch overlap split; drop "
            "--enable-two-batch-overlap / --enable-single-batch-overlap"
        )
    if cfg.ep_size != cfg.tp_size:
        raise MegaMoEConfigError(
            f"--moe-a2a-backend {BACKEND_NAME} splits whole experts over ranks: set --ep-size equal to --tp "
            f"(got --tp {cfg.tp_size} --ep-size {cfg.ep_size})"
        )
    experts = _model_expert_count(str(cfg.model_path))
    if experts is not None:
        check_ep_divides(experts + int(cfg.ep_num_redundant_experts or 0), int(cfg.ep_size))


def resolve_megamoe_ep(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Overrides the resolution step ``handle_mega_moe`` (SGLang's ``register_resolution_hook``)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if cfg.moe_runner_backend == BACKEND_NAME:
        if cfg.moe_a2a_backend not in ("none", BACKEND_NAME):
            logger.warning(
                "[megamoe] --moe-runner-backend %s is an alias for --moe-a2a-backend %s; overriding "
                "--moe-a2a-backend %s", BACKEND_NAME, BACKEND_NAME, cfg.moe_a2a_backend,
            )
        declare_resolution(server_args, "megamoe_ep_alias", moe_runner_backend="auto", moe_a2a_backend=BACKEND_NAME)
    previous(server_args)
    cfg = resolving_view(server_args)
    if cfg.moe_a2a_backend != BACKEND_NAME:
        return
    check_deployment(cfg)
    # Shared experts run beside the routed ones on each rank's own tokens: never fused into the
    # routed experts (MegaMoE owns only routed slots) and replicated, not TP-split (tokens are
    # DP-local under --moe-a2a-backend). SGLang reads the latter from this environment variable
    # in every process; children inherit the launcher's environment.
    declare_resolution(server_args, "megamoe_ep_shared_experts", disable_shared_experts_fusion=True)
    os.environ.setdefault("SGLANG_SHARED_EXPERT_TP1", "1")
