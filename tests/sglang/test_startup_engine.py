"""SGLang's start-up of megamoe_ep MoE layers on a CUDA host, run on CPU with the GPU-host facts
injected (tests/startup_facts.py): 2 SGLang rank processes (DP attention + EP 2, gloo), SGLang's
FusedMoE and weight loader, the plugin's whole start-up up to the layer's decision
(layer/startup.py), with CUDA graphs on (SGLang's default) and off (--disable-cuda-graph).
ep_size 8: tests/core/test_startup.py (the same decision without an engine).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from startup_facts import CASES, check_case  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.multiproc]
HERE = Path(__file__).resolve().parent


def _ranks(tmp_path, args: tuple[str, ...]) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [tmp_path / f"startup{'_eager' if args else ''}_r{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "sglang_startup_worker.py"), str(r), "2", str(port), str(out),
                               "--moe-a2a-backend", "megamoe_ep", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
             for r, out in enumerate(outs)]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    results = []
    for out, log in zip(outs, logs):
        assert out.exists(), log[-4000:]
        r = json.loads(out.read_text())
        assert r["ok"], r.get("error")
        results.append(r)
    return results


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("startup")
    return {True: _ranks(tmp, ()), False: _ranks(tmp, ("--disable-cuda-graph",))}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_rank_starts_or_refuses_naming_the_flag(started, case):
    ranks = started[case.graphs]
    assert all(r["captures_graphs"] == case.graphs for r in ranks)
    check_case(case, [r["cases"][case.name] for r in ranks], "--disable-cuda-graph")
