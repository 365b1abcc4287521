"""vLLM data-parallel ranks sharing one GPU, EP over them through the plugin (the GPU engine EP test).

Why this shape: the device lends one GPU, and the plugin's ``ipc`` transport is what EP ranks
sharing a GPU run (MEGA_DISPATCH=auto picks it after the EP group's topology gathers). vLLM's
offline SPMD data parallelism (VLLM_DP_RANK / VLLM_DP_SIZE / VLLM_DP_MASTER_*, one engine per
process, the engine core in-process) then runs DP attention + EP MoE, with vLLM's own DP
bookkeeping: the per-step token counts all-reduced across DP ranks (the ``dp_metadata`` the
plugin's token bound reads), and dummy steps on a rank whose requests are done while another's
are not (``LLMEngine`` keeps stepping while any DP rank has work).

Two vLLM defaults cannot hold on one GPU, and are changed in the rank processes only:
- NCCL refuses two ranks on one device ("Duplicate GPU detected"): ``VLLM_DISABLE_PYNCCL=1`` and
  the platform's ``dist_backend`` set to gloo, so vLLM's device groups (the EP group the plugin's
  handshake and topology gather run over) are gloo groups;
- DP padding is synchronised over the CPU group (``disable_nccl_for_dp_synchronization``).

Work per rank (``work_of``): rank 0 generates more tokens than the others, so the others run
vLLM's dummy steps while rank 0 decodes. ``--dp 1 --groups N`` runs every rank's work one after
another in a single ep_size-1 engine: the reference each rank's output must equal.

``--kill-rank R``: the fault test. Every rank builds its engine, prints ``KILL_POINT`` and then
generates in a loop (FULL decode graphs replaying); the launcher SIGKILLs rank R
``--kill-after-s`` seconds after every rank reached that point and times how each survivor ends:
its exit status, the seconds from the kill, and the log lines that say why (``KILL`` line).

Usage: python tests/gpu_engine/serve_dp.py MODEL --dp 2 --graphs eager|full_decode_only [--moe-backend megamoe_ep]
       python tests/gpu_engine/serve_dp.py MODEL --dp 1 --groups 2 ...        (the EP 1 reference)
       python tests/gpu_engine/serve_dp.py MODEL --dp 2 --graphs full_decode_only --moe-backend megamoe_ep --kill-rank 1
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "vllm"))

from engine_run import PROMPTS, score_sequences  # noqa: E402
from serve_one import GRAPH_MODES, engine_kwargs, generate_and_score, prepare_process  # noqa: E402


def work_of(rank: int, groups: int) -> dict:
    """Rank ``rank``'s requests among ``groups`` DP ranks: prompts, their token budget, scored sequences."""
    return {"prompts": PROMPTS[rank::groups], "max_tokens": 12 if rank == 0 else 3,
            "sequences": score_sequences()[rank::groups]}


def run_work(llm, work: dict) -> dict:
    """One generate call for the prompts and one for the sequences (a call holds all of a rank's
    requests, so an idle DP rank keeps stepping inside it while another rank finishes)."""
    out = generate_and_score(llm, work["prompts"], work["max_tokens"], [])
    out["forced"] = generate_and_score(llm, [], 1, work["sequences"])["forced"]
    return out


def rank_main(args) -> None:
    """One DP rank (or, with --dp 1, the EP 1 reference over every group)."""
    probe = prepare_process(args.graphs, args.moe_backend)
    kwargs = engine_kwargs(args.model, args.graphs, args.moe_backend, args.gpu_memory_utilization)
    if args.dp > 1:
        from vllm.platforms import current_platform

        type(current_platform).dist_backend = "gloo"  # module docstring: NCCL refuses two ranks on one GPU
        kwargs.update(enable_expert_parallel=True, disable_nccl_for_dp_synchronization=True)
    from vllm import LLM

    t0 = time.time()
    llm = LLM(**kwargs)
    init_s = time.time() - t0
    if args.kill_rank is not None:
        serve_until_killed(llm, args.rank, args.dp)
    ranks = [args.rank] if args.dp > 1 else list(range(args.groups))
    results = {str(r): run_work(llm, work_of(r, args.dp if args.dp > 1 else args.groups)) for r in ranks}
    print("RESULT " + json.dumps({"rank": args.rank, "dp": args.dp, "results": results,
                                  "op_calls": {"eager": probe.eager, "captured": probe.captured},
                                  "init_s": round(init_s, 1), "total_s": round(time.time() - t0, 1)}), flush=True)
    sys.stderr.flush()
    os._exit(0)


KILL_POINT = "KILL_POINT"  # printed by every rank of the fault test once its engine serves
SERVE_LOOP_S = 150.0  # how long a rank of the fault test generates before it gives up waiting to be ended


def serve_until_killed(llm, rank: int, dp: int) -> None:
    """The fault test's rank: generate in a loop (graph replays, EP forwards every step) until the
    launcher kills a peer and this rank ends. A rank still serving after SERVE_LOOP_S says so
    (``SURVIVED_LOOP``): the dead peer went unnoticed, which the check fails."""
    from vllm import SamplingParams

    work = work_of(rank, dp)
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    print(KILL_POINT, flush=True)
    end, rounds = time.time() + SERVE_LOOP_S, 0
    while time.time() < end:
        llm.generate(work["prompts"], sp, use_tqdm=False)
        rounds += 1
    print("SURVIVED_LOOP " + json.dumps({"rank": rank, "rounds": rounds}), flush=True)
    os._exit(0)


def kill_and_watch(args, procs: list, log_names: list[str]) -> dict:
    """SIGKILL rank ``args.kill_rank`` once every rank printed KILL_POINT (plus ``args.kill_after_s``),
    then wait (bounded by ``args.kill_bound_s``) for the survivors: per rank its exit status, seconds
    from the kill to its exit (None: still running at the bound, then killed) and the log lines
    that name the cause."""
    deadline = time.time() + args.timeout_s
    while time.time() < deadline and not all(KILL_POINT in Path(n).read_text(errors="replace") for n in log_names):
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.5)
    ready = all(KILL_POINT in Path(n).read_text(errors="replace") for n in log_names)
    time.sleep(args.kill_after_s)
    victim = procs[args.kill_rank]
    t_kill = time.time()
    victim.kill()
    ended: dict[int, float | None] = {}
    while time.time() < t_kill + args.kill_bound_s and len(ended) < len(procs) - 1:
        for rank, p in enumerate(procs):
            if rank != args.kill_rank and rank not in ended and p.poll() is not None:
                ended[rank] = round(time.time() - t_kill, 1)
        time.sleep(0.2)
    survivors = {}
    for rank, p in enumerate(procs):
        if rank == args.kill_rank:
            continue
        if p.poll() is None:
            p.kill()
        text = Path(log_names[rank]).read_text(errors="replace")
        cause = [x[-400:] for x in text.splitlines()
                 if any(k in x for k in ("megamoe", "Error", "error", "exit status", "SURVIVED_LOOP", "Traceback"))]
        survivors[str(rank)] = {"rc": p.returncode, "ended_after_s": ended.get(rank), "cause_lines": cause[-12:]}
    return {"ready_before_kill": ready, "killed_rank": args.kill_rank, "kill_after_s": args.kill_after_s,
            "bound_s": args.kill_bound_s, "p2p_timeout_s": float(os.environ.get("MEGA_P2P_TIMEOUT_S", "30")),
            "survivors": survivors}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> None:
    """Start ``--dp`` rank processes, wait (bounded), print every rank's RESULT line and log tail."""
    port = free_port()
    procs, logs = [], []
    for rank in range(args.dp):
        env = dict(os.environ, VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL="0", VLLM_DP_SIZE=str(args.dp),
                   VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port), VLLM_DISABLE_PYNCCL="1")
        log = open(f"{args.log_prefix}.rank{rank}.log", "w")
        cmd = [sys.executable, __file__, args.model, "--dp", str(args.dp), "--rank", str(rank), "--graphs", args.graphs,
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        if args.moe_backend:
            cmd += ["--moe-backend", args.moe_backend]
        if args.kill_rank is not None:
            cmd += ["--kill-rank", str(args.kill_rank)]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        logs.append(log)
    if args.kill_rank is not None:
        print("KILL " + json.dumps(kill_and_watch(args, procs, [log.name for log in logs])), flush=True)
        for log in logs:
            log.close()
        return
    deadline = time.time() + args.timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.close()
        text = Path(log.name).read_text(errors="replace")
        line = next((x for x in reversed(text.splitlines()) if x.startswith("RESULT ")), None)
        print(line or "RANK_FAILED " + json.dumps({"rank": rank, "rc": p.returncode, "log_tail": text[-5000:]}),
              flush=True)
        print("STARTUP " + json.dumps([x[x.index("[megamoe]"):] for x in text.splitlines() if "[megamoe]" in x][:6]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=None, help="internal: run as this DP rank")
    ap.add_argument("--groups", type=int, default=2, help="with --dp 1: how many ranks' work to run in turn")
    ap.add_argument("--graphs", default="eager", choices=GRAPH_MODES)
    ap.add_argument("--moe-backend", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--log-prefix", default="/tmp/serve_dp")
    ap.add_argument("--kill-rank", type=int, default=None, help="the fault test: SIGKILL this rank while all serve")
    ap.add_argument("--kill-after-s", type=float, default=3.0, help="the fault test: seconds of serving before the kill")
    ap.add_argument("--kill-bound-s", type=float, default=120.0, help="the fault test: how long survivors may take to end")
    args = ap.parse_args()
    if args.dp > 1 and args.rank is None:
        launch(args)
    else:
        args.rank = args.rank or 0
        rank_main(args)


if __name__ == "__main__":
    main()
