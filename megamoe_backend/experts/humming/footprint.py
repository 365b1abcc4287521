"""The bytes the humming provider's scratch holds at the layer's capacity (``megamoe info``'s memory).

Why a function of its own, beside the provider: ``layer/memory.py`` sizes a layer from its plan on a
machine that may have no GPU, Triton or humming-kernels, so it cannot ask a provider object; and the
figure must be what ``HummingExperts._run`` reserves, or a serving engineer's KV-cache budget is wrong
by gigabytes (tests/experts_humming/test_humming_interpreter.py runs a forward at capacity and checks
the "humming.*" buffers of its scratch against this).

Why it is large: humming's GEMMs index rows by pair, so GEMM1's bf16 gate/up rows, A2 and (where
GEMM2 cannot write the combine rows in place) GEMM2's bf16 rows are held per pair of capacity
(MEGA_MAX_TOKENS_PER_RANK x top-k x ep_size), where the Triton provider holds only A2 per layout row.
GEMM1's and GEMM2's bf16 rows share one buffer (the provider's ``_gate_up_and_gemm2_rows``).
"""

from __future__ import annotations

from ...formats import MX_BLOCK
from ...formats.block_fp8 import FP8_BLOCK


def humming_scratch_bytes(pairs: int, recv_rows: int, hidden: int, inter: int, *, bf16_rows_in: bool,
                          gemm2_in_place: bool, block_fp8: bool = False) -> int:
    """Bytes of the provider's own buffers for ``pairs`` pairs over ``recv_rows`` received rows.

    ``bf16_rows_in``: the received rows are bf16 (MEGA_DISPATCH_WIRE=bf16): quantised on the receiver first (A8W4:
    to MX fp8, then re-scaled; block-FP8: straight into the A operand). ``gemm2_in_place``: GEMM2 writes the
    combine wire rows itself (ep_size 1, bf16 combine wire); else its bf16 rows go through a scratch to the
    finalize kernel. ``block_fp8``: the experts are block-FP8 (A and A2 with one fp32 scale per 1 x 128 group)."""
    if block_fp8:
        per_row = hidden + 4 * (hidden // FP8_BLOCK)  # humming.a8 (e4m3) + humming.a_gs (fp32 group scales)
        per_pair = inter + 4 * (inter // FP8_BLOCK)  # humming.a2 + humming.a2_rs
    else:
        per_row = hidden + 4  # humming.a8 (e4m3) + humming.a_rs (fp32 row scale)
        if bf16_rows_in:
            per_row += hidden + hidden // MX_BLOCK  # humming.a_mx + humming.a_mx_scale
        per_pair = inter + 4  # humming.a2 (e4m3) + humming.a2_rs
    gate_up = 2 * (2 * inter)  # humming.h: GEMM1's bf16 gate/up rows
    # GEMM2's bf16 rows (where it cannot write the combine rows in place) share humming.h's buffer: humming.h_c
    per_pair += gate_up if gemm2_in_place else max(gate_up, 2 * hidden)
    return recv_rows * per_row + pairs * per_pair


__all__ = ["humming_scratch_bytes"]
