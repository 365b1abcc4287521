"""Compile the expert GEMMs (frag, frag8 and split decoders) for sm_90a on any machine (no GPU) and report what ptxas made of them.

Why: the H200 speed of these kernels hinges on properties visible only in the machine code — e.g.
ptxas silently serialising every wgmma (info C7515) when the compiler leaves a path that writes the
accumulators inside the MMA pipeline (GEMM1 at commit ce681ac: 25-42 % of its stall samples at
1024 / 8192 tokens), register spills, or the instruction count of the K loop. Triton's
wheel ships ptxas and nvdisasm, so CI checks these without a GPU (tests/kernels/test_sass.py).

    python3 benchmarks/research/sass_report.py            # the default tile of every frag / frag8 / split bucket
    python3 benchmarks/research/sass_report.py --json r.json

Must run without TRITON_INTERPRET (the kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def _tools() -> tuple[str, str]:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return str(bin_dir / "ptxas"), str(bin_dir / "nvdisasm")


HIDDEN, INTER = 7168, 3072  # DSV4-Pro: GEMM1 is [2 x INTER, HIDDEN], GEMM2 [HIDDEN, INTER]


def compile_gemm(which: str, cfg, decoder: str = "frag", a_fmt: str = "fp8", tile_pass: str = "full", out_fmt: str = "bf16",
                 dest: int = 0, persist: bool = False, dest_align: int = 16):
    """triton.compile of gemm1_swiglu_kernel / gemm2_weighted_kernel with the frag or split decoder
    (both read bf16 A gathered by gather.py) or frag8 (e4m3 A), as the provider launches them (DSV4-Pro
    K: 7168 for GEMM1, 3072 for GEMM2; divisibility 16 hints). out_fmt: what GEMM2 stores ("f32", or
    the combine wire "bf16" (the layer's default) / "fp8"); dest: GEMM2's DEST mode (0 pair order, 1 a
    table, 2 a base per segment); dest_align: DEST 2's promised alignment in bytes (the P2P forward's:
    16 at DSV4-Pro shapes, SegmentDest.align); persist: the persistent launch over live tiles (experts/live.py).
    PDL on: the wait for the predecessor (pdl.py), as a Hopper GPU launches them."""
    from megamoe_backend.experts.triton.config import reduction_block
    from megamoe_backend.experts.triton.gemm1 import gemm1_swiglu_kernel
    from megamoe_backend.experts.triton.gemm2 import gemm2_weighted_kernel
    from megamoe_backend.experts.triton.launch_plan import whole_weight_tiles

    a_ty = "*fp8e4nv" if decoder == "frag8" else "*bf16"
    o_ty = "*u8" if decoder == "frag8" else "*bf16"  # frag8: GEMM1 writes A2 in the MX wire format
    rows = {"wrs_ptr": "*fp32", "ars_ptr": "*fp32"}
    if which == "gemm1":
        fn, k = gemm1_swiglu_kernel, HIDDEN
        ptrs = {"tile_expert_ptr": "*i32", "sorted_row_ptr": "*i32", "live_tiles_ptr": "*i32", "claim_ptr": "*i32", "a_ptr": a_ty,
                "as_ptr": "*u8", "w_ptr": "*u8", "ws_ptr": "*u8", "o_ptr": o_ty, "os_ptr": "*u8", **rows}
        const = dict(W_FMT="mxfp4", A_FMT=a_fmt, PLAIN=False, HAS_LIMIT=True, DECODE=decoder, USE_ASM=True,
                     BN=cfg.block_n1, BM=cfg.block_m, BK=reduction_block(k, cfg.block_k), GROUP_M=cfg.group_m,
                     F32_DOT=False, BK2=reduction_block(INTER, cfg.block_k), TAIL_M=cfg.tail_m, PASS=tile_pass,
                     TAIL_RIDE=cfg.tail_ride, W_FULL=whole_weight_tiles(2 * INTER, cfg.block_n1), PERSIST=persist, PDL=True)
        sig = {n: ("constexpr" if n in const else "fp32" if n == "limit" else ptrs.get(n, "i32")) for n in fn.arg_names}
        divisible = set(ptrs) | {"K", "I"}
    else:
        fn, k = gemm2_weighted_kernel, INTER
        out_ty = {"f32": "*fp32", "bf16": "*bf16", "fp8": "*u8"}[out_fmt]
        ptrs = {"tile_expert_ptr": "*i32", "sorted_pair_ptr": "*i32", "live_tiles_ptr": "*i32", "claim_ptr": "*i32", "route_w_ptr": "*fp32", "a_ptr": a_ty,
                "as_ptr": "*u8", "w_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": out_ty, "dest_ptr": "*i64", **rows}
        const = dict(W_FMT="mxfp4", A_FMT="fp8" if decoder == "frag8" else "bf16", DECODE=decoder, USE_ASM=True, BN=cfg.block_n2, BM=cfg.block_m,
                     BK=reduction_block(k, cfg.block_k), GROUP_M=cfg.group_m, F32_DOT=False, TAIL_M=cfg.tail_m, PASS=tile_pass,
                     TAIL_RIDE=cfg.tail_ride, OUT_FMT=out_fmt, W_FULL=whole_weight_tiles(HIDDEN, cfg.block_n2),
                     DEST=int(dest), PERSIST=persist, DEST_ALIGN=dest_align if dest == 2 else 1, PDL=True)
        sig = {n: ("constexpr" if n in const else ptrs.get(n, "i32")) for n in fn.arg_names}
        divisible = set(ptrs) | {"K", "N"}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    cap = cfg.launch_registers(tile_pass, persist)  # the provider's launch cap (Triton's maxnreg)
    if cap:
        options["maxnreg"] = cap
    divisible |= {n for n in fn.arg_names if n.startswith("stride")}
    return compile_for_sm90(fn, sig, const, options, divisible)


def compile_for_sm90(fn, sig: dict[str, str], const: dict, options: dict, divisible=frozenset()):
    """triton.compile of ``fn`` for sm_90a: ``sig`` every argument's type ("constexpr" for those in
    ``const``), ``divisible`` the arguments given a divisibility-16 hint, as launches on aligned tensors get."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(c),): v for c, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _k_loop(sass: str) -> list[str]:
    """Instructions of the longest innermost backward-branch loop (the K loop; a persistent launch's tile
    loop encloses it and is not counted)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^\s*\.(L_x_\d+):", l))}
    loops = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    best: list[str] = []
    for a, b in inner:
        body = [x for x in lines[a: b + 1] if re.match(r"\s*/\*[0-9a-f]+\*/", x)]
        best = max(best, body, key=len)
    return best


def _inflight_a_writes(loop: list[str]) -> int:
    """Writes, in the K loop run twice (its back edge included), to a register that a wgmma issued
    earlier and not yet retired reads as its A operand (the 4 registers after the accumulator in
    HGMMA / QGMMA Rd, Ra, gdesc[..]). A wgmma group ends at the one marked gsb0; WARPGROUP.DEPBAR.LE
    gsb0, N retires all but the newest N groups. PTX leaves the result of such a write undefined (the
    tensor core may read the register after it changed); mainloop._retire is why there are none."""
    body = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s+", "", x).split(";")[0].strip() for x in loop]
    groups: list[list[set[int]]] = []  # in-flight groups, oldest first; each a list of A register sets
    open_group: list[set[int]] = []
    writes = 0
    for i in range(2 * len(body)):
        ins = body[i % len(body)]
        if re.match(r"[HQ]GMMA\.", ins):
            ops = [o.strip() for o in ins.split(None, 1)[1].split(",")]
            a = re.fullmatch(r"R(\d+)", ops[1])
            open_group.append(set(range(int(a.group(1)), int(a.group(1)) + 4)) if a else set())
            if ins.endswith("gsb0"):
                groups.append(open_group)
                open_group = []
            continue
        m = re.match(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", ins)
        if m:
            keep = int(m.group(1), 16)
            groups = groups[len(groups) - keep:] if keep else []
            continue
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)  # a predicated instruction writes when it runs
        d = re.match(r"([A-Z][A-Z0-9_.]*)\s+R(\d+)\b", ins)  # opcode, destination (stores have none)
        if i >= len(body) and d and not d.group(1).startswith(("ST", "RED", "ATOM")):
            op, r = d.group(1), int(d.group(2))
            width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
            writes += any(reg in regs for g in groups + [open_group] for regs in g for reg in range(r, r + width))
    return writes


def machine_code(kernel) -> tuple[str, str]:
    """(SASS of the cubin Triton produced, ptxas -v's report on its PTX: registers, spills, C75xx
    wgmma-serialisation infos) for a kernel compiled for sm_90a."""
    ptxas, nvdisasm = _tools()
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(kernel.asm["ptx"])
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True).stderr
        Path(cubin).write_bytes(kernel.asm["cubin"])  # disassemble what Triton itself produced
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
    return sass, info


def registers_used(info: str) -> int:
    """Registers per thread from ptxas -v (machine_code)."""
    return int(re.search(r"Used (\d+) registers", info).group(1))


# PTX instructions that touch memory a predecessor kernel may write (kernel parameters are not among them)
_MEMORY_OPS = re.compile(r"^\s*(@!?%p\d+\s+)?(ld\.(?!param)|st\.(?!param)|atom\.|red\.|cp\.async)")


def pdl_wait_first(ptx: str) -> bool | None:
    """For a kernel launched with programmatic dependent launch (experts/triton/pdl.py): whether its
    ``griddepcontrol.wait`` comes before its first memory access in the PTX (True), after one (False:
    that access may race the predecessor), or is absent (None: a kernel compiled without PDL)."""
    lines = ptx.splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if wait is None:
        return None
    first_memory = next((i for i, line in enumerate(lines) if _MEMORY_OPS.match(line)), len(lines))
    return wait < first_memory


def full_wgmma_waits(loop: list[str]) -> int:
    """Waits in a loop that retire every wgmma in flight (wait_group 0)."""
    return sum("DEPBAR.LE gsb0, 0x0" in x for x in loop)


def report(which: str, cfg, decoder: str = "frag", tile_pass: str = "full", out_fmt: str = "bf16", persist: bool = False,
           dest: int | None = None) -> dict:
    """tile_pass: the launch compiled ("full"; "ride" = full tiles carrying a tail rider, TileConfig.tail_ride);
    out_fmt: GEMM2's output (compile_gemm); persist: the EP forward's persistent launch over live tiles
    (GEMM2 writing through a destination per segment, DEST 2), as the P2P forward runs it without a bound;
    dest: GEMM2's DEST mode if not that default (2 with a tile grid: the P2P forward with a bound)."""
    dest = (2 if persist and which == "gemm2" else 0) if dest is None else dest
    kernel = compile_gemm(which, cfg, decoder, tile_pass=tile_pass, out_fmt=out_fmt, dest=dest, persist=persist)
    sass, info = machine_code(kernel)
    loop = _k_loop(sass)
    ops = collections.Counter()
    for line in loop:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)]
    from megamoe_backend.experts.triton.config import reduction_block

    k = {"gemm1": HIDDEN, "gemm2": INTER}[which]  # the GEMM's reduction length; its K step is reduction_block(k, ...)
    weights_per_thread = cfg.block_n1 if which == "gemm1" else cfg.block_n2
    weights_per_thread = weights_per_thread * reduction_block(k, cfg.block_k) // (32 * cfg.num_warps)
    return {
        "kernel": which,
        "decoder": decoder,
        "pass": tile_pass,
        "persist": persist,
        "out": out_fmt if which == "gemm2" else "",
        "dest": dest if which == "gemm2" else 0,
        "config": [cfg.block_m, cfg.block_n1 if which == "gemm1" else cfg.block_n2, cfg.block_k, cfg.num_warps, cfg.num_stages],
        "registers": registers_used(info),
        "spill_bytes": sum(spills),
        "wgmma_serialized": "C7515" in info or "C7510" in info,
        "loop_instructions": sum(ops.values()),
        "loop_hgmma": ops["HGMMA"] + ops["QGMMA"],  # bf16 / fp8 wgmma
        "loop_full_wgmma_waits": full_wgmma_waits(loop),
        "loop_inflight_a_writes": _inflight_a_writes(loop),
        "loop_instructions_per_weight": round(sum(ops.values()) / max(1, weights_per_thread), 3),
        "pdl_wait_first": pdl_wait_first(kernel.asm["ptx"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sass_report: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)", file=sys.stderr)
        return 2
    from megamoe_backend.experts.triton.config import BUCKETS, FRAG8_BUCKETS, FRAG_BUCKETS

    from megamoe_backend.experts.triton.launch_plan import tile_passes

    tables = (("frag", FRAG_BUCKETS), ("frag8", FRAG8_BUCKETS), ("split", BUCKETS))  # split: row-major MXFP4 the frag layout refuses
    rows = [report(which, cfg, decoder, p) for decoder, table in tables for _, cfg in table
            for p in tile_passes(cfg, decoder) for which in ("gemm1", "gemm2")]  # every launch of the provider
    # ... and the persistent launches of the EP forward without a bound (frag8: MX activations)
    rows += [report(which, cfg, "frag8", p, persist=True) for _, cfg in FRAG8_BUCKETS for p in tile_passes(cfg, "frag8")
             for which in ("gemm1", "gemm2")]
    # ... and GEMM2 as the P2P forward runs it into the combine regions: with a bound (tile grid) on either
    # combine wire, without one (persistent) on the fp8 one (bf16 is above)
    rows += [report("gemm2", cfg, "frag8", p, out_fmt=out, persist=persist, dest=2) for _, cfg in FRAG8_BUCKETS
             for p in tile_passes(cfg, "frag8") for out, persist in (("bf16", False), ("fp8", False), ("fp8", True))]
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
