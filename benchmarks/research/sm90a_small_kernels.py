"""The EP forward's small kernels compiled for sm_90a without a GPU: dispatch (bf16 / fp8 / fp4 wire),
the barrier (signal and wait, alone and together), the status word's publish, the MX quantisation
(per row piece, and over live rows), the layout's three kernels (pairs in order, and over live
rows) and frag8's row re-scales, the experts' kernels as Hopper launches them: with programmatic
dependent launch (experts/triton/pdl.py), whose wait must come before their first memory access.
Prints one JSON row per variant (registers, spilled bytes, where the PDL wait lies) and exits non-zero if
any variant fails to compile.

Why: the interpreter (CPU CI) runs these kernels' logic, not their compilation for the GPU; a kernel
that the interpreter accepts and ptxas refuses would first fail on a serving GPU. The expert GEMMs
have their own report (sass_report.py). Triton's own ptxas does the work, so no GPU is needed:

    PYTHONPATH=. python3 benchmarks/research/sm90a_small_kernels.py --json small_kernels.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from sass_report import compile_for_sm90, machine_code, pdl_wait_first, registers_used


def variants():
    """(name, kernel, argument types (default i32), constexprs, num_warps) of every launch the EP forward makes here."""
    from megamoe_backend.experts.triton.gather import rowscale_e4m3_kernel
    from megamoe_backend.experts.triton.layout_kernels import CHUNK, _chunk_histogram, _plan, _scatter
    from megamoe_backend.experts.triton.quant import BLOCKS_PER_PROGRAM, _quantize_rows_kernel
    from megamoe_backend.layer.device.p2p import PIECE_BLOCKS, _barrier_kernel, _dispatch_kernel
    from megamoe_backend.layer.device.status_publish_kernel import publish_kernel

    dispatch_types = {"x_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*fp32", "owner_ptr": "*i64", "slot_ptr": "*i64",
                      "arena_u8": "*u8", "arena_i16": "*i16", "arena_i64": "*i64", "arena_f32": "*fp32",
                      "peer_off_ptr": "*i64", "rows_b": "i64", "pair_live_ptr": "*i64", "status_ptr": "*i64"}
    for fmt in ("bf16", "fp8", "fp4"):
        for blocks in PIECE_BLOCKS:
            yield (f"dispatch {fmt} x{blocks}", _dispatch_kernel, dispatch_types,
                   dict(H=7168, K=6, K_PAD=8, FMT=fmt, BLOCKS=blocks, HW_CVT=True), 4)
    barrier_types = {"arena_i64": "*i64", "peer_off_ptr": "*i64", "flags_e": "i64", "header_e": "i64",
                     "rows_per_src": "i64", "epoch_ptr": "*i64", "budget": "i64", "status_ptr": "*i64"}
    for signal, wait in ((True, True), (True, False), (False, True)):
        yield (f"barrier{' signal' if signal else ''}{' wait' if wait else ''}", _barrier_kernel, barrier_types,
               dict(EP_PAD=8, CHECK_ROWS=True, CLOCK="globaltimer", FENCE=True, SIGNAL=signal, WAIT=wait), 1)
    yield ("status publish", publish_kernel, {"words_ptr": "*i64", "ack_host_ptr": "*i64", "host_ptr": "*i64"},
           dict(WORDS=4, PAD=8), 1)
    quant_types = {"x_ptr": "*bf16", "data_ptr": "*u8", "scale_ptr": "*u8", "status_ptr": "*i64", "live_ptr": "*i64",
                   "ids_ptr": "*i32"}
    for fmt in ("fp8", "fp4"):
        # over all rows; over the rows that route somewhere (the ep_size-1 device forward: vLLM's int32 ids, top-6);
        # over live rows
        for name, persist, topk in (("", False, 0), (" routed rows", False, 6), (" live rows", True, 0)):
            yield (f"quantize {fmt}{name}", _quantize_rows_kernel, quant_types,
                   dict(FMT=fmt, BLOCKS=BLOCKS_PER_PROGRAM, HW_CVT=True, STATUS=not persist, PERSIST=persist, N_SEG=8,
                        TOPK=topk, TOPK_PAD=8 if topk else 1), 4)
    for seg in (False, True):
        counts = "*i64" if seg else "*i32"
        yield (f"layout histogram{' live rows' if seg else ''}", _chunk_histogram,
               {"slot_ptr": "*i64", "hist_ptr": "*i32", "sorted_pair_ptr": "*i32", "sorted_row_ptr": "*i32",
                "counts_ptr": counts}, dict(E_PAD=64, CH=CHUNK, FB=1024, SEG=seg, N_SEG=8, PDL=True), 4)
        yield (f"layout scatter{' live rows' if seg else ''}", _scatter,
               {"slot_ptr": "*i64", "row_ptr": "*i64", "base_ptr": "*i32", "first_row_ptr": "*i32",
                "sorted_pair_ptr": "*i32", "sorted_row_ptr": "*i32", "counts_ptr": counts, "live_tiles_ptr": "*i32"},
               dict(E_PAD=64, CH=CHUNK, SEG=seg, N_SEG=8, PDL=True), 4)
        yield (f"layout plan{' live rows' if seg else ''}", _plan,
               {"hist_ptr": "*i32", "base_ptr": "*i32", "first_row_ptr": "*i32", "tile_end_ptr": "*i32",
                "tile_expert_ptr": "*i32", "live_tiles_ptr": "*i32"},
               dict(E_PAD=64, CB=64, TB=1024, LOG_E=7, ALL_TILES=not seg, PDL=True), 8)
    # frag8's row re-scales as the experts forward launches them over live rows: A (received rows), A2 (sorted)
    rowscale_types = {"sorted_pair_ptr": "*i32", "a_ptr": "*u8", "as_ptr": "*u8", "out_ptr": "*u8", "rs_ptr": "*fp32"}
    for sort in (False, True):
        yield (f"rowscale e4m3 {'A2' if sort else 'A'} live rows", rowscale_e4m3_kernel,
               {**rowscale_types, "live_ptr": "*i32" if sort else "*i64"},
               dict(A_FMT="fp8", SORTED=sort, NB=256 if not sort else 128, PK=1024, HW_CVT=True, PERSIST=True, N_SEG=8, PDL=True), 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="small_kernels.json")
    args = ap.parse_args()
    rows, failed = [], 0
    for name, fn, types, const, warps in variants():
        try:
            sig = {n: ("constexpr" if n in const else types.get(n, "i32")) for n in fn.arg_names}
            k = compile_for_sm90(fn, sig, const, {"num_warps": warps})
            _, info = machine_code(k)
            spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)]
            rows.append({"kernel": name, "registers": registers_used(info), "spill_bytes": sum(spills),
                         "cubin_bytes": len(k.asm["cubin"]), "pdl": bool(const.get("PDL")),
                         "pdl_wait_first": pdl_wait_first(k.asm["ptx"])})
        except Exception as exc:  # noqa: BLE001 - report every variant, fail at the end
            failed += 1
            rows.append({"kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:800]}"})
        print(json.dumps(rows[-1]), flush=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
