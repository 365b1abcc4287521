"""TileConfig.tail_m / tail_ride on the GPU: the bucket default against the same tiles with tail_m=0
and with tail_ride flipped (short tiles riding in their expert's previous tile, or in a launch of
their own) — repeated forwards bitwise equal, every variant equal to the default bit for bit, relL2
vs the bench's exact subset reference, and every variant's combine wire rows (``forward_wire``, bf16
and fp8) equal to the encode of its fp32 rows in three repeats. 192 experts, DSV4-Pro shapes, a8w4
and a4w4, 8192 and 1024 tokens. (The wire check was added after the register-operand race,
benchmarks/research/NOTEBOOK.md's tuning log, which a one-off script found, benchmarks/results/h200_fp8_rs_race.json; on the fixed
kernels, tree c91ffab, every check here passes on an H200.)

Why: a first design held both tile heights in one kernel; on the H200 its A8W4 GEMM1 gave results
that changed between identical forwards (benchmarks/results/h200_tail_ab.json). This is the check
that found it and that the two-launch design passes.

    PYTHONPATH=. python3 benchmarks/research/check_short_tiles.py out.json      # on an H200
"""
import json
import sys

import torch

from benchmarks.bench_experts import make_routing, make_weights
from benchmarks.references import check_subset, subset_reference
from megamoe_backend.experts import ExpertMath
from megamoe_backend.experts.triton.config import default_config
from megamoe_backend.experts.triton.provider import TritonExperts
from megamoe_backend.experts.triton.quant import quantize_rows
from megamoe_backend.formats.wire import combine_wire
from megamoe_backend.layer.reference import rel_l2


def main(path: str, n_exp: int = 192) -> int:
    dev = torch.device("cuda")
    fp4, bf16 = make_weights(n_exp, 7168, 3072, dev, 0)
    rows = []
    for tokens in (8192, 1024):
        x, pairs = make_routing(tokens, n_exp, 6, 7168, dev, tokens)
        sel = check_subset(pairs, 256, 0)
        for quant in ("a8w4", "a4w4"):
            math = ExpertMath(quant, 10.0)
            a = quantize_rows(x, math.a_format)
            w = TritonExperts().prepare_weights(fp4, math)
            exact = subset_reference(x, pairs, sel, bf16, math, exact=True)
            default = default_config(len(pairs), n_exp, "frag8")
            first = None
            variants = {"default": default, "tail_m=0": default.with_(tail_m=0, tail_ride=False),
                        f"tail_ride={not default.tail_ride}": default.with_(tail_ride=not default.tail_ride)}
            for name, cfg in variants.items():
                prov = TritonExperts(config=cfg)
                outs = [prov.forward(a, pairs, w, math) for _ in range(3)]
                torch.cuda.synchronize()
                r = {"quant": quant, "tokens": tokens, "variant": name, "tail": cfg.tail_m, "ride": cfg.tail_ride,
                     "bitwise_repeat": all(torch.equal(outs[0], o) for o in outs[1:]),
                     "max_abs_diff_repeat": max(float((outs[0] - o).abs().max()) for o in outs[1:]),
                     "relL2_ref": [rel_l2(o[sel], exact) for o in outs],
                     "nan": bool(torch.isnan(outs[0]).any())}
                if first is None:
                    first = outs[0].clone()
                else:
                    r["bitwise_equal_to_default"] = bool(torch.equal(first, outs[0]))
                # the combine wire rows GEMM2 writes (forward_wire; the layer's path): every repeat equal to
                # the encode of the fp32 rows (the register-operand race broke this for bf16 rows at 8192 tokens)
                for wn in ("bf16", "fp8_blockwise_1x32"):
                    wire = combine_wire(wn)
                    enc = wire.encode(outs[0])
                    r[f"wire_{wn}_equal_encode"] = all(
                        torch.equal(prov.forward_wire(a, pairs, w, math, wire), enc) for _ in range(3))
                print(json.dumps(r), flush=True)
                rows.append(r)
    json.dump(rows, open(path, "w"), indent=1)
    ok = all(r["bitwise_repeat"] and r.get("bitwise_equal_to_default", True)
             and all(v for k, v in r.items() if k.startswith("wire_")) for r in rows)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], *map(int, sys.argv[2:])))
