"""vLLM 0.33+'s SubstitutedRoutedExperts (MoNE-pruned checkpoints) under --moe-backend megamoe_ep: refused at
start-up by name; every other backend, and every layer without substituted experts, unchanged.

The layers are built by vLLM's own ``FusedMoEFactory`` (``substitution_probe.py``, one subprocess) from a
checkpoint config whose ``approximate_experts`` replaces experts 0 and 3 of layer 1. Runs in the overlay venvs
(0.33, 0.34); vLLM 0.32 has no expert substitution (there the registration is a no-op, checked here too).

Planted mutation (run once, then restored): the ``register_substituted_experts()`` call removed from
megamoe_vllm.register(): in the 0.33 overlay 3 failed (the refusal became vLLM's "moe_backend='megamoe_ep' is
not supported for unquantized MoE", vLLM's plain class was built under auto, and the factory check found
SubstitutedRoutedExperts without an out-of-tree entry).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def has_substitution() -> bool:
    try:
        import vllm.model_executor.layers.fused_moe.expert_substitution  # noqa: F401
    except ImportError:
        return False
    return True


needs_substitution = pytest.mark.skipif(not has_substitution(), reason="this vLLM (0.32) has no expert substitution")


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGA_")}
    r = subprocess.run([sys.executable, str(HERE / "substitution_probe.py")], text=True, capture_output=True, env=env,
                       timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE_RESULTS ")), None)
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[len("PROBE_RESULTS "):])


@needs_substitution
def test_mone_pruned_layer_is_refused_naming_the_checkpoint_feature(built) -> None:
    err = built["megamoe_ep/1"].get("error", "")
    assert err.startswith("MegaMoEConfigError: --moe-backend megamoe_ep cannot serve MoE layer megamoe_ep.layers.1"), err
    for needle in ("MoNE-pruned", "approximate_experts", "compression_config.transform_config.expert_substitution",
                   "2 expert(s) of this layer by constants: 0, 3", "Serve this checkpoint without --moe-backend megamoe_ep"):
        assert needle in err, (needle, err)
    # the layer without substituted experts is MegaMoE's as always
    assert built["megamoe_ep/2"] == {"class": "MegaMoERoutedExperts", "mro": ["MegaMoERoutedExperts", "RoutedExperts",
                                     "PluggableLayer", "Module", "object"], "quant_method": "MegaMoEFusedMoEMethod"}


@needs_substitution
def test_other_backends_get_vllms_substitution_unchanged(built) -> None:
    auto = built["auto/1"]
    assert auto["class"] == "MegaMoESubstitutedRoutedExperts" and auto["mro"][1] == "SubstitutedRoutedExperts", auto
    assert auto["quant_method"] == "UnquantizedFusedMoEMethod"  # vLLM's own: its isinstance check passed


def test_factory_substitutes_no_class_the_plugin_does_not_cover() -> None:
    """Every class vLLM's FusedMoEFactory assigns to ``routed_experts_cls`` has an out-of-tree entry of the
    plugin's (a new substituted class in a later release fails here, by name)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    import megamoe_vllm

    megamoe_vllm.register()
    tree = ast.parse(inspect.getsource(FusedMoEFactory))
    assigned = {node.value.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                and any(isinstance(t, ast.Name) and t.id == "routed_experts_cls" for t in node.targets)}
    assert "RoutedExperts" in assigned, assigned
    assert assigned <= {"RoutedExperts", "SubstitutedRoutedExperts"}, f"new class(es) the factory substitutes: {assigned}"
    for name in assigned:
        assert op_registry_oot[name].__module__.startswith("megamoe_vllm."), (name, op_registry_oot[name])
    if not has_substitution():
        from megamoe_vllm.substituted_experts import register_substituted_experts

        assert register_substituted_experts() is False
