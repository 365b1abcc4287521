#!/usr/bin/env python3
"""Multi-GPU validation of the EP layer: the torch forward over NCCL (torch and Triton experts) and the
device P2P forward over torch symmetric memory (MEGA_DISPATCH=symm, Triton experts).

Run on a host with >= 2 CUDA GPUs, from the repository root:
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONPATH=. python scripts/gpu_validate.py --out gpu_validate.json

Checks (each recorded in the JSON, none hard-coded):
- the device P2P forward (symm) vs the NCCL transport's output, bit for bit where both hand the experts
  the same tile config (recorded, not asserted);
- bf16 wires: EP result vs the single-GPU layer (bit-identical expected);
- A8W4 / A4W4 relL2 vs the fp32 reference on dequantised weights (gates 0.10 / 0.28);
- the same with the Triton experts provider at DSV4-Pro hidden/intermediate sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

from megamoe_backend.knobs import Knobs
from megamoe_backend.layer import MegaMoELayer, fp32_reference_moe, rel_l2
from megamoe_backend.parallel import spawn_ranks
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset
from megamoe_backend.workload import EPCase, ProblemConfig, make_problem, run_ep_cases

GATES = {"bf16": 0.01, "a8w4": 0.10, "a4w4": 0.28}


def cases_for(provider: str, iters: int) -> list[EPCase]:
    """NCCL for both experts providers; symm (the device P2P forward) with the Triton experts, which it needs."""
    out = []
    for transport in ("nccl", "symm") if provider == "triton" else ("nccl",):
        for quant, wire, comb in (("bf16", "bf16", "bf16"), ("a8w4", "fp8", "fp8_blockwise_1x32"), ("a4w4", "fp4", "bf16")):
            out.append(EPCase(quant, wire, comb, device="cuda", provider=provider, transport=transport, iters=iters))
    return out


def reference(cfg: ProblemConfig, quant: str) -> torch.Tensor:
    p = make_problem(cfg).to("cuda:0")
    w1, w2 = p.expert_weights(quant).dequantized()
    return fp32_reference_moe(p.x, p.topk_ids, p.topk_weights, w1, w2, "interleaved", cfg.spec.swiglu_limit).cpu()


def single_gpu(cfg: ProblemConfig, case: EPCase) -> torch.Tensor:
    p = make_problem(cfg).to("cuda:0")
    plan = build_plan(cfg.spec, Knobs(dispatch_wire=case.dispatch_wire, combine_wire=case.combine_wire), quant=case.quant,
                      backends=(case.provider, "nccl"))
    return MegaMoELayer(plan, p.expert_weights(case.quant), device="cuda:0")(p.x, p.topk_ids, p.topk_weights).cpu()


def run_suite(name: str, cfg: ProblemConfig, provider: str, world: int, iters: int) -> dict:
    cases = cases_for(provider, iters)
    start = time.time()
    per_rank = spawn_ranks(world, run_ep_cases, cfg, cases, backend="nccl", timeout_s=900, pg_timeout_s=300)
    rows = []
    outs = {}
    refs = {}
    for i, case in enumerate(cases):
        out = torch.cat([r[i]["out"] for r in per_rank])
        outs[(case.transport, case.quant)] = out
        if case.quant not in refs:
            refs[case.quant] = reference(cfg, case.quant)
        row = {
            "transport": case.transport, "quant": case.quant, "dispatch_wire": case.dispatch_wire,
            "combine_wire": case.combine_wire, "rel_l2_vs_fp32": rel_l2(out.float(), refs[case.quant]),
            "gate": GATES[case.quant] if case.combine_wire == "bf16" or case.quant != "bf16" else 0.05,
            "ms_per_forward_slowest_rank": 1e3 * max(r[i]["seconds"] for r in per_rank) if iters > 1 else None,
            "startup_line_rank0": per_rank[0][i]["startup_line"],
        }
        row["passes_gate"] = row["rel_l2_vs_fp32"] < row["gate"]
        if case.quant == "bf16" and case.dispatch_wire == "bf16" and case.combine_wire == "bf16":
            row["bit_identical_to_single_gpu"] = bool(torch.equal(out, single_gpu(cfg, case)))
        rows.append(row)
    for quant in ("bf16", "a8w4", "a4w4"):
        if ("symm", quant) in outs:
            for row in rows:
                if row["transport"] == "symm" and row["quant"] == quant:
                    row["symm_equals_nccl_bitwise"] = bool(torch.equal(outs[("symm", quant)], outs[("nccl", quant)]))
    return {"suite": name, "provider": provider, "world": world, "tokens_per_rank": cfg.tokens_per_rank,
            "hidden": cfg.spec.hidden_size, "inter": cfg.spec.moe_intermediate_size, "experts": cfg.spec.n_routed_experts,
            "seconds": time.time() - start, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_validate.json")
    ap.add_argument("--world", type=int, default=min(2, torch.cuda.device_count()))
    ap.add_argument("--iters", type=int, default=4)
    args = ap.parse_args()
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
    report = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "suites": []}
    small = preset("dsv4-pro").scaled(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=32)
    mid = preset("dsv4-pro").scaled(hidden_size=7168, moe_intermediate_size=3072, n_routed_experts=16)
    plans = [("torch-experts small", ProblemConfig(small, 64, args.world, seed=0), "torch"),
             ("triton-experts dsv4-hidden", ProblemConfig(mid, 128, args.world, seed=1), "triton")]
    for name, cfg, provider in plans:
        try:
            report["suites"].append(run_suite(name, cfg, provider, args.world, args.iters))
        except Exception:
            report["suites"].append({"suite": name, "error": traceback.format_exc()[-4000:]})
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2)[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
