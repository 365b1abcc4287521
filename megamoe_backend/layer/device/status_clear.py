"""Clear a reported problem from the status word, in stream order (status.py says why and when).

The rule, on the int64 [6] words (code, layer, value, row, seq, ack): if seq == ack, the host
reported this problem: zero the first four words and bump seq, so the next problem recorded is a
new one (another seq). If the word was already cleared (seq moved on) nothing happens; ack is only
ever a seq the host saw with a problem, so a clean word is never touched.

On CUDA one Triton program does it (one graph node per forward, beside the two copies); on CPU
(the interpreter tests' forwards, fake status words) plain tensor ops do the same on host memory.
"""

from __future__ import annotations

import torch

from .status import ACK, SEQ, WORDS


def clear_reported(words: torch.Tensor) -> None:
    if words.is_cuda:
        from .status_clear_kernel import clear_reported_kernel

        clear_reported_kernel[(1,)](words, WORDS=WORDS, num_warps=1)
        return
    if int(words[SEQ]) == int(words[ACK]):
        words[:WORDS].zero_()
        words[SEQ] += 1
