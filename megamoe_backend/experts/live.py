"""What the experts learn from the device alone: which received rows are live, where each row goes.

Why: the device P2P forward receives into a fixed region of ``ep x rows_per_source`` rows, sized
once (MEGA_MAX_TOKENS_PER_RANK, or the engine's DP-padded bound), but a decode step fills a few of
them. The host cannot know how many without a synchronisation, so the numbers stay on the device
and the experts' kernels read them: every grid is a fixed (capturable) number of programs that
loop over the live work only, so a forward costs what its live rows cost whatever the region's size.

``LiveRows``   received row r = s * seg_rows + t is live iff t < counts[s] (segment s = one source
               rank's region, counts[s] = the tokens that rank sent this step, written by the sender
               into this rank's arena header). Pairs are in row-major order: pair q reads row
               q // k, so pair liveness follows. ``config_pairs``: the pair count the tile config is
               chosen for on the host (from the engine's bound); None: no bound was passed, and the
               config is picked on the device from the live pair count among a few candidates.
``SegmentDest`` where GEMM2 writes pair q's combine row: byte ``base[q // seg_pairs] + (q %
               seg_pairs) * row_bytes`` from the output base (the source rank's combine region): the
               destination table as an affine map per segment, so nothing is written per pair to
               build it. The experts know segments, never ranks. ``align``: what the bases and the
               row stride are multiples of, so GEMM2 can store whole 16-byte vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LiveRows:
    counts: torch.Tensor  # int64 [n_seg] on the device: live rows at the head of each segment
    seg_rows: int  # rows per segment of the received region
    config_pairs: int | None = None  # pairs the tile config is sized for (host); None: chosen on the device

    @property
    def segments(self) -> int:
        return self.counts.shape[0]


@dataclass(frozen=True)
class SegmentDest:
    base: torch.Tensor  # int64 [n_seg]: byte offset (from the output base) of segment s's first row
    seg_pairs: int  # pairs per segment
    row_bytes: int  # bytes between consecutive pairs' rows of a segment
    # bytes every base and row_bytes are a multiple of (a power of two): the caller's promise, since the
    # bases are on the device (the P2P forward's combine regions start on the arena's ALIGN). GEMM2 then
    # stores 16-byte vectors instead of one element per 64-bit address (gemm2._row_offsets)
    align: int = 1
