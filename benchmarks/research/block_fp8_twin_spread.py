"""Issue 61: how far the block-FP8 experts' pair rows are from their torch twin on a GPU, humming's and Triton's.

    PYTHONPATH=.:plugins/vllm:tests/experts_humming python3 benchmarks/research/block_fp8_twin_spread.py

On test_gpu_humming_block_fp8.py's problem (6 experts, hidden 512, intermediate 256, top-4, 32 tokens), without and
with the clamp: relL2 of the humming provider's rows and of the Triton block-FP8 experts' rows to
twin.twin_block_forward over all rows and for the worst row, humming to Triton, and whether bf16 rows in and a
second forward give the same bits. Prints one JSON line (benchmarks/results/h100_block_fp8_twin_spread.json: the
figures the GPU test's tolerances rest on).
"""

import json

import torch

import test_gpu_humming_block_fp8 as t
from twin import twin_block_forward
from megamoe_backend.experts import ExpertPairs
from megamoe_backend.experts.triton import TritonExperts
from megamoe_backend.layer.reference import rel_l2
res = {}
for limit in (None, 10.0):
    prepared, provider, weights, rows, x, pairs, math = t.problem(limit=limit)
    got = provider.forward(rows, pairs, prepared, math)
    rc = type(rows)(rows.data.cpu(), rows.scales.cpu(), rows.fmt)
    pc = ExpertPairs(pairs.row.cpu(), pairs.slot.cpu(), pairs.weight.cpu(), per_row=t.K)
    tw = twin_block_forward(rc, pc, weights.to("cpu"), math)
    per = [float(rel_l2(got[q].cpu(), tw[q])) for q in range(got.shape[0])]
    tri = TritonExperts(capacity=256*t.K).forward(rows, pairs, weights, math)
    pt = [float(rel_l2(tri[q].cpu(), tw[q])) for q in range(got.shape[0])]
    res[str(limit)] = dict(all_vs_twin=float(rel_l2(got.cpu(), tw)), worst_vs_twin=max(per), triton_all_vs_twin=float(rel_l2(tri.cpu(), tw)), triton_worst=max(pt),
        hum_vs_tri=float(rel_l2(got.cpu(), tri.cpu())), bf16_in_equal=bool(torch.equal(provider.forward(x, pairs, prepared, math), got)),
        again_equal=bool(torch.equal(provider.forward(rows, pairs, prepared, math), got)))
print(json.dumps(res))
