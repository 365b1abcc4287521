"""Probe (not used by the provider): the frag K loop written in Gluon, against the Triton `tl` loop.

Why: docs/triton.md names a Gluon kernel as the way past `tl`'s limits (a wgmma whose register
operand is decoded in the same iteration cannot stay in flight; per-k16 descriptor arithmetic).
This probe answers the first question cheaply: with the same fragments, decode PTX and tiles, does a
straightforward single-warpgroup Gluon loop — cp.async ring, async register-A wgmma with one group
kept in flight across iterations, no per-step descriptor arithmetic — beat `tl`? It compiles clean
(no layout conversions, no wgmma serialisation, 2.60 instead of 2.88 loop instructions per weight at
BN256 BK64) and is bitwise equal to `tl` at BN256 BK64, but on the H200 it is only ~2 % faster at
decode shape and 27 % slower at prefill shape (benchmarks/results/h200_gluon_probe.json): the gain
needs warp specialisation, not just async issue. Known issue: the BK128 variant differs from `tl`
(relL2 9e-4), not investigated.

GEMM2-shaped: 192 experts, N 7168, K 3072, random fragment bytes with E8M0 scales 118..125;
decode = 16-row tiles with 4 real rows, prefill = 128 real rows.

    PYTHONPATH=. python3 benchmarks/research/gluon_probe.py out.json      # on an H200
"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from megamoe_backend.experts.triton.mainloop import frag_mainloop
from megamoe_backend.experts.triton.mxjit import _FRAG_ASM

ASM = _FRAG_ASM.value


@gluon.jit
def gl_probe(w_ptr, ws_ptr, a_ptr, out_ptr, K, N, stride_we, stride_wse,
             BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, ASM_S: gl.constexpr, STAGES: gl.constexpr, VALID: gl.constexpr):
    RB: gl.constexpr = BN // 16
    KB: gl.constexpr = BK // 64
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    dot_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2, transposed=True)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    w_bl: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])
    s_bl: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    a_bl: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 4], [0, 1])
    gl.assume(K >= STAGES * BK)
    e = gl.program_id(1).to(gl.int64)
    w_ptr = w_ptr + e * stride_we
    ws_ptr = ws_ptr + e * stride_wse
    a_ptr = a_ptr + e * BM * K
    rb0 = gl.program_id(0) * RB
    r = gl.arange(0, KB * RB * 32, layout=gl.SliceLayout(1, w_bl))
    rb = rb0 + (r // 32) % RB
    w_off = (rb.to(gl.int64) * (K // 64) + r // (RB * 32)) * 512 + (r % 32) * 16
    w_off = gl.expand_dims(w_off, 1) + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, w_bl)), 0)
    h = gl.arange(0, KB * RB * 2, layout=gl.SliceLayout(1, s_bl))
    rbs = rb0 + (h // 2) % RB
    s_off = (rbs.to(gl.int64) * (K // 64) + h // (RB * 2)) * 32 + (h % 2) * 16
    s_off = gl.expand_dims(s_off, 1) + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, s_bl)), 0)
    kk = gl.arange(0, BK, layout=gl.SliceLayout(1, a_bl))
    mm = gl.arange(0, BM, layout=gl.SliceLayout(0, a_bl))
    a_off = gl.expand_dims(mm.to(gl.int64), 0) * K + gl.expand_dims(kk, 1)
    a_ok = gl.expand_dims(mm < VALID, 0) & gl.expand_dims(kk >= 0, 1)
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, KB * RB * 32, 16], flat)
    s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, KB * RB * 2, 16], flat)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BK, BM], b_sl)
    for s in gl.static_range(STAGES - 1):
        async_copy.async_copy_global_to_shared(w_smem.index(s), w_ptr + w_off + s * KB * 512)
        async_copy.async_copy_global_to_shared(s_smem.index(s), ws_ptr + s_off + s * KB * 32)
        async_copy.async_copy_global_to_shared(b_smem.index(s), a_ptr + a_off + s * BK, mask=a_ok)
        async_copy.commit_group()
    acc = gl.zeros([BN, BM], gl.float32, layout=acc_l)
    i = 0
    for k0 in range(0, K, BK):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        st = i % STAGES
        words = gl.reshape(w_smem.index(st).load(gl.AutoLayout()), [KB, RB, 32, 16])
        s8 = gl.reshape(s_smem.index(st).load(gl.AutoLayout()), [KB, RB, 8, 4])
        pair = s8.to(gl.int32) * 0x00800080
        pair = gl.broadcast(gl.reshape(pair, [KB, RB, 8, 1, 2, 1, 2, 1]),
                            gl.full([KB, RB, 8, 4, 2, 2, 2, 2], 0, gl.int32, layout=gl.AutoLayout()))[0]
        pair = gl.reshape(pair, [KB, RB, 32, 16])
        x, y = gl.inline_asm_elementwise(ASM_S, "=r,=r,=r,=r,r,r,r,r,r", [words, pair],
                                         dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
        w = gl.reshape(gl.join(x, y), [KB, RB, 8, 4, 4, 2, 2, 2])
        w = gl.reshape(gl.permute(w, [1, 5, 2, 0, 4, 7, 3, 6]), [BN, BK])
        w = gl.set_auto_layout(w, dot_l)
        acc = hopper.warpgroup_mma(w, b_smem.index(st), acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        # refill the stage read two iterations ago (its wgmma has completed: at most one is in flight)
        nxt = k0 + (STAGES - 1) * BK
        ok = nxt < K
        ns = (i + STAGES - 1) % STAGES
        async_copy.async_copy_global_to_shared(w_smem.index(ns), w_ptr + w_off + (nxt // 64) * 512, mask=ok)
        async_copy.async_copy_global_to_shared(s_smem.index(ns), ws_ptr + s_off + (nxt // 64) * 32, mask=ok)
        async_copy.async_copy_global_to_shared(b_smem.index(ns), a_ptr + a_off + nxt, mask=a_ok & ok)
        async_copy.commit_group()
        i += 1
    acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    acc = acc * 9.223372036854775808e18  # SPLIT_UNSCALE = 2**63
    n = gl.program_id(0) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
    m = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    gl.store(out_ptr + e * BM * N + gl.expand_dims(m, 0) * N + gl.expand_dims(n, 1), acc)


@triton.jit
def tl_probe(w_ptr, ws_ptr, a_ptr, out_ptr, K, N, stride_we, stride_wse,
             BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, VALID: tl.constexpr):
    e = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc = frag_mainloop(acc, w_ptr + e * stride_we, ws_ptr + e * stride_wse, tl.program_id(0) * (BN // 16), N // 16,
                        a_ptr + e * BM * K, rows, rows < VALID, K, K, True, BN, BM, BK, False)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    tl.store(out_ptr + e * BM * N + rows[None, :] * N + n[:, None], acc)

def main(path: str) -> None:
    dev = torch.device("cuda")
    E, N, K = 192, 7168, 3072
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randint(0, 256, (E, N // 16, K // 64, 512), dtype=torch.uint8, device=dev, generator=g)
    ws = torch.randint(181, 189, (E, N // 16, K // 64, 32), dtype=torch.uint8, device=dev, generator=g)  # E8M0 118..125, +63
    res = {}
    def run(tag, kind, bm, valid, bn, bk, st, a, rnd):
        out = torch.empty(E, bm, N, dtype=torch.float32, device=dev)
        grid = (N // bn, E)
        if kind == "gl":
            f = lambda: gl_probe[grid](w, ws, a, out, K, N, w.stride(0), ws.stride(0), BN=bn, BM=bm, BK=bk, ASM_S=ASM, STAGES=st, VALID=valid, num_warps=4)
        else:
            f = lambda: tl_probe[grid](w, ws, a, out, K, N, w.stride(0), ws.stride(0), BN=bn, BM=bm, BK=bk, VALID=valid, num_warps=4, num_stages=st)
        f(); torch.cuda.synchronize()
        us = triton.testing.do_bench(f, warmup=25, rep=100) * 1000
        key = f"{tag} {kind} BM{bm} BN{bn} BK{bk} s{st} r{rnd}"
        res[key] = {"us": round(us, 1), "weight_TBps": round((w.numel() + ws.numel()) / (us * 1e-6) / 1e12, 3)}
        print(key, res[key], flush=True)
        return out
    for tag, bm, valid, cfgs in [("decode", 16, 4, [("tl", 256, 64, 4), ("gl", 256, 64, 4), ("gl", 128, 128, 3)]),
                                 ("prefill", 128, 128, [("tl", 128, 128, 3), ("gl", 128, 64, 3)])]:
        a = torch.randn(E, bm, K, device=dev, generator=g).to(torch.bfloat16)
        ref = None
        for rnd in range(3):
            for kind, bn, bk, st in cfgs:
                try:
                    out = run(tag, kind, bm, valid, bn, bk, st, a, rnd)
                except Exception as exc:
                    print("FAILED", tag, kind, bn, bk, type(exc).__name__, str(exc)[:600], flush=True)
                    continue
                if ref is None:
                    ref = out.clone()
                key = f"{tag} {kind} BM{bm} BN{bn} BK{bk} s{st} r{rnd}"
                d = float((out.double() - ref.double()).norm() / ref.double().norm())
                res[key].update(rel_diff_vs_tl=d, bitwise_equal_tl=bool(torch.equal(out, ref)), ref_norm=float(ref.double().norm()))
                if rnd == 0:
                    print("   rel diff vs tl", d, "equal", bool(torch.equal(out, ref)), "ref norm", float(ref.double().norm()), flush=True)
                del out
        del a, ref
    json.dump(res, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
