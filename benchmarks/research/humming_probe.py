"""Issue 58 item 1 probe: the humming provider on one Hopper GPU, beside the Triton experts, in one process.

    python -m benchmarks.research.humming_probe --out probe.json [--experts 48] [--tokens 8 128 1024 8192]
                                                [--deadline-s 150] [--no-triton]

What it writes (JSON, rewritten after every step so a run cut short keeps what it measured): the platform
(GPU, torch / Triton / humming-kernels versions, gemm_choice's answer with MEGA_EXPERTS_GEMM=auto); the
weights' repack and first-use JIT time; humming's tuning buckets per sublayer (row-count range, tile); per
token bucket (DSV4-Pro expert shapes, uniform random top-6 routing, A8W4, bf16 combine rows as the layer
asks for them): µs of a CUDA-graph replay of the humming provider's forward and of the Triton provider's,
the relL2 of each against the fp32 reference (256 pairs), their relL2 to each other, and the humming
forward's kernels by name (torch.profiler over eager forwards: which part is humming's GEMMs, which the
provider's own kernels). Timing as the benches time (benchmarks/timing.py).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from benchmarks.bench_experts import make_routing, make_weights
from benchmarks.references import check_subset, subset_reference
from benchmarks.timing import capture_graph, time_fn
from megamoe_backend.experts import ExpertMath
from megamoe_backend.experts.scratch import ExpertsScratch
from megamoe_backend.formats.wire import combine_wire
from megamoe_backend.layer.reference import rel_l2


def kernel_times(fn, reps: int = 3) -> dict[str, float]:
    """µs per forward of each kernel name (CUDA time, torch.profiler over ``reps`` eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t:
            out[ev.key[:90]] = round(t / reps, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 128, 1024, 8192])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--deadline-s", type=float, default=150.0)
    ap.add_argument("--no-triton", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    rec: dict = {"args": vars(args), "steps": {}, "buckets": []}

    def save():
        rec["wall_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)

    def step(name, fn, record=True):
        s = time.time()
        try:
            value = fn()
            rec["steps"][name] = {"ok": True, "s": round(time.time() - s, 2), **({"value": value} if record else {})}
            return value
        except Exception as exc:  # noqa: BLE001 - the probe records what failed and goes on where it can
            rec["steps"][name] = {"ok": False, "s": round(time.time() - s, 2), "error": f"{type(exc).__name__}: {exc}",
                                  "trace": traceback.format_exc()[-3000:]}
            return None
        finally:
            save()

    def platform():
        import triton

        from megamoe_backend.experts.gemm_choice import choose_experts_gemm, gemm_facts
        from megamoe_backend.experts.humming import library

        p = torch.cuda.get_device_properties(dev)
        facts = gemm_facts("auto", dev, "a8w4")
        choice = choose_experts_gemm(facts)
        return {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "triton": triton.__version__,
                "cuda": torch.version.cuda, "humming": library.version(), "facts": str(facts), "auto": choice.gemm,
                "why": choice.why}

    step("platform", platform)
    math = ExpertMath("a8w4", swiglu_limit=10.0)
    fp4, bf16 = step("weights", lambda: make_weights(args.experts, args.hidden, args.intermediate, dev, seed=0), False)

    from megamoe_backend.experts.humming.provider import HummingExperts
    from megamoe_backend.experts.triton import TritonExperts

    capacity = max(args.tokens) * args.topk
    hum = HummingExperts(capacity=capacity)
    hw = step("humming_prepare", lambda: hum.prepare_weights(fp4, math), False)
    if hw is not None:
        rec["humming_jit"] = hum.jit_report
        subs = hum._sublayers(hw)
        rec["tuning"] = {s.name: [[lo, hi, cfg.get("block_shape"), cfg.get("warp_shape"), cfg.get("num_stages"),
                                   cfg.get("use_warp_spec"), cfg.get("num_ctas_per_sm")] for lo, hi, cfg in s.tuning]
                         for s in subs}
        save()
    tri = TritonExperts(capacity=capacity)
    tw = None if args.no_triton else step("triton_prepare", lambda: tri.prepare_weights(fp4, math), False)
    wire = combine_wire("bf16")
    for tokens in args.tokens:
        if time.time() - t0 > args.deadline_s:
            rec["buckets"].append({"tokens": tokens, "skipped": "deadline"})
            save()
            continue
        b: dict = {"tokens": tokens}
        rec["buckets"].append(b)
        x, pairs = make_routing(tokens, args.experts, args.topk, args.hidden, dev, seed=tokens)
        from megamoe_backend.experts.triton.quant import quantize_rows

        a = quantize_rows(x, "fp8", name="probe tokens")
        sel = check_subset(pairs, 256, 0)
        ref = subset_reference(x, pairs, sel, bf16, math, exact=False)
        outs = {}
        for name, prov, w in (("humming", hum, hw), ("triton", tri, tw)):
            if w is None:
                continue
            scratch = ExpertsScratch(dev)
            out = torch.empty(len(pairs), wire.row_bytes(args.hidden), dtype=torch.uint8, device=dev)
            fn = (lambda prov=prov, w=w, out=out, scratch=scratch:
                  prov.forward_wire(a, pairs, w, math, wire, out=out, scratch=scratch))
            try:
                fn()
                torch.cuda.synchronize()
                y = wire.decode_fp32(out, args.hidden)
                outs[name] = y
                b[f"{name}_rel_l2_fp32"] = float(rel_l2(y[sel], ref))
                eager = out.clone()
                g = capture_graph(fn)
                out.zero_()
                g.replay()
                torch.cuda.synchronize()
                b[f"{name}_graph_equals_eager"] = bool(torch.equal(out, eager))
                b[f"{name}_us"] = round(time_fn(g.replay, use_graph=False)[0], 1)
                b[f"{name}_scratch_mb"] = round(scratch.bytes / 2**20, 1)
                if name == "humming":
                    b["humming_kernels_us"] = kernel_times(fn)
            except Exception as exc:  # noqa: BLE001
                b[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
                b[f"{name}_trace"] = traceback.format_exc()[-3000:]
            save()
        if len(outs) == 2:
            b["humming_vs_triton_rel_l2"] = float(rel_l2(outs["humming"], outs["triton"]))
        save()
        del x, pairs, a, outs
    save()
    print(json.dumps({k: v for k, v in rec.items() if k != "steps"}, default=str)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
