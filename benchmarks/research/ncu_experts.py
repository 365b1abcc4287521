"""One TritonExperts forward per token bucket inside an NVTX range, for Nsight Compute.

Why: `megamoe bench experts` times whole forwards; to see *why* a kernel is slow (issue slots, L2 /
DRAM throughput, shared-memory wavefronts, stall reasons per SASS line) ncu must profile exactly one
launch of each kernel at the real DSV4-Pro shapes. Weights are random MXFP4 bytes with E8M0 scales in
a normal range (the kernels' speed does not depend on the values), re-laid for the decoder once.

    ncu --clock-control none --set full --nvtx --nvtx-include prof128/ -k regex:gemm -o rep \\
        python3 benchmarks/research/ncu_experts.py frag 128
    ncu -i rep.ncu-rep --page details        # or --page source --csv --print-source sass

Arguments: decoder, then token buckets as T or T:block_m,block_n1,block_n2,block_k,warps,stages.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.bench_experts import make_routing
from megamoe_backend.experts import ExpertMath, ExpertWeights
from megamoe_backend.experts.triton.config import TileConfig
from megamoe_backend.experts.triton.provider import TritonExperts
from megamoe_backend.experts.triton.quant import quantize_rows

EXPERTS, HIDDEN, INTER, TOPK = 192, 7168, 3072, 6


def random_mxfp4(dev: torch.device) -> ExpertWeights:
    g = torch.Generator(device=dev).manual_seed(0)

    def payload(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=dev, generator=g)

    def scales(*shape):
        return torch.randint(118, 126, shape, dtype=torch.uint8, device=dev, generator=g)

    e, h, i = EXPERTS, HIDDEN, INTER
    return ExpertWeights(payload(e, 2 * i, h // 2), payload(e, h, i // 2), "mxfp4", "interleaved",
                         scales(e, 2 * i, h // 32), scales(e, h, i // 32))


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not torch.cuda.is_available():
        print(__doc__, file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    decoder = argv[0]
    math = ExpertMath("a8w4", 10.0)
    weights = TritonExperts(decoder=decoder).prepare_weights(random_mxfp4(dev), math)
    for spec in argv[1:]:
        tokens, *cfg = spec.split(":")
        config = TileConfig(*map(int, cfg[0].split(","))) if cfg else None
        x, pairs = make_routing(int(tokens), EXPERTS, TOPK, HIDDEN, dev, int(tokens))
        a = quantize_rows(x, "fp8")
        prov = TritonExperts(capacity=len(pairs), decoder=decoder, config=config)
        for _ in range(2):  # compile + warm up outside the profiled range
            prov.forward(a, pairs, weights, math)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"prof{tokens}")
        prov.forward(a, pairs, weights, math)
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        print("profiled", spec, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
