"""The watchdog on a GPU (layer/device/watchdog.py): what graph replays hide reaches the log.

Two rank processes on ONE CUDA GPU over IPC arenas, each replaying a captured forward (no Python
runs in the layer during a replay, so only the watchdog can see what its status word records):
- a peer dead before the survivor's next replay: the survivor logs (layer, this rank, the peer,
  the barrier) and ends with the watchdog's exit status within MEGA_P2P_TIMEOUT_S + 2 s
  (MEGA_ON_PEER_TIMEOUT=exit, the default);
- a peer SIGKILLed while both ranks replay in a loop with many replays queued on the GPU
  (``replay_kill``): the kill lands inside replays, not between them. The parent kills when both
  ranks' queues hold >= MIN_QUEUED replays; each rank counts, through a counter the graph itself
  bumps into pinned memory, the replays the GPU finished, and publishes enqueued / finished /
  its longest stall on a shared board. Shown: both queues held >= MIN_QUEUED replays at the kill;
  the survivor's replay S + 1 (S: finished when it stalled) waited out the timeout once, and the
  peer had enqueued S + 1 and more before it died (its GPU work ended inside its queue, with
  S + 1 unfinished); the survivor's counter moved on after the kill; it logs the layer, itself,
  the peer and the barrier and exits 70 within MEGA_P2P_TIMEOUT_S + 2 s of the kill; with
  MEGA_ON_PEER_TIMEOUT=raise the watchdog logs it once, the process lives, and its next eager
  forward (and the one after) raises PeerTimeoutError at once;
- a bad expert id written into a replayed graph's input on one rank: one ERROR line within 1 s
  naming topk_ids, the value and the token; every other token's output unchanged (the whole output
  equals an eager forward with that entry masked); nothing logged on the other rank; the eager
  forward after it raises nothing (reported once); a later bad replay is counted again (the word
  was cleared inside the graph) without a second line (rate limit).
No rank can hang the run: the parent bounds every wait and kills what is left. Skips without
CUDA. CPU: tests/core/test_watchdog.py (fake status words), tests/kernels/test_watchdog_interpreter.py
(the clear kernel, a device forward).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
import traceback

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (tests/core/test_watchdog.py covers the watchdog on CPU)", allow_module_level=True)
pytest.importorskip("triton")

from test_gpu_ep import GRAPH_CASE, T, all_weights, ep_layer, routing  # noqa: E402

from megamoe_backend.layer.device.process_end import EXIT_STATUS  # noqa: E402
from megamoe_backend.layer.device.watchdog import process_watchdog  # noqa: E402
from megamoe_backend.parallel.spawn import free_port, spawn_ranks  # noqa: E402

TIMEOUT_S = 3.0
# the replay_kill tests' shared board: SLOTS doubles per rank (written by that rank only), then KILLED (the parent)
LOOP, ENQ, DONE, HOT, START, GAP_S, GAP_FROM, GAP_TO, GAP_DONE = range(9)
SLOTS = 9
KILLED = 2 * SLOTS
# replays a rank keeps enqueued ahead of the GPU: the survivor a few dozen (its host never blocks in a launch);
# the peer as many as the launch queue takes, so its queue outlasts its context's teardown after the SIGKILL
# (the GPU runs a killed process's work until the driver tears it down) and its GPU work ends inside a replay
DEPTH = (48, 1024)
MIN_QUEUED = 8  # the parent kills once both ranks have at least this many replays enqueued and unfinished
WARM = 20  # replays finished in the loop before a rank calls itself hot
POLL_S = 0.0005
LOOP_S = 240.0  # a rank's own backstop: its loop ends by itself if nobody killed it (the parent died)
TIMEOUT_LINE = re.compile(r"layer 7: ep_rank 0 waited more than MEGA_P2P_TIMEOUT_S=3s for ep_rank 1 at the "
                          r"(dispatch \(its token rows\)|combine \(its expert rows\)) barrier")


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


class _ReplayCounter:
    """Replays the GPU has finished, readable on the host without a sync: the graph bumps a device
    counter after the forward and copies it into pinned memory (as status.py ``publish`` copies
    the status word), so the host sees how far the GPU is while replays are still queued."""

    def __init__(self):
        self.device = torch.zeros(1, dtype=torch.int64, device="cuda")
        self.host = torch.zeros(1, dtype=torch.int64, pin_memory=True)

    def bump(self):  # captured into the graph, behind the forward
        self.device.add_(1)
        self.host.copy_(self.device, non_blocking=True)

    def finished(self) -> int:
        return int(self.host[0])


class _ReplayLoop:
    """One rank's replay loop, published live on the shared board (slots ``rank * SLOTS + ...``):
    LOOP once it runs, ENQ replays enqueued, DONE finished (the counter as last seen), HOT once
    WARM replays finished in the loop with >= MIN_QUEUED queued, and the longest stall of DONE:
    GAP_S seconds, from GAP_FROM to GAP_TO (monotonic, system-wide), DONE being GAP_DONE during it."""

    def __init__(self, board, rank: int, counter: _ReplayCounter):
        self.board, self.base, self.counter, self.depth = board, rank * SLOTS, counter, DEPTH[rank]
        self.done = self.enq = counter.finished()
        self.changed = time.monotonic()
        for slot, value in ((START, self.done), (ENQ, self.enq), (DONE, self.done), (LOOP, 1)):
            self._put(slot, value)

    def _put(self, slot: int, value: float) -> None:
        self.board[self.base + slot] = value

    def observe(self) -> int:
        done = self.counter.finished()
        now = time.monotonic()
        if done != self.done:
            gap = now - self.changed
            if gap > self.board[self.base + GAP_S]:
                for slot, value in ((GAP_FROM, self.changed), (GAP_TO, now), (GAP_DONE, self.done), (GAP_S, gap)):
                    self._put(slot, value)
            self.done, self.changed = done, now
            self._put(DONE, done)
        return done

    def run(self, graph, stop) -> bool:
        """Replay, keeping up to ``depth`` replays queued, until ``stop()`` (True) or LOOP_S (False)."""
        deadline = time.monotonic() + LOOP_S
        start = self.done
        while time.monotonic() < deadline:
            done = self.observe()
            if stop():
                return True
            if self.enq - done < self.depth:
                graph.replay()
                self.enq += 1
                self._put(ENQ, self.enq)
                if done - start >= WARM and self.enq - done >= MIN_QUEUED:
                    self._put(HOT, 1)
            else:
                time.sleep(POLL_S)
        return False


def _replay_kill_rank(rank, world, port, folder, board, env):
    """A rank process of the replay_kill tests; any error lands in rank<r>.err (then exit 1)."""
    try:
        _replay_kill_body(rank, world, port, folder, board, env)
    except BaseException:  # noqa: BLE001 - the parent reads it; nothing may keep this process alive
        with open(os.path.join(folder, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    os._exit(1)


def _replay_kill_body(rank, world, port, folder, board, env):
    import datetime

    import torch.distributed as dist

    from megamoe_backend.knobs import Knobs

    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    knobs = Knobs.from_env(env)  # MEGA_DISPATCH=ipc, MEGA_P2P_TIMEOUT_S, MEGA_ON_PEER_TIMEOUT as a user sets them
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    log = logging.getLogger("megamoe")
    log.addHandler(logging.FileHandler(os.path.join(folder, f"rank{rank}.log")))
    lines = _Lines()
    log.addHandler(lines)
    layer = ep_layer(rank, world, *GRAPH_CASE, all_weights(torch.device("cuda")), timeout_s=knobs.p2p_timeout_s,
                     name="layer 7", transport=knobs.transport, on_peer_timeout=knobs.on_peer_timeout)
    xs, ids_s, ws = (t.clone() for t in routing(T, seed=13 + rank))
    layer(xs, ids_s, ws, max_tokens_across_ranks=T)  # compiles
    torch.cuda.synchronize()
    counter = _ReplayCounter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(xs, ids_s, ws, max_tokens_across_ranks=T)
        counter.bump()
    for i in range(3):  # the group replays together, new data each time
        x, ids, w = routing(T, seed=700 + 10 * i + rank)
        xs.copy_(x), ids_s.copy_(ids), ws.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
    layer.raise_if_bad_input()
    dist.barrier()  # both loops start together; no collective after this (the peer will be gone)

    loop = _ReplayLoop(board, rank, counter)
    survivor_raises = rank == 0 and knobs.on_peer_timeout == "raise"
    stopped = loop.run(graph, stop=(lambda: board[KILLED] > 0) if survivor_raises else (lambda: False))
    if not stopped:  # the peer (never killed) or an exit-mode survivor the watchdog did not end
        with open(os.path.join(folder, f"rank{rank}.survived"), "w") as f:
            f.write(f"rank {rank}'s replay loop ran out its {LOOP_S:g}s")
        os._exit(3)

    # MEGA_ON_PEER_TIMEOUT=raise, the survivor: the kill is known; an engine's step ends with a sync
    res = {"stopped_at": time.monotonic(), "queued_at_stop": loop.enq - loop.done}
    drain_until = time.monotonic() + knobs.p2p_timeout_s + 10.0
    while loop.observe() < loop.enq and time.monotonic() < drain_until:  # watched, so the board's stall is exact
        time.sleep(POLL_S)  # the queued replays: one waits out the timeout, the rest skip their waits
    torch.cuda.synchronize()
    res["synced_at"] = time.monotonic()
    loop.observe()
    while not any("MEGA_ON_PEER_TIMEOUT=raise" in m for _, m in lines.lines) and time.monotonic() - res["synced_at"] < 2.0:
        time.sleep(0.01)  # the watchdog's line (two polls of 50 ms) before the eager check clears the word
    res["lines"] = [m for _, m in lines.lines]
    x, ids, w = routing(T, seed=999)
    for key in ("eager", "again"):
        start = time.monotonic()
        try:
            layer(x, ids, w, max_tokens_across_ranks=T)
            torch.cuda.synchronize()
            res[key] = None
        except Exception as exc:  # noqa: BLE001 - the test checks type and text
            res[key] = f"{type(exc).__name__}: {exc}"
        res[f"{key}_s"], res[f"{key}_at"] = time.monotonic() - start, time.monotonic()
    res["context_ok"] = float(torch.ones(4, device="cuda").sum().item()) == 4.0
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump(res, f)
    for handler in log.handlers:
        handler.flush()
    os._exit(0)  # no teardown: gloo's destroy could wait on the dead peer


def _slots(board, rank: int) -> dict:
    names = ("loop", "enq", "done", "hot", "start", "gap_s", "gap_from", "gap_to", "gap_done")
    return {name: board[rank * SLOTS + i] for i, name in enumerate(names)}


def _children_report(folder, procs) -> str:
    parts = [f"exit codes {[p.exitcode for p in procs]}"]
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank"):
            with open(os.path.join(folder, name)) as f:
                parts.append(f"--- {name} ---\n{f.read()[-4000:]}")
    return "\n".join(parts)


def _replay_kill(tmp_path, on_peer_timeout):
    """Start two rank processes, wait until both replay hot with >= MIN_QUEUED queued, SIGKILL rank 1
    inside its replays, and wait (bounded) for rank 0 to end or report. Returns what the checks need;
    every child still alive at the end is killed."""
    import torch.multiprocessing as mp

    ctx, port, world, folder = mp.get_context("spawn"), free_port(), 2, str(tmp_path)
    board = ctx.RawArray("d", world * SLOTS + 1)
    env = {"MEGA_DISPATCH": "ipc", "MEGA_P2P_TIMEOUT_S": f"{TIMEOUT_S:g}", "MEGA_ON_PEER_TIMEOUT": on_peer_timeout}
    procs = [ctx.Process(target=_replay_kill_rank, args=(r, world, port, folder, board, env), daemon=True)
             for r in range(world)]
    survivor, peer = procs
    try:
        for p in procs:
            p.start()
        for slot, limit_s in (("loop", 420), ("hot", 60)):  # spawn, CUDA, compile, capture, warm replays; then hot
            deadline = time.monotonic() + limit_s
            while not all(_slots(board, r)[slot] for r in range(world)):
                assert all(p.exitcode is None for p in procs), f"a rank ended before {slot}\n{_children_report(folder, procs)}"
                assert time.monotonic() < deadline, (f"the ranks' replay loops not {slot} within {limit_s} s: "
                                                     f"{[_slots(board, r) for r in range(world)]}\n{_children_report(folder, procs)}")
                time.sleep(0.005)
        time.sleep(0.5)  # steady: both loops replaying, queues full
        deadline = time.monotonic() + 30
        while True:  # kill at a moment both queues are seen deep (the peer's GPU is inside a replay)
            pre = [_slots(board, r) for r in range(world)]
            if all(s["enq"] - s["done"] >= MIN_QUEUED for s in pre):
                break
            assert all(p.exitcode is None for p in procs), _children_report(folder, procs)
            assert time.monotonic() < deadline, f"queues never held {MIN_QUEUED} replays on both ranks: {pre}"
            time.sleep(POLL_S)
        killed_at = time.monotonic()
        os.kill(peer.pid, signal.SIGKILL)
        board[KILLED] = 1
        until = killed_at + TIMEOUT_S + 60  # the survivor's exit is checked against TIMEOUT_S + 2 below
        while survivor.exitcode is None and time.monotonic() < until:  # (exitcode polls waitpid: no join to wait on)
            time.sleep(0.002)
        ended_at = time.monotonic()
        peer.join(timeout=30)
        ended = survivor.exitcode is not None
        final = [_slots(board, r) for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(timeout=10)
    report = _children_report(folder, procs)
    log = (tmp_path / "rank0.log").read_text() if (tmp_path / "rank0.log").exists() else ""
    assert ended, f"the survivor did not end or report within {TIMEOUT_S + 60:g}s of the kill (a hang)\n{report}"
    assert peer.exitcode == -signal.SIGKILL, report
    return {"killed_at": killed_at, "ended_at": ended_at, "pre": pre, "final": final, "exitcode": survivor.exitcode,
            "report": report, "log": log}


def _evidence(run) -> dict:
    """What the board shows about the kill (printed: -s shows it), S being the survivor's finished
    replays while its replay S + 1 waited."""
    (s_pre, p_pre), (s_end, p_end) = run["pre"], run["final"]
    k, stalled = run["killed_at"], int(s_end["gap_done"])
    evidence = {
        "survivor queued at kill": s_pre["enq"] - s_pre["done"], "peer queued at kill": p_pre["enq"] - p_pre["done"],
        "survivor enq/done at kill": (s_pre["enq"], s_pre["done"]), "peer enq/done at kill": (p_pre["enq"], p_pre["done"]),
        "peer enq at death": p_end["enq"], "survivor stalled at done": stalled,
        "survivor replays finished after the kill (peer's context not yet gone)": stalled - s_pre["done"],
        "survivor done at end": s_end["done"], "stall s": round(s_end["gap_s"], 3),
        "stall from kill s": round(s_end["gap_from"] - k, 3), "stall to kill s": round(s_end["gap_to"] - k, 3),
        "survivor end after kill s": round(run["ended_at"] - k, 3),
        "barrier": (TIMEOUT_LINE.search(run["log"]) or [None, None])[1],
    }
    print(f"replay_kill evidence: {evidence}")
    return evidence


def _check_killed_inside_replays(run, evidence) -> None:
    """The kill landed inside replays (on both ranks), not between them."""
    (s_pre, p_pre), (s_end, p_end) = run["pre"], run["final"]
    k, stalled = run["killed_at"], int(s_end["gap_done"])
    # both loops were running hot: the survivor finished WARM replays with the peer before the kill
    assert s_pre["done"] - s_pre["start"] >= WARM and p_pre["done"] - p_pre["start"] >= WARM, evidence
    # at the kill both ranks had >= MIN_QUEUED replays enqueued and unfinished as their hosts last saw them
    # (done lags the GPU by about one loop turn): both streams were busy with replays
    assert evidence["survivor queued at kill"] >= MIN_QUEUED and evidence["peer queued at kill"] >= MIN_QUEUED, evidence
    # the survivor's replay S + 1 waited out MEGA_P2P_TIMEOUT_S (one timeout, not one per queued replay)
    # and the stall spans the kill
    assert TIMEOUT_S - 0.5 < s_end["gap_s"] < TIMEOUT_S + 1.5, evidence
    assert k - 1.0 < s_end["gap_from"] < k + 1.5 and s_end["gap_to"] > k + TIMEOUT_S - 1.0, evidence
    # the peer had enqueued replay S + 1 and more before it died (every enqueue precedes its death): its GPU
    # work ended with replay S + 1 unfinished (it never reached that replay's barrier), not after its last one
    assert p_end["enq"] >= stalled + 2, evidence
    # the survivor's counter advanced after the kill: its in-flight replays ran to their end
    assert s_end["done"] >= stalled + 1 and s_end["done"] > s_pre["done"], evidence


def test_replay_kill_ends_the_survivor_within_the_timeout(tmp_path):
    """MEGA_ON_PEER_TIMEOUT=exit (the default): the peer SIGKILLed inside its replays; the survivor,
    replaying in a loop, is ended by its watchdog with exit status 70 within MEGA_P2P_TIMEOUT_S + 2 s."""
    run = _replay_kill(tmp_path, "exit")
    evidence, report = _evidence(run), run["report"]
    assert run["exitcode"] == EXIT_STATUS, report
    assert TIMEOUT_S - 1.0 < run["ended_at"] - run["killed_at"] < TIMEOUT_S + 2.0, evidence
    assert TIMEOUT_LINE.search(run["log"]), run["log"]  # the layer, this rank, the peer, the barrier
    assert f"Ending this process (exit status {EXIT_STATUS}" in run["log"], run["log"]
    _check_killed_inside_replays(run, evidence)


def test_replay_kill_with_raise_raises_at_the_next_eager_forward(tmp_path):
    """MEGA_ON_PEER_TIMEOUT=raise: the same kill; the survivor is not ended, the watchdog logs the
    timeout once, and the next eager forward (after the step's sync) raises PeerTimeoutError at once,
    as does the one after it; the GPU context works."""
    run = _replay_kill(tmp_path, "raise")
    evidence, report, k = _evidence(run), run["report"], run["killed_at"]
    assert run["exitcode"] == 0 and (tmp_path / "result.json").exists(), report
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["stopped_at"] - k < 1.0 and res["queued_at_stop"] >= 1, (res, evidence)  # stopped with replays queued
    assert res["synced_at"] - k < TIMEOUT_S + 2.0, (res, evidence)  # the queued replays ended: no hang
    logged = [m for m in res["lines"] if "MEGA_ON_PEER_TIMEOUT=raise" in m]
    assert len(logged) == 1 and TIMEOUT_LINE.search(logged[0]), res["lines"]
    assert res["eager"] is not None and res["eager"].startswith("PeerTimeoutError") and TIMEOUT_LINE.search(res["eager"]), res
    assert res["eager_s"] < 1.0 and res["eager_at"] - k < TIMEOUT_S + 2.0 + 2.0, res  # at once (+ the wait for the line)
    assert res["again"] is not None and res["again"].startswith("PeerTimeoutError") and res["again_s"] < 1.0, res
    assert res["context_ok"], res
    assert "Ending this process" not in run["log"], run["log"]
    _check_killed_inside_replays(run, evidence)
