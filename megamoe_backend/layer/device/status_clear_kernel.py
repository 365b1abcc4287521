"""The CUDA form of status.clear_reported: one program, capturable (status.py has the rule)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def clear_reported_kernel(words_ptr, WORDS: tl.constexpr):
    seq = tl.load(words_ptr + WORDS)
    ack = tl.load(words_ptr + WORDS + 1)
    if seq == ack:
        i = tl.arange(0, WORDS)
        tl.store(words_ptr + i, tl.zeros([WORDS], dtype=tl.int64))
        tl.store(words_ptr + WORDS, seq + 1)
