"""`megamoe` CLI: info prints the plan and fails with the knob error; demo runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megamoe_backend.knobs import Knobs

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
    r = megamoe("demo", "--tokens", "4", "--hidden", "64", "--inter", "64", "--experts", "8", "--json-out", str(out))
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
    assert "layer plans: 13 distinct over 23 layers built (each logs one startup" in r.stdout
    header = next(line for line in lines if "=local" in line).split()
    assert header == ["quant", "disp", "comb", "relL2", "gate", "=local", "B/tok", "B/pair"]  # no CPU milliseconds
    assert sum(1 for line in lines if line.split()[:2] in (["bf16", "bf16"], ["a8w4", "fp8"], ["a4w4", "fp4"])) == 6
    assert "verdict: PASS: all 10 EP runs within their relL2 gate vs fp32, the 3 bf16-wire runs bit-identical" in (
        " ".join(r.stdout.split()))
    assert all("ms_per_forward" not in row for row in rows)


@pytest.mark.multiproc
def test_demo_reads_the_wire_knobs(tmp_path) -> None:
    """MEGA_DISPATCH_WIRE / MEGA_COMBINE_WIRE keep the rows on that wire (the demo reads the knobs)."""
    out = tmp_path / "demo.json"
    r = megamoe("demo", "--tokens", "2", "--hidden", "64", "--inter", "64", "--experts", "8", "--json-out", str(out),
                env={"MEGA_DISPATCH_WIRE": "fp8", "MEGA_COMBINE_WIRE": "bf16"})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert [(row["quant"], row["dispatch_wire"], row["combine_wire"]) for row in rows] == [("a8w4", "fp8", "bf16")]


@pytest.mark.parametrize("args, env, line", [
    (["--ranks", "3"], {}, "megamoe demo: error: --experts 32 over --ranks 3: n_routed_experts=32 is not divisible "
                           "by the EP size 3"),
    ([], {"MEGA_DISPATCH_WIRE": "fp16"}, "megamoe demo: error: MEGA_DISPATCH_WIRE='fp16' is not valid; allowed "
                                         "values: bf16 | fp8 | fp4"),
    ([], {"MEGA_DISPATCH": "symm"}, "megamoe demo: error: MEGA_DISPATCH=symm is the device P2P path and needs CUDA GPUs"),
    ([], {"MEGA_MAX_TOKENS_PER_RANK": "64"}, "megamoe demo: error: MEGA_MAX_TOKENS_PER_RANK=64 is set, but megamoe "
                                             "demo does not apply it"),
], ids=["ranks-3", "wire-fp16", "dispatch-symm", "mtpr-set"])
def test_demo_refuses_in_one_line_before_any_rank_starts(args, env, line) -> None:
    r = megamoe("demo", *args, env=env, timeout=120)
    assert r.returncode == 2 and len(r.stdout.strip().splitlines()) == 1, r.stdout + r.stderr
    assert r.stdout.startswith(line) and r.stderr == "", r.stdout + r.stderr


def test_startup_lines_fold_into_one_row_per_plan() -> None:
    from megamoe_backend.cli.startup_summary import summarise_startup_lines

    line = ("[megamoe] Created MegaMoE: ep_rank={r} ep_size=2 hidden=64 experts=8 quant={q} transport=gloo "
            "wire={w} combine=bf16")
    lines = [line.format(r=r, q=q, w=w) for q, w in (("a8w4", "fp8"), ("a4w4", "fp4")) for r in (1, 0)]
    lines.append(line.format(r=0, q="a8w4", w="bf16"))
    s = summarise_startup_lines(lines)
    assert s.line_count == 5 and s.columns == ("quant", "wire")
    assert s.shared == {"ep_size": "2", "hidden": "64", "experts": "8", "transport": "gloo", "combine": "bf16"}
    assert s.plans == (("0,1", ("a8w4", "fp8")), ("0,1", ("a4w4", "fp4")), ("0", ("a8w4", "bf16")))
    assert s.lines()[1] == "  ranks 0,1: quant=a8w4 wire=fp8"
    with pytest.raises(ValueError, match="not a MegaMoE startup line"):
        summarise_startup_lines(["hello"])


# --- what `megamoe info` answers for a host it is not on, and its refusals (issue 59, item 4) ------------------

def info_main(capsys, monkeypatch, *args: str, env: dict | None = None) -> tuple[int, str]:
    from megamoe_backend.cli.main import main

    for name in ("MEGA_DISPATCH_WIRE", "MEGA_WIRE", "MEGA_COMBINE_WIRE", "MEGA_DISPATCH", "MEGA_MAX_TOKENS_PER_RANK",
                 "AITER_FORCE_A8W4", "MEGA_EXPERTS_GEMM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    rc = main(["info", *args])
    return rc, capsys.readouterr().out


@pytest.fixture
def no_triton_here(monkeypatch):
    """This machine as a CPU box without triton (what a contributor's laptop has)."""
    import dataclasses

    import megamoe_backend.plan.selection as selection
    from megamoe_backend.platform import PackageInfo, detect_facts

    facts = detect_facts()
    facts = dataclasses.replace(facts, device="cpu", packages={**facts.packages, "triton": PackageInfo("triton", False)})
    monkeypatch.setattr(selection, "detect_facts", lambda: facts)


def test_info_cuda_from_a_box_without_triton_plans_what_the_gpu_host_runs(no_triton_here, capsys, monkeypatch):
    rc, out = info_main(capsys, monkeypatch, "--device", "cuda", "--ep-size", "8", "--json")
    assert rc == 0, out
    info = json.loads(out)
    assert info["experts_provider"] == "triton" and info["transport_auto"]["one_host"] in ("symm", "ipc")
    assert info["assumed"] and info["assumed"][0].startswith("guessing the GPU host: no CUDA GPU here (cpu)")
    rc, text = info_main(capsys, monkeypatch, "--device", "cuda", "--ep-size", "8")
    assert rc == 0 and "guessing the GPU host" in text and "triton: assumed (the GPU host's, >= 3.4)" in text
    # without --engine it says which engines read the checkpoint otherwise, and how to ask for their answer
    assert ("no --engine: the checkpoint's own scheme (a4w4); vllm-0.33 runs a8w4 on the fp8 wire; vllm-0.34 runs "
            "a8w4 on the fp8 wire") in text and "pass --engine vllm-0.33 for that answer" in text


def test_symm_with_torch_experts_is_refused_naming_the_knob(no_triton_here):
    import dataclasses

    from megamoe_backend.experts import ExpertMath
    from megamoe_backend.platform import PlatformError, select_backends
    from megamoe_backend.plan.selection import facts_for

    cuda_without_triton = dataclasses.replace(facts_for("cpu"), device="cuda")
    for transport in ("symm", "ipc"):
        with pytest.raises(PlatformError, match=f"MEGA_DISPATCH={transport} is the device P2P forward, which runs the "
                                                "Triton experts, and triton is not importable here"):
            select_backends(cuda_without_triton, Knobs(transport=transport), ExpertMath("bf16"), ep_size=8)
    assert select_backends(cuda_without_triton, Knobs(transport="nccl"), ExpertMath("bf16"), ep_size=8).transport == "nccl"


def test_info_engine_knobs_row_and_selection_row_agree_on_the_wire(capsys, monkeypatch):
    rc, text = info_main(capsys, monkeypatch, "--device", "cuda", "--engine", "vllm-0.33")
    flat = " ".join(text.replace("│", " ").split())
    assert rc == 0 and "dispatch_wire=fp8 (MEGA_DISPATCH_WIRE unset: the engine's reading)" in flat, flat
    assert "dispatch_wire=bf16" not in flat and " wire=fp8 " in flat
    rc, out = info_main(capsys, monkeypatch, "--device", "cuda", "--engine", "vllm-0.33", "--json")
    info = json.loads(out)
    assert info["knobs"]["dispatch_wire"] == info["scheme"]["dispatch_wire"] == "fp8"
    assert info["knobs_from_env"]["dispatch_wire_set"] is False


@pytest.mark.parametrize("engine, rc, needle", [
    ("vllm-0.31", 2, "megamoe info: error: --engine vllm-0.31: vLLM older than 0.32 has no --moe-backend megamoe_ep"),
    ("sglang-0.5.22", 2, "--engine sglang-0.5.22: the SGLang plugin registers on sglang-0.5.23 only"),
    ("vllm-0.35", 0, "--engine vllm-0.35 is newer than the vLLM releases read (vllm-0.32 to vllm-0.34): read as "
                     "vllm-0.34 reads it"),
], ids=["vllm-0.31", "sglang-0.5.22", "vllm-0.35"])
def test_info_engine_outside_the_served_releases(engine, rc, needle, capsys, monkeypatch):
    got, out = info_main(capsys, monkeypatch, "--device", "cpu", "--engine", engine)
    assert got == rc and needle in out, out


def test_info_rocm_without_gfx_arch_says_it_is_guessing(capsys, monkeypatch):
    rc, out = info_main(capsys, monkeypatch, "--device", "rocm", "--json")
    info = json.loads(out)
    assert rc == 0 and "for None" not in out
    assert any("unknown AMD GPU" in reason for reason in info["selection_reasons"]), info["selection_reasons"]
    assert info["assumed"] == ["guessing the GPU: no AMD GPU here and no --gfx-arch, so no fused aiter runtime is "
                               "planned; pass --gfx-arch gfx950 (MegaMoEV2) or gfx1250 (MegaMoEGfx1250) for what that "
                               "GPU runs"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_memory_warning_where_the_weights_alone_do_not_fit_names_the_ep_size_not_mtpr(device, capsys, monkeypatch):
    """DSV4-Pro at EP 8 needs ~103 GB of experts per GPU: an 80 GB GPU cannot hold them whatever the workspace
    (0.00 GB on the torch forward), so lowering MEGA_MAX_TOKENS_PER_RANK is not the fix."""
    rc, out = info_main(capsys, monkeypatch, "--device", device, "--gpu-memory-gb", "80", "--json")
    warning = json.loads(out)["memory_per_gpu"]["warning"]
    assert rc == 0 and warning.startswith("[megamoe] warning: the expert weights alone need 102.")
    assert "a larger --ep-size" in warning and "MEGA_MAX_TOKENS_PER_RANK" not in warning


def test_unsupported_quant_method_lists_what_is_served():
    from megamoe_backend.spec import ConfigError, quant_scheme_from_config

    with pytest.raises(ConfigError) as exc:
        quant_scheme_from_config({"quant_method": "awq"})
    assert "quant_method='awq' is not supported" in str(exc.value)
    assert "block-FP8 experts (quant_method fp8, weight_block_size [128, 128])" in str(exc.value)


@pytest.mark.parametrize("argv", [["--help"], ["info", "--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help_imports_no_torch(argv):
    code = ("import sys\nfrom megamoe_backend.cli.main import main\ntry:\n    main(%r)\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nprint('torch imported' if 'torch' in sys.modules else 'no torch')" % argv)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("no torch"), r.stdout + r.stderr


def test_bench_without_triton_is_one_line(tmp_path):
    """A CPU install without triton: `megamoe bench experts` says what it needs, no traceback."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None  # import triton fails\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = megamoe("bench", "experts", "--tokens", "8", env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip() == ("megamoe bench experts: needs triton (pip install 'megamoe-backend[triton]') and a "
                                "CUDA GPU; triton is not importable here")


def test_bench_without_the_benchmarks_is_one_line(monkeypatch, capsys, tmp_path):
    """A wheel install has no benchmarks/ beside the package: `megamoe bench layer` says so in one line."""
    from megamoe_backend.cli import main as cli

    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)
    assert cli.main(["bench", "layer", "--tokens", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"megamoe bench layer: {cli.BENCH_ABSENT}\n"
