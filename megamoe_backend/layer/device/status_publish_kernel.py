"""The CUDA form of ``InputStatus.publish``: ack in, the clear of a reported problem (the rule of
status.clear_reported), the words out to the host copy, in one capturable program.

Why one launch for the publish: as two copies around the clear it was three graph nodes at the end
of every forward, about 11 µs per layer with the gaps between them; the one kernel takes 2.0 µs
busy + 0.4 µs of gap (emulated EP 8, 8 and 128 tokens per rank, H200, same call:
benchmarks/results/h200_barrier_publish_ab.json). It reads ``ack`` from, and writes the words to,
pinned host memory directly (mapped into the device's address space), so the two copies go."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def publish_kernel(words_ptr, ack_host_ptr, host_ptr, WORDS: tl.constexpr, PAD: tl.constexpr):
    """words (device, int64 [WORDS + 2]: code.., seq, ack) <- ack from the host; clear the reported
    problem (status.clear_reported's rule); the words -> the host copy."""
    i = tl.arange(0, PAD)
    n = i < WORDS + 2
    ack = tl.load(ack_host_ptr, volatile=True)  # the reporter's host write: never a cached value
    seq = tl.load(words_ptr + WORDS)
    w = tl.load(words_ptr + i, mask=n, other=0)
    tl.debug_barrier()  # every thread has read the words before any writes them
    reported = seq == ack
    w = tl.where(reported & (i < WORDS), 0, w)
    w = tl.where(i == WORDS, tl.where(reported, seq + 1, seq), w)
    w = tl.where(i == WORDS + 1, ack, w)
    tl.store(words_ptr + i, w, mask=n)
    tl.store(host_ptr + i, w, mask=n)
