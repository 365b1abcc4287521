"""The planted mutants the ROCm contract tests name: the old (or a plausible wrong) behaviour of the
adapter, planted behind today's signatures, so a test that fails on it fails on the behaviour.

    python tests/rocm/mutants.py            # every mutant: copy the tree, plant it, run its tests
    python tests/rocm/mutants.py NAME ...   # the named ones

Each mutant replaces one exact snippet of one file (the run refuses a snippet that is not there
exactly once, so a mutant cannot silently stop applying) in a copy of the working tree under
$TMPDIR, then runs the tests that name it there; the mutant is caught when they ran and failed (pytest
exit 1 with failures; exits 2-5 mean they did not run, see ``caught_by``). The outcome
of one run is what the tests' docstrings say ("mutant X: FAILS (...)"). Not collected by pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UC = "tests/rocm/test_upstream_constraints.py::"
MD = "tests/rocm/test_mori_device_forward.py::"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # under megamoe_backend/
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("v2-one-runtime", "platform/rocm_probes.py", "    if not small or mtpr <= small:\n", "    if True:\n",
           (UC + "test_selection_asks_the_installed_plan_builder_and_holds_vllm_034s_two_runtimes",)),
    Mutant("heap-threshold", "experts/aiter/heap.py", "    compact = not fixed_slot\n", "    compact = mt > 255\n",
           (UC + "test_the_fixed_slot_knob_reaches_the_plan_and_the_heap",)),
    Mutant("v2-no-plan-builder", "platform/select.py",
           "    plan = rocm.probes.v2_plan(mtpr, experts_per_rank, shape, ep_size, math.a_format)\n",
           "    from .rocm_probes import V2Plan\n    plan = V2Plan(runtimes=(V2Runtime(mtpr, False, 'bf16'),))\n",
           (UC + "test_cases_the_installed_aiter_refuses_run_unfused_naming_the_knob",)),
    Mutant("v2-no-topk-limit", "platform/select.py", "    if shape.topk > V2_MAX_TOPK:\n", "    if False:\n",
           (UC + "test_topk_above_16_is_not_fused",)),
    Mutant("v2-fp8-wire-only", "platform/select.py", '    if knobs.dispatch_wire not in ("bf16", math.a_format):\n',
           "    if knobs.dispatch_wire != math.a_format:\n", (UC + "test_mi355x_with_the_default_knobs_runs_fused",)),
    Mutant("v2-no-config-tokens", "experts/aiter/fused.py",
           '            kw["config_tokens"] = spec.mtpr if bound is None else int(bound)\n', "            pass\n",
           (UC + "test_each_step_runs_the_smallest_runtime_holding_the_bound_with_config_tokens_and_a_bf16_decode_combine",)),
    Mutant("v2-max-runtime-always", "experts/aiter/fused.py",
           "        need = self.capacity if bound is None else int(bound)\n", "        need = self.capacity\n",
           (UC + "test_each_step_runs_the_smallest_runtime_holding_the_bound_with_config_tokens_and_a_bf16_decode_combine",)),
    Mutant("v2-launch-attrs-only", "experts/aiter/runtime.py",
           '    if {"w1", "w1_scale", "w2", "w2_scale"} <= param_names(cls.forward):\n        return BIND_FORWARD\n', "",
           (UC + "test_layer_weights_reach_the_runtime_as_forward_arguments_aiter_checks",)),
    Mutant("v2-no-device-check", "platform/rocm_rules.py",
           "    if ep_rank is None or device_index is None or ep_rank == device_index:\n", "    if True:\n",
           (UC + "test_megamoev2_on_another_gpu_than_its_ep_rank_is_refused_at_start_up",)),
    Mutant("idle-returns-early", "experts/aiter/fused.py", "        spec = self.spec_for(bound)\n",
           "        if t == 0:\n            return torch.zeros(0, hidden, dtype=torch.bfloat16)\n"
           "        spec = self.spec_for(bound)\n",
           (UC + "test_an_idle_rank_takes_part_in_the_collective",)),
    Mutant("v2-mask-every-step", "experts/aiter/fused.py",
           '            kw["config_tokens"] = spec.mtpr if bound is None else int(bound)\n',
           '            kw["config_tokens"] = spec.mtpr if bound is None else int(bound)\n            kw["mask_invalid_slots"] = True\n',
           (UC + "test_masked_entries_reach_the_runtime_as_zero_weight_copies_without_the_per_step_mask",)),
    Mutant("routing-host-sync", "experts/aiter/routing.py", "    mapped = torch.where(valid, mapped, first.expand_as(mapped))\n",
           "    _old = bool(valid.all())  # was: if not bool(valid.all()): remap\n"
           "    mapped = torch.where(valid, mapped, first.expand_as(mapped))\n",
           (UC + "test_rank_major_ids_make_no_host_sync", UC + "test_the_fused_forward_makes_no_host_sync_and_can_be_captured",
            MD + "test_mori_device_forward_matches_the_eager_forward_without_a_host_sync")),
    Mutant("fused-host-id-check", "layer/forwards/fused.py",
           "        status, message = self.shape_status(x, topk_ids, topk_weights)\n",
           "        from .torch_path import host_input_status\n"
           "        status, message = host_input_status(self, x, topk_ids, topk_weights)\n",
           (UC + "test_the_fused_forward_makes_no_host_sync_and_can_be_captured",)),
    Mutant("id-check-scalar-index", "layer/device/id_check.py",
           "    value = ids.gather(0, first.view(1)).view(())  # (``ids[first]`` with a 0-d index reads it on the host)\n",
           "    value = ids[first]\n",
           (UC + "test_the_fused_forward_makes_no_host_sync_and_can_be_captured",
            MD + "test_mori_device_forward_matches_the_eager_forward_without_a_host_sync")),
    Mutant("no-scale-row-probe", "platform/rocm_probes.py",
           "    mori_scale_row: Callable[[], bool] = installed_mori_scale_row\n",
           "    mori_scale_row: Callable[[], bool] = lambda: True\n",
           (UC + "test_the_scale_row_probe_asks_moris_hip_backend_where_aiter_does",)),
    Mutant("scale-row-on-config", "platform/rocm_probes.py",
           '    return callable(getattr(hip, "scale_stride_bytes", None))\n',
           '    return hasattr(import_module("mori.ops.dispatch_combine_v2").EpDispatchCombineConfig, "scale_stride_bytes")\n',
           (UC + "test_the_scale_row_probe_asks_moris_hip_backend_where_aiter_does",)),
    Mutant("no-hip-clear", "experts/aiter/runtime.py", "    if hip is not None:\n        hip.hipGetLastError()\n",
           "    pass\n", (UC + "test_the_hip_error_cco_init_leaves_is_cleared_before_the_runtime_allocates",)),
    Mutant("no-recv-bound", "experts/aiter/fused.py",
           '                kw["recv_token_bound"] = int(bound) * p.topk * p.ep_size\n', "                pass\n",
           (UC + "test_gfx1250_recv_token_bound_reaches_the_runtime",)),
    Mutant("always-internode-v1", "transport/mori.py",
           '    kind = "InterNodeV1LL" if mtpr <= ll_max_tokens else "InterNodeV1"\n', '    kind = "InterNodeV1"\n',
           (UC + "test_multi_node_mori_takes_internode_v1_ll_for_small_budgets_with_vllms_geometry",)),
    Mutant("runtime-per-layer", "experts/aiter/runtime.py", "    hit = _RUNTIMES.get(key)\n", "    hit = None\n",
           (UC + "test_layers_share_one_v2_runtime_inside_a_heap_one_per_layer_would_exhaust",)),
    Mutant("no-heap-check", "experts/aiter/runtime.py", "    MoriHeap.from_env(env).check(total, what)\n", "    pass\n",
           (UC + "test_a_heap_too_small_for_the_shared_runtimes_fails_at_start_up_naming_the_variable",)),
    Mutant("heap-default-4g", "experts/aiter/heap.py", "ASSUMED_DEFAULT_HEAP = 2 * GIB", "ASSUMED_DEFAULT_HEAP = 4 * GIB",
           (UC + "test_without_mori_shmem_heap_size_the_check_assumes_the_2_gib_vllm_names",)),
    Mutant("heap-drops-group-major", "experts/aiter/heap.py",
           "    return sum(_align(n) for n in intranode + group_major + workspace)\n",
           "    return sum(_align(n) for n in intranode + workspace)\n",
           (UC + "test_v2_heap_formula_matches_the_fakes_allocation_list",)),
    Mutant("heap-parse-lenient", "experts/aiter/heap.py", "    m = _SIZE_RE.match(raw)\n",
           "    return int(float(raw.strip().rstrip('GiBMKb')) * GIB)\n",
           (UC + "test_heap_size_values_mori_reads_differently_are_refused",)),
    Mutant("gfx1250-uint8-weights", "experts/aiter/weights.py",
           "        w2=shuffle.moe_shuffle_weight(w2, experts_cnt=e).contiguous().view(FP4X2),\n",
           "        w2=shuffle.moe_shuffle_weight(w2, experts_cnt=e).contiguous(),\n",
           (UC + "test_gfx1250_a4w4_runs_fused_on_weights_viewed_as_fp4x2",)),
    Mutant("gfx1250-quant-wire-forces-mori", "platform/rocm_rules.py",
           '    if takes_stage1_fused and (requested == "flydsl" or not mori_scale_row):\n',
           "    if False:\n",
           ("tests/rocm/test_select.py::test_quantised_wire_with_flydsl_dispatch_runs_the_compact_plan",)),
    Mutant("gpu-per-node-device-count", "transport/mori.py",
           "            gpus_per_node = ep_ranks_per_node(self.ep_size, topology or gather_ep_topology(group, self.device))\n",
           "            gpus_per_node = torch.cuda.device_count() if torch.cuda.is_available() else 1\n",
           ("tests/rocm/test_mori_transport.py::test_gpu_per_node_comes_from_where_the_ranks_run_not_the_visible_gpus",)),
    Mutant("v2-plan-without-a-dtype", "platform/rocm_probes.py",
           '    activation = {"a_dtype": a_dtype} if "a_dtype" in params else {}\n', "    activation = {}\n",
           ("tests/rocm/test_select.py::test_v2_a4w4_only_where_installed_aiter_accepts_it",)),
    Mutant("combine-quant-every-step", "experts/aiter/fused.py",
           '            step_quant = gfx1250_step_combine_quant(self.selection.combine_quant or "none", bound)\n',
           '            step_quant = self.selection.combine_quant or "none"\n',
           ("tests/rocm/test_aiter_experts.py::test_gfx1250_quantised_combine_is_named_on_large_steps_only",)),
    Mutant("result-not-copied", "experts/aiter/fused.py",
           "        return result.clone() if out is None else out.copy_(result)\n",
           "        return result if out is None else out.copy_(result)\n",
           (UC + "test_a_forward_result_survives_the_next_forward_of_the_shared_runtime",)),
    Mutant("no-gfx1250-shape-check", "experts/aiter/fused.py",
           "            check_gfx1250_shapes(plan.hidden, plan.spec.moe_intermediate_size)\n", "            pass\n",
           (UC + "test_gfx1250_shapes_the_scale_shuffle_cannot_take_fail_at_start_up_naming_the_checkpoint",)),
    Mutant("no-normal-tensors", "experts/aiter/runtime.py",
           "    with torch.inference_mode(False), torch.no_grad():\n        yield\n", "    yield\n",
           (UC + "test_a_runtime_built_inside_inference_mode_runs_outside_it",)),
    Mutant("bootstrap-from-global-0", "transport/mori.py",
           "    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)\n",
           "    dist.broadcast_object_list(box, src=0, group=group)\n",
           (UC + "test_shmem_bootstrap_is_rooted_at_the_groups_first_rank",)),
    Mutant("always-init-shmem", "transport/mori.py",
           '    origin = "reused" if shmem_initialised(shmem) else "initialised"\n', '    origin = "initialised"\n',
           (UC + "test_shmem_the_engine_started_on_the_same_ranks_is_reused",)),
    Mutant("no-world-check", "transport/mori.py", "    if (pe, npes) != (rank, world_size):\n", "    if False:\n",
           (UC + "test_shmem_the_engine_started_on_another_group_is_an_error",)),
    Mutant("mori-total-recv-item", "layer/forwards/mori.py", "        ws.live.copy_(total.reshape(-1)[:1])\n",
           "        ws.live.fill_(int(total.reshape(-1)[0].item()))  # the eager path's read\n",
           (MD + "test_mori_device_forward_matches_the_eager_forward_without_a_host_sync",)),
    Mutant("local-slots-first-weight", "transport/mori.py",
           "        w = (same.to(torch.float32) * w.unsqueeze(1)).sum(dim=2)  # each entry: its expert's whole weight\n",
           "", ("tests/rocm/test_mori_transport.py::test_routing_helpers_round_trip",
                MD + "test_mori_device_forward_matches_the_eager_forward_without_a_host_sync")),
    Mutant("mori-raise-before-exchange", "layer/forwards/mori.py",
           "        self.check_shapes(x, topk_ids, topk_weights)\n        y = self._step(",
           "        self.check_shapes(x, topk_ids, topk_weights)\n        if not capturing(self.device):\n"
           "            self.raise_if_bad_input()\n        y = self._step(",
           (MD + "test_bad_ids_are_reported_after_every_rank_finished_the_step",)),
)


def _copy_tree(dest: Path) -> None:
    with tempfile.TemporaryFile() as buf:
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(ROOT, arcname=".", filter=lambda t: None if any(p in t.name.split("/") for p in
                                                                     (".git", "__pycache__", ".pytest_cache")) else t)
        buf.seek(0)
        with tarfile.open(fileobj=buf, mode="r") as tar:
            tar.extractall(dest, filter="data")


def plant(tree: Path, m: Mutant) -> None:
    path = tree / "megamoe_backend" / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: the snippet to replace occurs {text.count(m.old)} times in {m.path}")
    path.write_text(text.replace(m.old, m.new))


def run(m: Mutant, python: str) -> tuple[bool, str]:
    """(caught, last lines of the test run) for one mutant, in a fresh copy of the tree."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        plant(tree, m)
        proc = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests], cwd=tree,
                              capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("E ", "FAILED")) or " passed" in ln or " failed" in ln]
        return caught_by(proc.returncode, proc.stdout), "\n".join(lines[-4:] or [f"pytest exit {proc.returncode}"])


def caught_by(returncode: int, stdout: str) -> bool:
    """A mutant is caught only when its tests ran and failed: pytest exit 1 with a failure reported.

    Exit 2 (interrupted, e.g. a collection error), 3 (internal error), 4 (usage: a test id that names
    nothing) and 5 (no tests collected) say the tests did not run, which is no catch: a venv without a
    package the tests import would otherwise count every mutant as caught."""
    return returncode == 1 and any(ln.startswith("FAILED") or " failed" in ln for ln in stdout.splitlines())


def main(argv: list[str]) -> int:
    chosen = [m for m in MUTANTS if not argv or m.name in argv]
    missed = []
    for m in chosen:
        caught, tail = run(m, sys.executable)
        print(f"mutant {m.name}: {'FAILS (caught)' if caught else 'PASSES (NOT caught)'}\n  {tail.replace(chr(10), chr(10) + '  ')}")
        if not caught:
            missed.append(m.name)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} mutants caught" + (f"; not caught: {missed}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
