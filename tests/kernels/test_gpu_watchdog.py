"""The watchdog on a GPU (layer/device/watchdog.py): what graph replays hide reaches the log.

Two rank processes on ONE CUDA GPU over IPC arenas, each replaying a captured forward (no Python
runs in the layer during a replay, so only the watchdog can see what its status word records):
- a peer killed while the survivor replays: the survivor logs (layer, this rank, the peer, the
  barrier) and ends with the watchdog's exit status within MEGA_P2P_TIMEOUT_S + 2 s
  (MEGA_ON_PEER_TIMEOUT=exit, the default);
- a bad expert id written into a replayed graph's input on one rank: one ERROR line within 1 s
  naming topk_ids, the value and the token; every other token's output unchanged (the whole output
  equals an eager forward with that entry masked); nothing logged on the other rank; the eager
  forward after it raises nothing (reported once); a later bad replay is counted again (the word
  was cleared inside the graph) without a second line (rate limit).
Skips without CUDA. CPU: tests/core/test_watchdog.py (fake status words),
tests/kernels/test_watchdog_interpreter.py (the clear kernel, a device forward).
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (tests/core/test_watchdog.py covers the watchdog on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from test_gpu_ep import GRAPH_CASE, T, all_weights, ep_layer, routing  # noqa: E402

from megamoe_backend.layer.device.watchdog import EXIT_STATUS, process_watchdog  # noqa: E402
from megamoe_backend.parallel.spawn import free_port, spawn_ranks  # noqa: E402

TIMEOUT_S = 3.0


class _Lines(logging.Handler):
    """ERROR lines of the 'megamoe' logger with the monotonic time they were emitted."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record):
        self.lines.append((time.monotonic(), record.getMessage()))


def _captured(layer, rank, seed):
    """Static inputs, one eager warm-up forward (compiles), and the forward captured on them."""
    xs, ids_s, ws = (t.clone() for t in routing(T, seed=seed + rank))
    layer(xs, ids_s, ws, max_tokens_across_ranks=T)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = layer(xs, ids_s, ws, max_tokens_across_ranks=T)
    return graph, (xs, ids_s, ws), out_s


def _bad_id_worker(rank, world):
    torch.cuda.set_device(0)
    lines = _Lines()
    logging.getLogger("megamoe").addHandler(lines)
    layer = ep_layer(rank, world, *GRAPH_CASE, all_weights(torch.device("cuda")), name="graph layer")
    graph, (xs, ids_s, ws), out_s = _captured(layer, rank, seed=7)
    x, ids, w = routing(T, seed=500 + rank, masked=0.0)
    xs.copy_(x), ids_s.copy_(ids), ws.copy_(w)
    graph.replay()
    torch.cuda.synchronize()
    clean = out_s.clone()

    if rank == 0:
        ids_s[3, 1] = 999  # into the graph's input: the replay's route check records it, no Python sees it
    start = time.monotonic()
    graph.replay()
    while not lines.lines and time.monotonic() - start < 1.0:
        time.sleep(0.01)
    seen_s = lines.lines[0][0] - start if lines.lines else None
    torch.cuda.synchronize()
    bad = out_s.clone()
    masked = ids.clone()
    if rank == 0:
        masked[3, 1] = -1
    eager = layer(x, masked, w, max_tokens_across_ranks=T)  # its eager check: reported already, no raise
    torch.cuda.synchronize()
    res = {"seen_s": seen_s, "bad_equals_masked_eager": torch.equal(bad, eager),
           "others_unchanged": torch.equal(torch.cat([bad[:3], bad[4:]]), torch.cat([clean[:3], clean[4:]]))}

    ids_s.copy_(ids)  # a clean replay: nothing new
    graph.replay()
    torch.cuda.synchronize()
    time.sleep(0.3)
    res["after_clean"] = process_watchdog().counts.get(("graph layer", "bad_expert_id"), 0)
    if rank == 0:
        ids_s[5, 0] = -9
    graph.replay()
    torch.cuda.synchronize()
    deadline = time.monotonic() + 1.0  # rank 0 waits for its second report; rank 1 for anything, which must not come
    while time.monotonic() < deadline and process_watchdog().counts.get(("graph layer", "bad_expert_id"), 0) < 2:
        time.sleep(0.01)
    res["count"] = process_watchdog().counts.get(("graph layer", "bad_expert_id"), 0)
    res["lines"] = [m for _, m in lines.lines]
    return res


def test_a_bad_id_in_a_replayed_graph_is_logged_once_within_a_second():
    results = spawn_ranks(2, _bad_id_worker, backend="gloo", timeout_s=900, pg_timeout_s=300)
    first, other = results
    assert first["seen_s"] is not None and first["seen_s"] < 1.0, first
    assert len(first["lines"]) == 1, first["lines"]  # the second bad replay: counted, folded by the rate limit
    assert "graph layer: topk_ids holds 999 at token 3" in first["lines"][0]
    assert first["bad_equals_masked_eager"] and first["others_unchanged"], first
    assert first["after_clean"] == 1 and first["count"] == 2, first  # cleared inside the graph, seen again
    assert other["lines"] == [] and other["count"] == 0 and other["seen_s"] is None, other
    assert other["bad_equals_masked_eager"] and other["others_unchanged"], other


def _dead_peer_rank(rank, world, port, folder):
    """One rank process of the dead-peer test: the survivor must be ended by its watchdog."""
    import datetime

    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    log = logging.getLogger("megamoe")
    log.addHandler(logging.FileHandler(os.path.join(folder, f"rank{rank}.log")))
    layer = ep_layer(rank, world, *GRAPH_CASE, all_weights(torch.device("cuda")), timeout_s=TIMEOUT_S, name="layer 7")
    graph, (xs, ids_s, ws), _ = _captured(layer, rank, seed=11)
    for i in range(3):  # the group replays together
        x, ids, w = routing(T, seed=900 + 10 * i + rank)
        xs.copy_(x), ids_s.copy_(ids), ws.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        os._exit(0)  # dies without a word
    time.sleep(1.0)
    with open(os.path.join(folder, "replay_at"), "w") as f:
        f.write(repr(time.time()))
    graph.replay()  # waits MEGA_P2P_TIMEOUT_S in its dispatch barrier, records the timeout, finishes
    torch.cuda.synchronize()
    time.sleep(60)  # the watchdog ends the process long before
    with open(os.path.join(folder, "survived"), "w") as f:
        f.write("the watchdog did not end this process")


def test_a_killed_peer_ends_the_survivor_within_the_timeout(tmp_path):
    import torch.multiprocessing as mp

    ctx, port, world = mp.get_context("spawn"), free_port(), 2
    procs = [ctx.Process(target=_dead_peer_rank, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    survivor = procs[0]
    deadline = time.monotonic() + 600
    while survivor.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    ended_at = time.time()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    log = (tmp_path / "rank0.log").read_text()
    assert survivor.exitcode == EXIT_STATUS, (survivor.exitcode, log)
    assert not (tmp_path / "survived").exists()
    elapsed = ended_at - float((tmp_path / "replay_at").read_text())
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + 2.0, elapsed
    assert "layer 7: ep_rank 0 waited more than MEGA_P2P_TIMEOUT_S=3s for ep_rank 1 at the dispatch (its token rows) barrier" in log
    assert f"Ending this process (exit status {EXIT_STATUS}" in log
