"""Probe (not used by the provider): FP8 wgmma throughput of the frag8 K step alone, on one GPU.

Why: at 1024 tokens per rank the mid bucket's 64-row launch (experts with 33-64 rows) takes ~1.5x
its weight floor while the 32-row launch beside it takes ~1.15x (docs/triton.md). Neither the decode
(removing it gains 9 % of that launch), nor more CTAs per SM, nor half the activation traffic closed
the gap. This times what is left when everything but the MMA is removed: one CTA per program runs the
frag8 K step's MMA — the weight tile (BN 128 rows x K 128, e4m3) as the register A operand (RS, as
frag8 feeds it), the token tile (K 128 x N, e4m3) from shared memory — ITERS times, with or without
the per-step retire the kernels need (mainloop._retire: every wgmma of a step finished before the
next step's decode may reuse its registers), at 1-4 CTAs per SM. The printed ns per step and TFLOP/s
give the MMA time of a launch: steps per SM x ns per step / CTAs per SM. ``ctas_per_sm`` is the
programs launched per SM; how many are resident at once is capped by registers (``--sass`` prints
them: at N 128 only two fit, so 3 programs per SM run in two waves).

    PYTHONPATH=. python3 benchmarks/research/wgmma_probe.py out.json        # on an H200 (~20 s)
    python3 benchmarks/research/wgmma_probe.py --sass                        # any machine: the compiled sm_90a loops

The weights are loaded once and stay in registers, so the loop is nothing but the step's wgmmas
(and the wait); tests/kernels/test_wgmma_probe.py checks the compiled loop on CPU (sm_90a: 8 register-A
QGMMA.64xNx32 per step, one full wait per step with the retire, none without).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from megamoe_backend.experts.triton.mainloop import _retire  # noqa: E402  the kernels' own per-step retire

BN = 128  # weight rows per tile (two m64 slabs), as the frag8 tiles
BK = 128  # the frag8 K step


@triton.jit
def mma_steps_kernel(w_ptr, a_ptr, out_ptr, ITERS, BN: tl.constexpr, BK: tl.constexpr, N: tl.constexpr,
                     RETIRE: tl.constexpr):
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm = tl.arange(0, N)
    w = tl.load(w_ptr + rn[:, None] * BK + rk[None, :]).to(tl.float8e4nv, bitcast=True)  # registers: the RS A operand
    a = tl.load(a_ptr + rk[:, None] * N + rm[None, :])  # shared memory: the B operand
    acc = tl.zeros((BN, N), dtype=tl.float32)
    for _ in range(ITERS):
        acc = tl.dot(w, a, acc)
        if RETIRE:
            acc = _retire(acc)
    tl.store(out_ptr + tl.program_id(0) * BN * N + rn[:, None] * N + rm[None, :], acc)


def compiled_loops() -> list[dict]:
    """sm_90a machine code of the probe's loop (Triton's bundled ptxas / nvdisasm, no GPU) for every
    N and retire setting: the wgmmas one iteration issues, their shape and A operand, and the full
    waits (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) per iteration."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sass_report import _k_loop, full_wgmma_waits, machine_code, registers_used

    sig = {"w_ptr": "*u8", "a_ptr": "*fp8e4nv", "out_ptr": "*fp32", "ITERS": "i32",
           "BN": "constexpr", "BK": "constexpr", "N": "constexpr", "RETIRE": "constexpr"}
    rows = []
    for n in (16, 32, 64, 128):
        for retire in (1, 0):
            src = ASTSource(fn=mma_steps_kernel, signature=sig, constexprs={"BN": BN, "BK": BK, "N": n, "RETIRE": retire})
            sass, info = machine_code(triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                     options={"num_warps": 4, "num_stages": 1}))
            loop = _k_loop(sass)
            mma = [m for x in loop if (m := re.search(r"QGMMA\.(\d+x\d+x\d+)\.F32\.E4M3\.E4M3 R\d+, (\S+),", x))]
            # the loop may be unrolled: count per iteration by the wgmmas one step issues (BN/64 slabs x BK/32)
            per_step = (BN // 64) * (BK // 32)
            rows.append({"N": n, "retire": retire, "loop_wgmmas": len(mma), "steps_in_loop": len(mma) // per_step,
                         "shapes": sorted({m.group(1) for m in mma}),
                         "a_from_registers": all(m.group(2).startswith("R") for m in mma),
                         "full_waits": full_wgmma_waits(loop),
                         # resident CTAs of 4 warps per SM are capped by registers: 65536 / (128 x registers)
                         "registers": registers_used(info)})
    return rows


def _clock_mhz() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(out_path: str, iters: int = 2000) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randint(0, 0x30, (BN, BK), dtype=torch.uint8, device=dev, generator=g)  # finite e4m3 bytes
    res = {"meta": {"gpu": torch.cuda.get_device_name(), "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
                    "date": time.strftime("%Y-%m-%d"), "iters": iters, "BN": BN, "BK": BK,
                    "command": "PYTHONPATH=. python3 benchmarks/research/wgmma_probe.py " + " ".join(sys.argv[1:]),
                    "clock_before": _clock_mhz()}, "rows": []}
    for n in (16, 32, 64, 128):
        a = (torch.randn(BK, n, device=dev, generator=g) * 0.1).to(torch.float8_e4m3fn)
        for retire in (1, 0):
            for ctas in (1, 2, 3, 4):
                out = torch.empty(sms * ctas, BN, n, device=dev)
                run = lambda: mma_steps_kernel[(sms * ctas,)](w, a, out, iters, BN=BN, BK=BK, N=n, RETIRE=retire,
                                                               num_warps=4, num_stages=1)
                run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(run, warmup=5, rep=50)
                row = {"N": n, "retire": retire, "ctas_per_sm": ctas, "us": round(ms * 1e3, 1),
                       "TFLOPs": round(2.0 * BN * BK * n * iters * sms * ctas / (ms * 1e-3) / 1e12, 1),
                       "ns_per_step": round(ms * 1e6 / iters, 2),  # one step of every CTA (ctas_per_sm steps per SM)
                       "ns_per_step_per_sm": round(ms * 1e6 / iters / ctas, 2)}
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
    res["meta"]["clock_after"] = _clock_mhz()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--sass"]:
        print(json.dumps(compiled_loops()))
    else:
        main(sys.argv[1])
