"""The device P2P forward's two new kernels: dispatch (quantise once, write to the owners) and the
cross-rank barrier with a bounded wait.

Why these and nothing else: the rest of the EP forward is the ep_size-1 forward's kernels on other
buffers. The expert layout runs on the receiver's own pair list (whatever the peers wrote), GEMM2
writes each row where its source segment's destination says (the source rank's combine region), and the top-k
sum reads this rank's combine region in pair order. Peers are addressed through one int64 byte
offset each (transport/peer_arena.py): ``arena + offset[r]`` is rank r's arena in this process.

Dispatch, one program per (token t < T of this rank, piece of BLOCKS x 32 columns of its row); one
  program when T = 0: quantise the piece once into the A format (NaN / Inf -> status word) and write
  it to every rank owning one of the row's experts at row me * B + t of that rank's recv region (B:
  rows per source, the same on every rank). The row's first piece also checks the k ids (the first
  bad one -> status word) and writes the k (slot, weight) entries of the row to EVERY rank (slot -1
  where that rank owns none of them). Pieces, not whole rows, per program: a decode step has a
  handful of tokens, and one program quantising a 7168-wide row in 28 serial steps took 57 µs at 8
  tokens (EP 8, H200); the sender quantisation of the ep_size-1 forward is split the same way
  (experts/triton/quant.py). At prefill sizes the same narrow pieces are the opposite problem:
  8192 tokens x 28 pieces are 229,376 programs, each a chain of dependent loads (ids -> owners ->
  row) for 256 columns: 545 µs at EP 8 against 93 µs of HBM traffic; so the pieces widen (up to 32
  blocks: 230 µs) as long as MIN_PROGRAMS programs remain (:func:`blocks_per_program`).
  Program (0, 0) writes (B, T) into every rank's header: a receiver reads the first T rows of
  source me's region and nothing after them (experts/live.py LiveRows), so no stale entry of an earlier, larger batch is ever read and no
  work is spent on the rows of the region nobody sent. Also: this rank's pair_live (owner of each
  pair, -1 = runs nowhere: the top-k sum skips it).

Barrier (one program): bump this phase's epoch, fence, store it (relaxed, system scope: with the
fence, PTX's release pattern) into every peer's flag of this rank at once, then poll every peer's
flag here at once (relaxed, system scope) until all reached it or the deadline passed, and fence
(the acquire pattern). The one-process emulator (transport/peer_arena.py) runs the signal and
the wait as two launches, every rank's signal before any rank's wait, as ranks on one stream must. A wait that ends by the deadline records (PEER_TIMEOUT, layer, peer,
phase) in the status word and returns: the stream goes on, the host raises at its next check
(layer/device/status.py) naming the layer, this rank and the peer. Later barriers of the step
still signal but do not wait once the word holds a timeout, so a dead peer costs one timeout per
step, not one per barrier. The GPU context survives. On
the GPU the deadline is the global timer; the interpreter has no clock, so there it is a spin
count calibrated to the same seconds (``spins_per_second``).
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from ...experts.triton.config import interpreting
from ...experts.triton.mxjit import round_bf16
from ...experts.triton.quant import quantize_blocks, quantize_g128
from .status import BAD_EXPERT_ID, NONFINITE_INPUT, PEER_TIMEOUT, ROWS_MISMATCH

PIECE_BLOCKS = (8, 16, 32)  # 32-element blocks quantised per program (a piece of a row), narrowest first
MIN_PROGRAMS = 512  # pieces widen only while at least this many programs remain (H200: blocks_per_program)
# the status codes as the kernels see them (a jit function reads only constexpr globals)
_BAD_ID = tl.constexpr(BAD_EXPERT_ID)
_NAN_ROW = tl.constexpr(NONFINITE_INPUT)
_TIMEOUT = tl.constexpr(PEER_TIMEOUT)
_MISMATCH = tl.constexpr(ROWS_MISMATCH)


@triton.jit
def _record(status_ptr, code, layer_id, value, row):
    """First problem wins (the word's code is 0 until then)."""
    zero = value.to(tl.int64) * 0  # int64 operands: the CAS must match the word's type
    if tl.atomic_cas(status_ptr, zero, zero + code) == 0:
        tl.store(status_ptr + 1, zero + layer_id)  # (an int arg may arrive as a constant)
        tl.store(status_ptr + 2, value.to(tl.int64))
        tl.store(status_ptr + 3, zero + row)


@triton.jit(do_not_specialize=["n_tokens", "rows_per_src"])  # 1 token / 1 row must not become a constexpr
def _dispatch_kernel(
    x_ptr, stride_x, ids_ptr, w_ptr, owner_ptr, slot_ptr, num_physical, n_tokens, rows_per_src, ep, me,
    arena_u8, arena_i16, arena_i64, arena_f32, peer_off_ptr,
    header_e, rows_b, row_bytes, slot_e, weight_e,
    pair_live_ptr, status_ptr, layer_id,
    H: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, FMT: tl.constexpr, BLOCKS: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    live = t < n_tokens
    j = tl.arange(0, K_PAD)
    jm = j < K
    e = tl.load(ids_ptr + t * K + j, mask=jm & live, other=-1).to(tl.int64)
    known = (e >= 0) & (e < num_physical)
    safe = tl.where(known, e, 0)
    owner = tl.load(owner_ptr + safe, mask=known, other=-1).to(tl.int64)
    if piece == 0:
        slot = tl.load(slot_ptr + safe, mask=known, other=-1).to(tl.int64)
        wt = tl.load(w_ptr + t * K + j, mask=jm & live, other=0.0).to(tl.float32)
        tl.store(pair_live_ptr + t * K + j, tl.where(known, owner, -1), mask=jm & live)
        bad = jm & live & ((e < -1) | (e >= num_physical))
        if tl.sum(bad.to(tl.int32), axis=0) > 0:
            first = tl.min(tl.where(bad, j, K_PAD), axis=0)
            _record(status_ptr, _BAD_ID, layer_id, tl.sum(tl.where(j == first, e, 0), axis=0), t)

        # metadata of row t to every rank (-1 / 0 where that rank owns none of the row's experts); the
        # header (rows per source, tokens sent) from program (0, 0)
        q = (me * rows_per_src + t) * K + j
        for r in range(ep):
            off = tl.load(peer_off_ptr + r)
            here = known & (owner == r)
            tl.store(arena_i64 + (off >> 3) + slot_e + q, tl.where(here, slot, -1), mask=jm & live)
            tl.store(arena_f32 + (off >> 2) + weight_e + q, tl.where(here, wt, 0.0), mask=jm & live)
            if t == 0:
                tl.store(arena_i64 + (off >> 3) + header_e + me, rows_per_src.to(tl.int64))
                tl.store(arena_i64 + (off >> 3) + header_e + ep + me, n_tokens.to(tl.int64))

    # this program's piece of the row, quantised once, to each owning rank
    if FMT == "fp8_g128":
        if tl.sum(known.to(tl.int32), axis=0) > 0:
            _dispatch_groups(x_ptr, stride_x, t, piece, owner, known, ep, arena_u8, arena_f32, peer_off_ptr,
                             rows_b + (me * rows_per_src + t) * row_bytes, status_ptr, layer_id, H, BLOCKS // 4, HW_CVT)
    elif tl.sum(known.to(tl.int32), axis=0) > 0:
        row_at = rows_b + (me * rows_per_src + t) * row_bytes
        col = tl.arange(0, 32)
        blk = piece * BLOCKS + tl.arange(0, BLOCKS)
        bm = blk < H // 32
        x = tl.load(x_ptr + t * stride_x + blk[:, None] * 32 + col[None, :], mask=bm[:, None], other=0.0).to(tl.float32)
        if FMT == "bf16":
            bits = round_bf16(x).to(tl.bfloat16).to(tl.int16, bitcast=True)
        else:
            payload, scales = quantize_blocks(x, FMT, HW_CVT)
            n_nan = tl.sum(((scales == 255) & bm).to(tl.int32), axis=0)
        for r in range(ep):
            if tl.sum((known & (owner == r)).to(tl.int32), axis=0) > 0:
                off = tl.load(peer_off_ptr + r)
                if FMT == "bf16":
                    dst = arena_i16 + ((off + row_at) >> 1) + blk[:, None] * 32 + col[None, :]
                    tl.store(dst, bits, mask=bm[:, None])
                elif FMT == "fp8":
                    dst = arena_u8 + off + row_at + blk[:, None] * 32 + col[None, :]
                    tl.store(dst, payload, mask=bm[:, None])
                    tl.store(arena_u8 + off + row_at + H + blk, scales, mask=bm)
                else:
                    half = tl.arange(0, 16)
                    dst = arena_u8 + off + row_at + blk[:, None] * 16 + half[None, :]
                    tl.store(dst, payload, mask=bm[:, None])
                    tl.store(arena_u8 + off + row_at + H // 2 + blk, scales, mask=bm)
        if FMT != "bf16":
            if n_nan > 0:
                _record(status_ptr, _NAN_ROW, layer_id, t * 0, t)


@triton.jit
def _dispatch_groups(x_ptr, stride_x, t, piece, owner, known, ep, arena_u8, arena_f32, peer_off_ptr, row_at, status_ptr,
                     layer_id, H: tl.constexpr, GROUPS: tl.constexpr, HW_CVT: tl.constexpr):
    """The block-FP8 A format (``fp8_g128``) for a piece of GROUPS x 128 columns (the piece of BLOCKS x 32 columns
    the other formats take, so the grid is the same): e4m3 bytes at the row's columns, the groups' fp32 scales
    after the H payload bytes, by the experts' own group quantiser (quant.quantize_g128: formats.block_fp8
    bit for bit), to each owning rank. The scales' byte offset is a multiple of 4 (the arena's ALIGN, the
    row stride H + H / 32 and H are, since H % 128 == 0), so they are stored as fp32 words."""
    col = tl.arange(0, 128)
    grp = piece * GROUPS + tl.arange(0, GROUPS)
    gm = grp < H // 128
    x = tl.load(x_ptr + t * stride_x + grp[:, None] * 128 + col[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    payload, scales = quantize_g128(x, HW_CVT)
    for r in range(ep):
        if tl.sum((known & (owner == r)).to(tl.int32), axis=0) > 0:
            off = tl.load(peer_off_ptr + r)
            tl.store(arena_u8 + off + row_at + grp[:, None] * 128 + col[None, :], payload, mask=gm[:, None])
            tl.store(arena_f32 + ((off + row_at + H) >> 2) + grp, scales, mask=gm)
    if tl.sum(((scales != scales) & gm).to(tl.int32), axis=0) > 0:  # a group holding NaN / Inf: a NaN scale
        _record(status_ptr, _NAN_ROW, layer_id, t * 0, t)


@triton.jit
def _now(anchor, CLOCK: tl.constexpr):
    if CLOCK == "globaltimer":  # ns since an arbitrary origin, the same for every SM
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [anchor], dtype=tl.int64, is_pure=False,
                                         pack=1)
    else:
        return anchor * 0


@triton.jit
def _fence_sys(anchor, FENCE: tl.constexpr):
    """``fence.acq_rel.sys`` on the GPU, returning ``anchor`` so what uses the result comes after it.
    Before relaxed flag stores it makes them the PTX release pattern; after relaxed flag polls, the
    acquire pattern. The interpreter runs every load and store in order: nothing to fence there."""
    if FENCE:
        return tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.b64 $0, $1;", "=l,l", [anchor], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return anchor


@triton.jit
def _barrier_kernel(
    arena_i64, peer_off_ptr, ep, me, flags_e, header_e, rows_per_src, epoch_ptr, phase, budget,
    status_ptr, layer_id, EP_PAD: tl.constexpr, CHECK_ROWS: tl.constexpr, CLOCK: tl.constexpr, FENCE: tl.constexpr,
    SIGNAL: tl.constexpr = True, WAIT: tl.constexpr = True,
):
    r = tl.arange(0, EP_PAD)
    rm = r < ep
    if SIGNAL:
        epoch = tl.load(epoch_ptr + phase) + 1
        tl.store(epoch_ptr + phase, epoch)
        # one fence, then every peer's flag at once (relaxed, system scope): the release pattern. A release
        # atomic per peer, one after the other, and an acquire per peer and poll in the wait made the four
        # barrier launches of an emulated EP 8 step 19.6 µs busy per rank; these 7.8 (H200,
        # benchmarks/results/h200_barrier_publish_ab.json)
        epoch = _fence_sys(epoch, FENCE)
        off = tl.load(peer_off_ptr + r, mask=rm, other=0) >> 3
        tl.atomic_xchg(arena_i64 + off + flags_e + phase * ep + me, tl.zeros([EP_PAD], tl.int64) + epoch, mask=rm,
                       sem="relaxed", scope="sys")
    else:
        epoch = tl.load(epoch_ptr + phase)  # the epoch this rank's signal launch just stored
    if WAIT:
        _wait(arena_i64, ep, flags_e, header_e, rows_per_src, phase, budget, epoch, status_ptr, layer_id, EP_PAD,
              CHECK_ROWS, CLOCK, FENCE)


@triton.jit
def _wait(arena_i64, ep, flags_e, header_e, rows_per_src, phase, budget, epoch, status_ptr, layer_id,
          EP_PAD: tl.constexpr, CHECK_ROWS: tl.constexpr, CLOCK: tl.constexpr, FENCE: tl.constexpr):
    """Poll every peer's flag at once (relaxed, system scope) until all reached ``epoch`` or the budget
    is spent, then one fence: the acquire pattern. The first peer still behind is the one named."""
    zero = epoch * 0
    if tl.load(status_ptr) == _TIMEOUT:  # an earlier wait of this step timed out: signal, but wait no more
        budget = zero
    s = tl.arange(0, EP_PAD)
    sm = s < ep
    flags = arena_i64 + flags_e + phase * ep + s
    nothing = tl.zeros([EP_PAD], tl.int64)
    seen = tl.where(sm, tl.atomic_add(flags, nothing, mask=sm, sem="relaxed", scope="sys"), epoch)
    start = _now(zero, CLOCK)
    spent = zero
    while (tl.sum((seen < epoch).to(tl.int32), axis=0) > 0) & (spent < budget):
        seen = tl.where(sm, tl.atomic_add(flags, nothing, mask=sm, sem="relaxed", scope="sys"), epoch)
        if CLOCK == "globaltimer":
            spent = _now(zero, CLOCK) - start
        else:
            spent += 1
    behind = seen < epoch
    _fence_sys(epoch, FENCE)  # after the polls: the acquire pattern (what follows reads the peers' writes)
    if tl.sum(behind.to(tl.int32), axis=0) > 0:
        _record(status_ptr, _TIMEOUT, layer_id, tl.min(tl.where(behind, s, EP_PAD), axis=0), phase)
    elif CHECK_ROWS:
        rows = tl.load(arena_i64 + header_e + s, mask=sm, other=0, volatile=True)
        wrong = sm & (rows != rows_per_src)
        if tl.sum(wrong.to(tl.int32), axis=0) > 0:
            first = tl.min(tl.where(wrong, s, EP_PAD), axis=0)
            _record(status_ptr, _MISMATCH, layer_id, tl.sum(tl.where(s == first, rows, 0), axis=0), first + zero)


def blocks_per_program(tokens: int, hidden: int, widths: tuple[int, ...] = PIECE_BLOCKS) -> int:
    """The widest piece of ``widths`` (PIECE_BLOCKS, narrowest first) that still launches MIN_PROGRAMS
    programs for ``tokens`` rows of ``hidden`` (the narrowest when none does: a decode step spreads its
    few rows over the SMs; a probe passes other widths, or a width straight to ``dispatch(blocks=)``).
    A function of the host's token count, so one CUDA graph always replays one width. Measured on
    an H200 (benchmarks/research/dispatch_pieces_ab.py, EP 8 / 2, fp8 / fp4 wire): 8 blocks is the
    fastest or within 0.2 µs up to 32 tokens; from 128 tokens on, 32 blocks is the fastest width that
    compiles without spilling (10.7 -> 6.1 µs at 128 tokens, 545 -> 230 µs at 8192, EP 8, fp8). 64 blocks on 4 warps was faster at prefill sizes
    (184 µs) but spilled on the bf16 wire (sm_90a); on 8 warps it was slower than 32 (278 µs)."""
    blocks = hidden // 32
    wide_enough = [b for b in widths if tokens * triton.cdiv(blocks, b) >= MIN_PROGRAMS]
    return wide_enough[-1] if wide_enough else widths[0]


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, owner: torch.Tensor, slot: torch.Tensor,
             rows_per_src: int, arena, fmt: str, hidden: int, pair_live: torch.Tensor, status_word: torch.Tensor,
             layer_id: int, blocks: int | None = None) -> None:
    """Launch the dispatch (module docstring); ``fmt``: the rows' format on the wire (bf16 | fp8 | fp4 MX |
    fp8_g128, the block-FP8 A format: WireFormat.mx); ``blocks``: 32-element blocks per program (default
    :func:`blocks_per_program`; a power of two; fp8_g128 takes them as blocks / 4 groups of 128, so at least 4)."""
    t, k = topk_ids.shape
    blocks = blocks or blocks_per_program(t, hidden)
    if blocks & (blocks - 1):
        raise ValueError(f"dispatch blocks per program must be a power of two, got {blocks}")
    if fmt == "fp8_g128" and (blocks < 4 or hidden % 128):
        raise ValueError(f"fp8_g128 dispatch needs hidden % 128 == 0 and >= 4 blocks (one 128 group) per program, "
                         f"got hidden={hidden}, blocks={blocks}")
    lay = arena.layout
    local = arena.local
    _dispatch_kernel[(max(t, 1), triton.cdiv(hidden // 32, blocks) if t else 1)](
        x, x.stride(0) if t else hidden, topk_ids, topk_weights, owner, slot, owner.shape[0], t, rows_per_src,
        arena.ep, arena.rank, local, arena.as_i16, arena.as_i64, arena.as_f32,
        arena.peer_offsets, lay.header // 8, lay.recv_rows, lay.row_bytes, lay.recv_slot // 8, lay.recv_weight // 4,
        pair_live, status_word, layer_id,
        H=hidden, K=k, K_PAD=triton.next_power_of_2(k), FMT=fmt, BLOCKS=blocks,
        HW_CVT=x.is_cuda and not interpreting(), num_warps=4,
    )


def barrier(arena, epochs: torch.Tensor, phase: int, budget: int, rows_per_src: int, status_word: torch.Tensor,
            layer_id: int, signal: bool = True, wait: bool = True) -> None:
    """Meet every peer at ``phase`` (0: rows dispatched, 1: combine rows written); bounded by ``budget``
    (ns of the global timer on the GPU, spins in the interpreter: :func:`wait_budget`). ``signal`` /
    ``wait``: one half only (the one-process emulator launches every rank's signal, then the waits)."""
    lay = arena.layout
    _barrier_kernel[(1,)](
        arena.as_i64, arena.peer_offsets, arena.ep, arena.rank, lay.flags // 8, lay.header // 8,
        rows_per_src, epochs, phase, budget, status_word, layer_id, EP_PAD=triton.next_power_of_2(arena.ep),
        CHECK_ROWS=phase == 0, CLOCK=_clock(), FENCE=not interpreting(), SIGNAL=signal, WAIT=wait, num_warps=1,
    )


def _clock() -> str:
    return "spins" if interpreting() else "globaltimer"


def wait_budget(timeout_s: float, device: torch.device) -> int:
    """MEGA_P2P_TIMEOUT_S as the barrier's budget: ns of the global timer, or interpreter spins."""
    if _clock() == "globaltimer":
        return int(timeout_s * 1e9)
    return max(1, int(timeout_s * spins_per_second(device)))


_SPIN_RATE: dict[str, float] = {}  # documented cache: the interpreter's spin rate, measured once per process


def spins_per_second(device: torch.device) -> float:
    """How many barrier spins the interpreter runs per second here (a barrier that waits on a flag
    nobody sets, for a fixed spin count, timed)."""
    key = str(device)
    if key not in _SPIN_RATE:
        # two "ranks" in one tensor: rank 1 never signals, so rank 0 spins the whole budget
        arena = torch.zeros(64, dtype=torch.int64, device=device)
        offsets = torch.tensor([0, 32 * 8], dtype=torch.int64, device=device)
        epochs = torch.full((2,), 1 << 40, dtype=torch.int64, device=device)  # a flag of 0 never reaches it
        word = torch.zeros(4, dtype=torch.int64, device=device)
        spins = 400
        start = time.perf_counter()
        _barrier_kernel[(1,)](arena, offsets, 2, 0, 8, 16, 0, epochs, 0, spins, word, 0,
                              EP_PAD=2, CHECK_ROWS=False, CLOCK=_clock(), FENCE=False, num_warps=1)
        _SPIN_RATE[key] = spins / max(time.perf_counter() - start, 1e-6)
    return _SPIN_RATE[key]
