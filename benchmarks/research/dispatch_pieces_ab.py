"""The P2P dispatch alone at each piece width, per EP size and token count (H200).

Why: the dispatch launches one program per (token, piece of BLOCKS x 32 columns); 8 blocks suits a
decode step (few rows over many SMs) but gives 229,376 programs at 8192 tokens, and the emulated
bench put it at 592 µs there (EP 8) against ~90 µs of HBM traffic. This times one rank's dispatch
(rank 0 of ``--ep`` emulated arenas in one allocation, uniform top-6 routing over 384 experts) at
every width of ``--blocks``, each in a CUDA graph of ``--reps`` launches, best of ``--rounds``
interleaved rounds, and checks that every width leaves the same bytes in every rank's arena as 8
(rows, scales, slot / weight entries, header). Also printed: the width ``blocks_per_program`` picks
and the HBM floor of the bytes moved (the row read once, each owning rank's row written, metadata)
at the copy rate measured in the same run (a device-to-device copy of 1 GiB). An A/B of one
kernel's launch shape: no naive-torch baseline (the layer bench has one).

    PYTHONPATH=. python3 benchmarks/research/dispatch_pieces_ab.py --json dispatch_pieces_ab.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from megamoe_backend.formats.wire import combine_wire, dispatch_wire
from megamoe_backend.layer.device import p2p
from megamoe_backend.transport.peer_arena import ArenaLayout, PeerArena

HIDDEN, TOPK, EXPERTS = 7168, 6, 384


def arenas(ep: int, tokens: int, fmt: str, device) -> list[PeerArena]:
    lay = ArenaLayout.build(ep, max(tokens, 1), TOPK, dispatch_wire(fmt).row_bytes(HIDDEN), combine_wire("bf16").row_bytes(HIDDEN))
    whole = torch.zeros(ep * lay.total, dtype=torch.uint8, device=device)
    parts = [whole[r * lay.total:(r + 1) * lay.total] for r in range(ep)]
    return [PeerArena(lay, r, parts[r], parts) for r in range(ep)]


def copy_rate(device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted), best of 5."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e-3)
    return 2 * src.numel() / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", type=int, nargs="+", default=[8, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128, 512, 2048, 8192])
    ap.add_argument("--formats", nargs="+", default=["fp8", "fp4"])
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="dispatch_pieces_ab.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rate = copy_rate(dev)
    rows = []
    for ep in args.ep:
        local = EXPERTS // ep
        owner = torch.arange(EXPERTS, device=dev) // local
        slot = torch.arange(EXPERTS, device=dev) % local
        for t in args.tokens:
            g = torch.Generator(device=dev).manual_seed(t)
            x = torch.randn(t, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
            ids = torch.rand(t, EXPERTS, generator=g, device=dev).topk(TOPK, dim=1).indices
            w = torch.rand(t, TOPK, generator=g, device=dev)
            owners_per_token = float((torch.nn.functional.one_hot(owner[ids], ep).sum(1) > 0).sum(1).float().mean())
            for fmt in args.formats:
                ar = arenas(ep, t, fmt, dev)
                lay = ar[0].layout
                moved = t * HIDDEN * 2 + t * owners_per_token * lay.row_bytes + t * ep * TOPK * 12
                pair_live = torch.empty(max(t, 1) * TOPK, dtype=torch.int64, device=dev)
                word = torch.zeros(4, dtype=torch.int64, device=dev)

                def launch(b):
                    p2p.dispatch(x, ids, w, owner, slot, t, ar[0], fmt, HIDDEN, pair_live, word, 0, blocks=b)

                snapshots, graphs = {}, {}
                for b in args.blocks:
                    for a in ar:
                        a.local.zero_()
                    launch(b)
                    torch.cuda.synchronize()
                    snapshots[b] = torch.cat([a.local for a in ar]).clone()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(args.reps):
                            launch(b)
                    graphs[b] = graph
                same = {b: bool(torch.equal(snapshots[b], snapshots[args.blocks[0]])) for b in args.blocks}
                best = {b: float("inf") for b in args.blocks}
                for _ in range(args.rounds):
                    for b in args.blocks:
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        graphs[b].replay()
                        s.record()
                        graphs[b].replay()
                        e.record()
                        torch.cuda.synchronize()
                        best[b] = min(best[b], s.elapsed_time(e) * 1e3 / args.reps)
                row = dict(ep=ep, tokens=t, fmt=fmt, us={str(b): round(best[b], 2) for b in args.blocks},
                           same_bytes_as_first=same, picked=p2p.blocks_per_program(t, HIDDEN),
                           owners_per_token=round(owners_per_token, 3), bytes_moved=int(moved),
                           floor_us=round(moved / rate * 1e6, 2), status_word=word.tolist())
                rows.append(row)
                print(json.dumps(row), flush=True)
                del graphs, snapshots, ar
                torch.cuda.empty_cache()
    meta = dict(command=" ".join(sys.argv), torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                copy_rate_bytes_per_s=rate, what=__doc__.split("\n\n")[0])
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    bad = [r for r in rows if not all(r["same_bytes_as_first"].values()) or any(r["status_word"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
