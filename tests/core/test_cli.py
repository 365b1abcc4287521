"""`megamoe` CLI: info prints the plan and fails with the knob error; demo runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def megamoe(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGA_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "megamoe_backend.cli.main", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def test_info_json_for_config(fixtures) -> None:
    r = megamoe("info", "--model", str(fixtures / "r1_mxfp4_config.json"), "--ep-size", "8", "--json",
                env={"MEGA_DISPATCH_WIRE": "fp4", "MEGA_COMBINE_WIRE": "fp8_blockwise_1x32"})
    assert r.returncode == 0, r.stdout + r.stderr
    info = json.loads(r.stdout)
    assert info["dispatch_bytes_per_token_per_destination"]["payload"] == 3584
    assert info["dispatch_bytes_per_token_per_destination"]["scales"] == 224
    assert info["combine_bytes_per_token_expert_pair"]["row"] == 7168 + 224
    assert info["local_experts"] == 32
    assert "wire=fp4 combine=fp8_blockwise_1x32" in info["startup_line"]


def test_info_text_preset() -> None:
    r = megamoe("info", "--preset", "dsv4-pro", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert ("[megamoe] Created MegaMoE: ep_rank=0 ep_size=8 hidden=7168 inter=3072 experts=384 logical=384 "
            "redundant/rank=0 topk=6") in r.stdout


def test_info_with_redundant_experts(fixtures) -> None:
    """r64 on 8 ranks (R1: 256 routed experts): 320 physical, the engines' initial map puts the 64
    replicas of logical 0..63 on the last 64 physical slots, i.e. 24 + 40 on ranks 6 and 7."""
    r = megamoe("info", "--model", str(fixtures / "r1_mxfp4_config.json"), "--ep-size", "8",
                "--redundant-experts", "64", "--json", env={"MEGA_DISPATCH_WIRE": "fp4"})
    assert r.returncode == 0, r.stdout + r.stderr
    info = json.loads(r.stdout)
    assert info["experts"] == {"physical": 320, "logical": 256, "redundant_per_rank": [0] * 6 + [24, 40]}
    assert info["local_experts"] == 40
    assert "experts=320 logical=256 redundant/rank=0,0,0,0,0,0,24,40 " in info["startup_line"]
    text = megamoe("info", "--preset", "dsv4-pro", "--device", "cpu", "--redundant-experts", "64")
    assert text.returncode == 0 and "experts=448 logical=384 redundant/rank=0,0,0,0,0,0,8,56" in text.stdout
    bad = megamoe("info", "--preset", "dsv4-pro", "--redundant-experts", "3")
    assert bad.returncode == 2
    assert "--redundant-experts 3 map has 387 physical experts, which do not split over 8 EP ranks" in bad.stdout


@pytest.mark.parametrize("env, needle", [
    ({"MEGA_DISPATCH_WIRE": "int4"}, "MEGA_DISPATCH_WIRE='int4' is not valid"),
    ({"MEGA_DISPATCH_WIRE": "fp8"}, "MEGA_DISPATCH_WIRE=fp8 does not match the experts: quant=a4w4"),
    ({"MEGA_WIRE": "fp4", "MEGA_DISPATCH_WIRE": "bf16"}, "MEGA_WIRE"),
])
def test_info_bad_env_exits_nonzero(env, needle) -> None:
    r = megamoe("info", "--preset", "dsv4-pro", env=env)
    assert r.returncode == 2
    assert needle in r.stdout


def test_info_missing_key(fixtures) -> None:
    r = megamoe("info", "--model", str(fixtures / "missing_key_config.json"))
    assert r.returncode == 2 and "moe_intermediate_size" in r.stdout


@pytest.mark.multiproc
def test_demo_small(tmp_path) -> None:
    out = tmp_path / "demo.json"
    r = megamoe("demo", "--tokens", "4", "--hidden", "64", "--inter", "64", "--experts", "8", "--iters", "1",
                "--json-out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 10
    assert all(row["rel_l2"] < row["gate"] for row in rows)
    assert [row["bit_identical_to_local"] for row in rows if row["bit_identical_to_local"] is not None] == [True] * 3
    # Piped (capture_output): the table fits 80 columns, nothing cut ("…"), and no per-rank startup lines,
    # only the summary: 10 EP plans (2 ranks each) + 3 single-process ones.
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in r.stdout, r.stdout
    assert "[megamoe] Created MegaMoE" not in r.stdout + r.stderr
    assert "startup: 23 runtimes, 13 distinct plans" in r.stdout
    header = next(line for line in lines if "=local" in line).split()
    assert header == ["quant", "disp", "comb", "relL2", "gate", "=local", "B/tok", "B/pair", "ms"]
    assert sum(1 for line in lines if line.split()[:2] in (["bf16", "bf16"], ["a8w4", "fp8"], ["a4w4", "fp4"])) == 6


def test_startup_lines_fold_into_one_row_per_plan() -> None:
    from megamoe_backend.cli.startup_summary import summarise_startup_lines

    line = ("[megamoe] Created MegaMoE: ep_rank={r} ep_size=2 hidden=64 experts=8 quant={q} transport=gloo "
            "wire={w} combine=bf16")
    lines = [line.format(r=r, q=q, w=w) for q, w in (("a8w4", "fp8"), ("a4w4", "fp4")) for r in (1, 0)]
    lines.append(line.format(r=0, q="a8w4", w="bf16"))
    s = summarise_startup_lines(lines)
    assert s.runtimes == 5 and s.columns == ("quant", "wire")
    assert s.shared == {"ep_size": "2", "hidden": "64", "experts": "8", "transport": "gloo", "combine": "bf16"}
    assert s.plans == (("0,1", ("a8w4", "fp8")), ("0,1", ("a4w4", "fp4")), ("0", ("a8w4", "bf16")))
    assert s.lines()[1] == "  ranks 0,1: quant=a8w4 wire=fp8"
    with pytest.raises(ValueError, match="not a MegaMoE startup line"):
        summarise_startup_lines(["hello"])
