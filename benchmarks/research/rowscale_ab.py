"""A/B of the frag8 rowscale kernel and the layout build against an earlier commit's versions.

Why: rowscale_e4m3_kernel (frag8's A / A2 rescale into the fp8 K order) and build_layout_triton
are small launches whose share of a forward is hard to see in the bench; this times each old and
new version alone (CUDA events around 30 launches, median of 3) on the bench's routing, and checks
that the old and new rowscale write the same bytes and row scales for every live row.

    PYTHONPATH=. python3 benchmarks/research/rowscale_ab.py 5836006        # $OUT/rowscale_ab.json
    PYTHONPATH=. python3 benchmarks/research/rowscale_ab.py old_checkout/  # the same, old files read from a folder

The old versions are read with ``git show REV:...`` (or from the folder) into a temporary module;
REV must be a commit whose rowscale_e4m3_kernel still copied A per pair (GATHER, up to 5836006).
The new kernel converts each received row once (the old wrote one row per pair: the timings
compare those two jobs). The layout times include the Python launch overhead of three launches (CPU-bound, ~70-130 us either
way): they are not a GPU-time comparison (the profiler's ``_plan`` times are). Needs a CUDA GPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton


def _old_module(rev: str, path: str, name: str):
    if os.path.isdir(rev):  # a checkout of the old tree (where the machine has no git history)
        with open(os.path.join(rev, path)) as f:
            src = f.read()
    else:
        src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    src = src.replace("from .mxjit import", "from megamoe_backend.experts.triton.mxjit import")
    fd, file = tempfile.mkstemp(suffix=".py", prefix=name)
    with os.fdopen(fd, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # Triton's JIT reads the function source from this file
    return mod


def _timed(fn, n: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    res = []
    for _ in range(3):
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        res.append(s.elapsed_time(e) * 1e3 / n)
    return round(sorted(res)[1], 2)


def main() -> int:
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        print("usage (CUDA GPU): rowscale_ab.py OLD_REV|OLD_CHECKOUT_DIR", file=sys.stderr)
        return 2
    from benchmarks.bench_experts import make_routing
    from megamoe_backend.experts.triton import gather as gnew, layout_kernels as lnew
    from megamoe_backend.experts.triton.layout import build_layout, max_tiles
    from megamoe_backend.experts.triton.quant import quantize_rows

    gold = _old_module(sys.argv[1], "megamoe_backend/experts/triton/gather.py", "gather_old")
    lold = _old_module(sys.argv[1], "megamoe_backend/experts/triton/layout_kernels.py", "layout_old")
    dev = torch.device("cuda")
    out = {}
    old_pk = "PK" in gold.rowscale_e4m3_kernel.arg_names  # PK since 867a548
    old_rows = "row" in inspect.signature(lold.build_layout_triton).parameters  # build_layout_triton(slot, row, ...): with sorted_row
    for tokens, bm in ((1024, 64), (8192, 128)):  # the frag8 bucket tiles' block_m
        for fmt in ("fp8", "fp4"):
            x, pairs = make_routing(tokens, 192, 6, 7168, dev, tokens)
            a = quantize_rows(x, fmt)
            lay = build_layout(pairs.slot, 192, bm, len(pairs), row=pairs.row)
            rows, pr = lay.num_rows, pairs.row.to(torch.int32)
            live = lay.sorted_pair >= 0
            res = {}
            for k in (7168, 3072):  # A (hidden) and A2's width (intermediate)
                nb = triton.next_power_of_2(k // 32)
                ad = a.data[:, : (k if fmt == "fp8" else k // 2)].contiguous()
                asc = a.scales[:, : k // 32].contiguous()
                # old: a copy per (expert-sorted) pair row, through the layout; new: once per received row
                o_old, rs_old = torch.zeros(rows, k, dtype=torch.uint8, device=dev), torch.zeros(rows, device=dev)
                o_new, rs_new = torch.zeros(tokens, k, dtype=torch.uint8, device=dev), torch.zeros(tokens, device=dev)
                pk = {"PK": gnew.rowscale_piece(k)} if old_pk else {}
                res[f"K{k}_old_w8"] = _timed(lambda: gold.rowscale_e4m3_kernel[(rows,)](  # noqa: B023
                    lay.sorted_pair, pr, ad, ad.stride(0), asc, asc.stride(0), o_old, o_old.stride(0), rs_old, k,
                    A_FMT=fmt, GATHER=True, NB=nb, HW_CVT=True, num_warps=8, **pk))
                for w in (1, 2, 4, 8):
                    res[f"K{k}_new_w{w}"] = _timed(lambda: gnew.rowscale_e4m3_kernel[(tokens,)](  # noqa: B023
                        lay.sorted_pair, ad, ad.stride(0), asc, asc.stride(0), o_new, o_new.stride(0), rs_new, k,
                        A_FMT=fmt, SORTED=False, NB=nb, PK=gnew.rowscale_piece(k), HW_CVT=True, num_warps=w))
                src = lay.sorted_row[live].long()
                res[f"K{k}_equal"] = bool(torch.equal(o_old[live], o_new[src])
                                          and torch.equal(rs_old[live].nan_to_num(), rs_new[src].nan_to_num()))
            nt = max_tiles(len(pairs), 192, bm)
            old_args = (pairs.slot, pairs.row, 192, bm, nt) if old_rows else (pairs.slot, 192, bm, nt)
            res["layout_old"] = _timed(lambda: lold.build_layout_triton(*old_args))  # noqa: B023
            res["layout_new"] = _timed(lambda: lnew.build_layout_triton(pairs.slot, pairs.row, 192, bm, nt))  # noqa: B023
            old, new = lold.build_layout_triton(*old_args), lnew.build_layout_triton(pairs.slot, pairs.row, 192, bm, nt)
            res["layout_equal"] = bool(torch.equal(old[0], new[0]) and torch.equal(old[1], new[1]))
            out[f"{tokens}_{fmt}"] = res
            print(tokens, fmt, json.dumps(res), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "rowscale_ab.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
