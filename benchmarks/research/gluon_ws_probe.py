"""Probe (not used by the provider): the frag8 K loop warp-specialised in Gluon, against the `tl` loop.

Why: docs/triton.md named a warp-specialised kernel as the way past the `tl` loop's limit (each
warpgroup alternates its weight decode and its own FP8 wgmmas). Two designs, both with the `tl`
loop's relL2 vs the exact reference to every printed digit (race: decode shape only), measured on one H200
(benchmarks/results/h200_gluon_ws_probe.json, which keeps every command):
- SS (`ws_frag8_kernel`): TMA warps fill rings of raw fragment words / scales and of activation
  tiles, DEC_WARPS decoder warps write the e4m3 W' tile to shared memory, one consumer warpgroup
  keeps FP8 wgmmas in flight from shared memory. 1.2-2.4x SLOWER than `tl`: W' goes through shared
  memory twice (write + wgmma read) on top of the raw words and A (by our count ~1.5-2x the
  shared-memory bytes of the register-operand loop), and the partitions' registers allow one CTA per SM.
- RS (`ws_rs_kernel`): one TMA warp fills the rings, CW consumer warps decode into registers and
  issue register-A wgmmas (CUTLASS mixed-input style). SAFE (wgmma wait 0 before the next decode):
  equal to `tl` at decode shape (1048 vs 1057 us) and for prefill GEMM1 with BN256 x 8 warps (2207 vs
  2203 us), 4-21 % slower in the other mid / prefill rows. Keeping
  one wgmma in flight across the next decode ("race") needs the decoded fp8 operand kept alive by the
  wait's deps, which Triton 3.6 refuses for 8-bit tensors ("Unexpected bitwidth in WGMMAWaitGroupOp");
  without it the next decode reuses the registers of the running wgmma: wrong results at BM >= 64
  (measured), and even then at most 3.4 % faster than `tl` (prefill GEMM1).
Carrying the decoded tile across loop iterations instead makes the compiler unpack / repack it
byte by byte (~2.4x the loop instructions; measured slower, not kept here).

Shapes: 192 experts, GEMM1 (N 6144, K 7168) / GEMM2 (N 7168, K 3072), random fp8-kind fragments
(S in 0..11), e4m3 activations, power-of-two row scales; decode = 16-row tiles with 4 real rows,
mid = 64 with 32, prefill = 128 with 128. Specs: scen:gemm:kind:BN[:...] with kind tl (`:stages`),
ws (`:RST:WST:DEC_WARPS:DEC_REGS`) or rs (`:RST:CW:safe|race[:maxnreg]`):

    PYTHONPATH=. python3 benchmarks/research/gluon_ws_probe.py out.json mid:g1:tl:256 mid:g1:rs:128:4:4:safe:128   # on an H200

Historical: written and measured at commit ed2e9b9. Since 15546d8 the provider's fp8 fragments keep
their S bytes per (row, 128-wide K step) in a permuted K order (fragments.fp8_k_order), while the Gluon
kernels here still decode the old per-32-block S layout; main() therefore refuses to run on later
trees. To reproduce: ``git worktree add /tmp/ws ed2e9b9`` and run it there.
"""
import json
import sys
import time

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from megamoe_backend.experts import fragments
from megamoe_backend.experts.triton.mainloop import frag_mainloop
from megamoe_backend.experts.triton.mxjit import _FRAG8_ASM
from megamoe_backend.formats import MXTensor, dequantize_mx

ASM8 = _FRAG8_ASM.value
LUT_LO = gl.constexpr(fragments.FP8_LUT_LO)
LUT_HI = gl.constexpr(fragments.FP8_LUT_HI)


@gluon.jit
def _raw_loader(w_desc, s_desc, raw_w, raw_s, raw_ready, raw_free, row0, NK, KB: gl.constexpr):
    RST: gl.constexpr = raw_w.type.shape[0]
    for i in range(NK):
        s = i % RST
        ph = (i // RST) & 1
        mbarrier.wait(raw_free.index(s), ph ^ 1)
        mbarrier.expect(raw_ready.index(s), w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [row0, i * KB, 0, 0], raw_ready.index(s), raw_w.index(s))
        tma.async_copy_global_to_shared(s_desc, [row0, i * KB, 0], raw_ready.index(s), raw_s.index(s))


@gluon.jit
def _a_loader(a_desc, a_bufs, a_ready, mma_free, arow0, NK, BK: gl.constexpr):
    WST: gl.constexpr = a_bufs.type.shape[0]
    for i in range(NK):
        s = i % WST
        ph = (i // WST) & 1
        mbarrier.wait(mma_free.index(s), ph ^ 1)
        mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [arow0, i * BK], a_ready.index(s), a_bufs.index(s))


@gluon.jit
def _decode_tile(words, sb, BN: gl.constexpr, BK: gl.constexpr, dot_l: gl.constexpr, ASM_S: gl.constexpr):
    """Raw words [RB, KB, 4, 128] + scale bytes [RB, KB, 32] (as TMA lays them) -> the e4m3 W' tile
    [BN, BK] in the wgmma A-operand layout: the provider's frag8 decode (mainloop._frag_weights)."""
    RB: gl.constexpr = BN // 16
    KB: gl.constexpr = BK // 64
    words = gl.permute(gl.reshape(words, [RB, KB, 32, 16]), [1, 0, 2, 3])
    sb = gl.permute(gl.reshape(sb, [RB, KB, 8, 4]), [1, 0, 2, 3])
    rep = sb.to(gl.int32) * 8
    lut = gl.join(rep * 0x01010100 + LUT_LO, rep * 0x01010101 + LUT_HI)
    lut = gl.broadcast(gl.reshape(lut, [KB, RB, 8, 1, 2, 1, 4]),
                       gl.full([KB, RB, 8, 4, 2, 2, 4], 0, gl.int32, layout=gl.AutoLayout()))[0]
    x, y = gl.inline_asm_elementwise(ASM_S, "=r,=r,r,r,r,r,r", [words, gl.reshape(lut, [KB, RB, 32, 16])],
                                     dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    w = gl.reshape(gl.join(x, y), [KB, RB, 8, 4, 2, 2, 4, 2])
    w = gl.reshape(gl.permute(w, [1, 7, 2, 0, 4, 5, 3, 6]), [BN, BK])
    return gl.set_auto_layout(w, dot_l).to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _store_out(acc, acc_l: gl.constexpr, out_ptr, wrs_ptr, ars_ptr, e, n0, N, valid, BN: gl.constexpr, BM: gl.constexpr):
    """out[e * BM + m, n] = acc[n, m] x row scales, for the first ``valid`` token rows."""
    n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    m = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    acc = acc * gl.expand_dims(gl.load(wrs_ptr + e * N + n), 1) * gl.expand_dims(gl.load(ars_ptr + e * BM + m), 0)
    ok = gl.expand_dims(m < valid, 0) & gl.expand_dims(n >= 0, 1)
    gl.store(out_ptr + (e * BM + gl.expand_dims(m, 0)).to(gl.int64) * N + gl.expand_dims(n, 1), acc, mask=ok)


@gluon.jit
def _decoder(raw_w, raw_s, raw_ready, raw_free, w8, w_ready, mma_free, NK,
             BN: gl.constexpr, BK: gl.constexpr, DEC_WARPS: gl.constexpr, ASM_S: gl.constexpr):
    """SS design's decode partition: raw ring -> registers (slot released) -> decode -> W' ring."""
    RST: gl.constexpr = raw_w.type.shape[0]
    WST: gl.constexpr = w8.type.shape[0]
    par_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[DEC_WARPS, 1], instr_shape=[16, 64, 32])
    dot_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=par_l, k_width=4)
    for i in range(NK):
        s = i % RST
        mbarrier.wait(raw_ready.index(s), (i // RST) & 1)
        words = raw_w.index(s).load(gl.AutoLayout())
        sb = raw_s.index(s).load(gl.AutoLayout())
        fence_async_shared()
        mbarrier.arrive(raw_free.index(s), count=1)
        w = _decode_tile(words, sb, BN, BK, dot_l, ASM_S)
        t = i % WST
        mbarrier.wait(mma_free.index(t), ((i // WST) & 1) ^ 1)
        w8.index(t).store(w)
        fence_async_shared()
        mbarrier.arrive(w_ready.index(t), count=1)


@gluon.jit
def _mma_keep_one(a_op, b_smem, acc, free, i, ST: gl.constexpr):
    """Issue this step's wgmma asynchronously, wait until only it is in flight, and release the ring
    stage of the step before it (whose wgmma has now finished)."""
    acc = hopper.warpgroup_mma(a_op, b_smem.permute((1, 0)), acc, is_async=True)
    acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    mbarrier.arrive(free.index((i + ST - 1) % ST), count=1, pred=i > 0)
    return acc


@gluon.jit
def _consumer(w8, a_bufs, w_ready, a_ready, mma_free, out_ptr, wrs_ptr, ars_ptr, e, n0, N, NK, valid,
              BN: gl.constexpr, BM: gl.constexpr):
    WST: gl.constexpr = w8.type.shape[0]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 32])
    acc = gl.zeros([BN, BM], gl.float32, layout=acc_l)
    for i in range(NK):
        s = i % WST
        ph = (i // WST) & 1
        mbarrier.wait(w_ready.index(s), ph)
        mbarrier.wait(a_ready.index(s), ph)
        acc = _mma_keep_one(w8.index(s), a_bufs.index(s), acc, mma_free, i, WST)
    acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    _store_out(acc, acc_l, out_ptr, wrs_ptr, ars_ptr, e, n0, N, valid, BN, BM)


@gluon.jit
def _rings(w_desc, s_desc, a_desc, RST: gl.constexpr, AST: gl.constexpr):
    """Shared-memory rings the TMA fills: RST stages of raw fragment words and scale bytes, AST of A tiles."""
    raw_w = gl.allocate_shared_memory(gl.uint8, [RST] + w_desc.block_type.shape, w_desc.layout)
    raw_s = gl.allocate_shared_memory(gl.uint8, [RST] + s_desc.block_type.shape, s_desc.layout)
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [AST] + a_desc.block_type.shape, a_desc.layout)
    return raw_w, raw_s, a_bufs


@gluon.jit
def ws_frag8_kernel(w_desc, s_desc, a_desc, out_ptr, wrs_ptr, ars_ptr, N, K, valid,
                    BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, RST: gl.constexpr, WST: gl.constexpr,
                    DEC_WARPS: gl.constexpr, DEC_REGS: gl.constexpr, ASM_S: gl.constexpr):
    RB: gl.constexpr = BN // 16
    KB: gl.constexpr = BK // 64
    e = gl.program_id(1)
    pid_n = gl.program_id(0)
    NK = K // BK
    raw_w, raw_s, a_bufs = _rings(w_desc, s_desc, a_desc, RST, WST)
    w8_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    w8 = gl.allocate_shared_memory(gl.float8e4nv, [WST, BN, BK], w8_l)
    raw_ready = gl.allocate_shared_memory(gl.int64, [RST, 1], mbarrier.MBarrierLayout())
    raw_free = gl.allocate_shared_memory(gl.int64, [RST, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [WST, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [WST, 1], mbarrier.MBarrierLayout())
    mma_free = gl.allocate_shared_memory(gl.int64, [WST, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RST):
        mbarrier.init(raw_ready.index(i), count=1)
        mbarrier.init(raw_free.index(i), count=1)
    for i in gl.static_range(WST):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(mma_free.index(i), count=1)
    row0 = e * (N // 16) + pid_n * RB
    gl.warp_specialize([
        (_consumer, (w8, a_bufs, w_ready, a_ready, mma_free, out_ptr, wrs_ptr, ars_ptr, e, pid_n * BN, N, NK, valid, BN, BM)),
        (_decoder, (raw_w, raw_s, raw_ready, raw_free, w8, w_ready, mma_free, NK, BN, BK, DEC_WARPS, ASM_S)),
        (_raw_loader, (w_desc, s_desc, raw_w, raw_s, raw_ready, raw_free, row0, NK, KB)),
        (_a_loader, (a_desc, a_bufs, a_ready, mma_free, e * BM, NK, BK)),
    ], [DEC_WARPS, 1, 1], [DEC_REGS, 24, 24])


def layouts(BN, BM, BK):
    RB, KB = BN // 16, BK // 64
    w_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=4)
    s_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    a_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    return ([RB, KB, 4, 128], w_l), ([RB, KB, 32], s_l), ([BM, BK], a_l)


# ---- RS design: consumers decode into registers and issue register-A wgmma (CUTLASS mixed-input
# style); one TMA warp fills a ring of raw words + scales + A tiles.

@gluon.jit
def _rs_loader(w_desc, s_desc, a_desc, raw_w, raw_s, a_bufs, ready, free, row0, arow0, NK,
               KB: gl.constexpr, BK: gl.constexpr):
    RST: gl.constexpr = raw_w.type.shape[0]
    for i in range(NK):
        s = i % RST
        ph = (i // RST) & 1
        mbarrier.wait(free.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes + s_desc.block_type.nbytes + a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [row0, i * KB, 0, 0], ready.index(s), raw_w.index(s))
        tma.async_copy_global_to_shared(s_desc, [row0, i * KB, 0], ready.index(s), raw_s.index(s))
        tma.async_copy_global_to_shared(a_desc, [arow0, i * BK], ready.index(s), a_bufs.index(s))


@gluon.jit
def _rs_consumer(raw_w, raw_s, a_bufs, ready, free, out_ptr, wrs_ptr, ars_ptr, e, n0, N, NK, valid,
                 BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, CW: gl.constexpr, ASM_S: gl.constexpr, SAFE: gl.constexpr):
    RST: gl.constexpr = raw_w.type.shape[0]
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CW, 1], instr_shape=[16, BM, 32])
    dot_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
    acc = gl.zeros([BN, BM], gl.float32, layout=acc_l)
    for i in range(NK):
        s = i % RST
        mbarrier.wait(ready.index(s), (i // RST) & 1)
        w = _decode_tile(raw_w.index(s).load(gl.AutoLayout()), raw_s.index(s).load(gl.AutoLayout()), BN, BK, dot_l, ASM_S)
        if SAFE:  # the register operand w must not be overwritten while its wgmma runs
            acc = hopper.warpgroup_mma(w, a_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(free.index(s), count=1)
        else:  # races at BM >= 64 (measured): nothing keeps the next decode off w's registers
            acc = _mma_keep_one(w, a_bufs.index(s), acc, free, i, RST)
    acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    _store_out(acc, acc_l, out_ptr, wrs_ptr, ars_ptr, e, n0, N, valid, BN, BM)


@gluon.jit
def ws_rs_kernel(w_desc, s_desc, a_desc, out_ptr, wrs_ptr, ars_ptr, N, K, valid,
                 BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, RST: gl.constexpr,
                 CW: gl.constexpr, ASM_S: gl.constexpr, SAFE: gl.constexpr = True):
    RB: gl.constexpr = BN // 16
    KB: gl.constexpr = BK // 64
    e = gl.program_id(1)
    pid_n = gl.program_id(0)
    NK = K // BK
    raw_w, raw_s, a_bufs = _rings(w_desc, s_desc, a_desc, RST, RST)
    ready = gl.allocate_shared_memory(gl.int64, [RST, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [RST, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RST):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=1)
    row0 = e * (N // 16) + pid_n * RB
    gl.warp_specialize([
        (_rs_consumer, (raw_w, raw_s, a_bufs, ready, free, out_ptr, wrs_ptr, ars_ptr, e, pid_n * BN, N, NK, valid, BN, BM, BK, CW, ASM_S, SAFE)),
        (_rs_loader, (w_desc, s_desc, a_desc, raw_w, raw_s, a_bufs, ready, free, row0, e * BM, NK, KB, BK)),
    ], [1], [24])


@triton.jit
def tl_probe(w_ptr, ws_ptr, wrs_ptr, a_ptr, ars_ptr, out_ptr, K, N, valid, stride_we, stride_wse,
             BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BM)
    tl.assume(K >= BK)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc = frag_mainloop(acc, w_ptr + e * stride_we, ws_ptr + e * stride_wse, wrs_ptr + e * N, tl.program_id(0) * (BN // 16), N // 16,
                        a_ptr + e * BM * K, rows, rows < valid, K, ars_ptr + e * BM, K, "frag8", True, BN, BM, BK, False)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    tl.store(out_ptr + (e * BM + rows[None, :]) * N + n[:, None], acc, mask=(rows < valid)[None, :])


def exact(words, scales, wrs, a8, ars, e, n, k, bm):
    from megamoe_backend.experts.fragments import FragmentWeights, from_fragments
    f = FragmentWeights(words=words[e:e+1].view(1, n // 16, k // 64, 32, 16), scales=scales[e:e+1].view(1, n // 16, k // 64, 8, 4),
                        n=n, k=k, kind="fp8", row_scale=wrs[e:e+1])
    packed, s = from_fragments(f)
    w = dequantize_mx(MXTensor(packed[0], s[0], "fp4")).float()  # [n, k]
    a = a8[e * bm:(e + 1) * bm].float() * ars[e * bm:(e + 1) * bm, None]
    return (a.double() @ w.double().T).float()  # [bm, n]

def main(out_path, which):
    from megamoe_backend.experts import fragments

    if hasattr(fragments, "fp8_k_order"):
        raise SystemExit("gluon_ws_probe decodes the fp8 fragment layout of commit ed2e9b9 (one S byte per 32-block); "
                         "this tree permutes K and keeps one S byte per 128-wide step: run it at ed2e9b9 (module docstring)")
    dev = torch.device("cuda")
    E = 192
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "date": time.strftime("%Y-%m-%d"), "command": "PYTHONPATH=. python3 benchmarks/research/gluon_ws_probe.py " + " ".join(sys.argv[1:])}, "rows": []}
    shapes = {"g1": (6144, 7168), "g2": (7168, 3072)}
    scen = {"decode": (16, 4), "mid": (64, 32), "prefill": (128, 128)}
    plan = [x.split(":") for x in which]  # scen:gemm:kind:BN[:RST:WST:DEC_WARPS:DEC_REGS]
    cache = {}
    for p in plan:
        sc, gm, kind, bn = p[0], p[1], p[2], int(p[3])
        n, k = shapes[gm]
        bm, valid = scen[sc]
        key = (gm, sc)
        if key not in cache:
            cache.clear(); torch.cuda.empty_cache()
            words = torch.randint(0, 256, (E, n // 16, k // 64, 512), dtype=torch.uint8, device=dev, generator=g)
            scales = torch.randint(0, 12, (E, n // 16, k // 64, 32), dtype=torch.uint8, device=dev, generator=g)
            wrs = torch.exp2(torch.randint(-8, -2, (E, n), device=dev, generator=g).float())
            a8 = (torch.randn(E * bm, k, device=dev, generator=g) * 40).to(torch.float8_e4m3fn)
            ars = torch.exp2(torch.randint(-6, 0, (E * bm,), device=dev, generator=g).float())
            refs = {e: exact(words, scales, wrs, a8, ars, e, n, k, bm)[:valid] for e in (0, E - 1)}
            cache[key] = (words, scales, wrs, a8, ars, refs)
        words, scales, wrs, a8, ars, refs = cache[key]
        out = torch.zeros(E * bm, n, dtype=torch.float32, device=dev)
        bk = 128
        if kind == "tl":
            st = int(p[4]) if len(p) > 4 else 3
            grid = (n // bn, E)
            f = lambda: tl_probe[grid](words, scales, wrs, a8, ars, out, k, n, valid, words.stride(0), scales.stride(0),
                                       BN=bn, BM=bm, BK=bk, num_warps=4, num_stages=st)
            tag = f"{sc} {gm} tl BN{bn} s{st}"
        elif kind == "rs":
            rst, cw = int(p[4]), int(p[5])
            safe = not (len(p) > 6 and p[6] == "race")
            mr = {"maxnreg": int(p[7])} if len(p) > 7 else {}
            (wb, wl), (sb, sl), (ab, al) = layouts(bn, bm, bk)
            wd = TensorDescriptor.from_tensor(words.view(E * n // 16, k // 64, 4, 128), wb, wl)
            sd = TensorDescriptor.from_tensor(scales.view(E * n // 16, k // 64, 32), sb, sl)
            ad = TensorDescriptor.from_tensor(a8, ab, al)
            grid = (n // bn, E)
            f = lambda: ws_rs_kernel[grid](wd, sd, ad, out, wrs, ars, n, k, valid, BN=bn, BM=bm, BK=bk, RST=rst, CW=cw, SAFE=safe,
                                             ASM_S=ASM8, num_warps=cw, **mr)
            tag = f"{sc} {gm} rs BN{bn} r{rst} cw{cw}" + ("" if safe else " race") + (f" maxnreg{mr['maxnreg']}" if mr else "")
        else:
            rst, wst, dw, dr = (int(x) for x in p[4:8])
            (wb, wl), (sb, sl), (ab, al) = layouts(bn, bm, bk)
            wd = TensorDescriptor.from_tensor(words.view(E * n // 16, k // 64, 4, 128), wb, wl)
            sd = TensorDescriptor.from_tensor(scales.view(E * n // 16, k // 64, 32), sb, sl)
            ad = TensorDescriptor.from_tensor(a8, ab, al)
            grid = (n // bn, E)
            f = lambda: ws_frag8_kernel[grid](wd, sd, ad, out, wrs, ars, n, k, valid, BN=bn, BM=bm, BK=bk, RST=rst, WST=wst,
                                                DEC_WARPS=dw, DEC_REGS=dr, ASM_S=ASM8, num_warps=4)
            tag = f"{sc} {gm} ws BN{bn} r{rst} w{wst} d{dw}x{dr}"
        row = {"tag": tag}
        try:
            f(); torch.cuda.synchronize()
            o = out.view(E, bm, n)
            row["relL2_vs_exact"] = max(float((o[e, :valid].double() - r.double()).norm() / r.double().norm()) for e, r in refs.items())
            us = [triton.testing.do_bench(f, warmup=10, rep=60) * 1000 for _ in range(2)]
            row["us"] = round(min(us), 1); row["us_runs"] = [round(u, 1) for u in us]
            wbytes = words.numel() + scales.numel()
            row["weight_TBps"] = round(wbytes / (row["us"] * 1e-6) / 1e12, 3)
            row["floor_us"] = round(wbytes / 4.8e12 * 1e6, 1)
            row["fp8_TFLOPs_valid"] = round(2 * E * valid * n * k / (row["us"] * 1e-6) / 1e12, 1)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:800]}"
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        json.dump(res, open(out_path, "w"), indent=1)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
