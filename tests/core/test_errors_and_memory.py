"""The errors a serving engineer meets first say what to do (issue 45), and `megamoe info` prints the
memory the layer takes per GPU and what MEGA_DISPATCH=auto picks on CUDA.

Each message is asserted on the path the user takes: `megamoe info` (in process, as
megamoe_backend.cli.main.main) or the spec / plan functions the plugins call. The memory figures are
checked against the buffers the workspaces really allocate (DeviceWorkspace on CPU) and the arena layout
P2PWorkspace is built from; the auto forecast against select.py's own decision on injected topologies.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megamoe_backend.cli.main import main
from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import (PRESET_CONFIGS, PRESETS, ConfigError, MoESpec, preset, quant_scheme_from_config)

DSV3_KEYS = {"hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("MEGA_DISPATCH_WIRE", "MEGA_WIRE", "MEGA_COMBINE_WIRE", "MEGA_DISPATCH", "MEGA_MAX_TOKENS_PER_RANK",
                 "AITER_FORCE_A8W4", "MEGA_EXPERTS_GEMM"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def info(capsys, *args: str) -> tuple[int, str]:
    rc = main(["info", *args])
    return rc, capsys.readouterr().out


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- config.json errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, needles", [
    ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32},
     ["model_type='llama' is not a MoE model", "DeepSeek-style MoE layers only",
      "serve it without --moe-backend megamoe_ep"]),
    ({"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
      "num_experts_per_tok": 8}, ["model_type='qwen3_moe' is a MoE model (num_experts=128) but not a DeepSeek-style one",
                                   "only DeepSeek-style MoE (n_routed_experts", "the engine's own MoE backend"]),
    ({"model_type": "mixtral", "hidden_size": 4096, "num_local_experts": 8, "num_experts_per_tok": 2},
     ["is a MoE model (num_local_experts=8) but not a DeepSeek-style one"]),
    ({"model_type": "deepseek_v3", **{k: v for k, v in DSV3_KEYS.items() if k != "moe_intermediate_size"}},
     ["(model_type='deepseek_v3') is missing required MoE key(s): moe_intermediate_size"]),
])
def test_non_deepseek_configs_are_refused_as_such(config, needles, tmp_path, clean_env, capsys):
    path = write(tmp_path / "m" / "config.json", json.dumps(config))
    rc, out = info(capsys, "--model", str(path.parent))
    assert rc == 2 and str(path) in out
    for needle in needles:
        assert needle in out
    with pytest.raises(ConfigError, match="not a MoE model|not a DeepSeek-style|missing required"):
        MoESpec.from_config(config)  # the plugins' path: the engine's config mapping


def test_bad_json_names_the_file_and_the_place(tmp_path, clean_env, capsys):
    path = write(tmp_path / "config.json", '{"hidden_size": 7168,\n  "n_routed_experts": 256,,\n}')
    rc, out = info(capsys, "--model", str(path))
    assert rc == 2
    assert f"{path} is not valid JSON (line 2, column " in out and "point --model at the checkpoint's config.json" in out
    write(tmp_path / "list" / "config.json", "[1, 2]")
    rc, out = info(capsys, "--model", str(tmp_path / "list"))
    assert rc == 2 and "holds a JSON list, not an object" in out


def test_folder_without_config_and_hf_id_say_which_path_was_tried(tmp_path, clean_env, capsys, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    rc, out = info(capsys, "--model", str(tmp_path / "ckpt"))
    assert rc == 2 and f"no config.json in the folder {tmp_path / 'ckpt'} (tried {tmp_path / 'ckpt' / 'config.json'})" in out
    monkeypatch.chdir(tmp_path)
    rc, out = info(capsys, "--model", "deepseek-ai/DeepSeek-V4-Pro")
    assert rc == 2 and f"config file not found: tried {tmp_path / 'deepseek-ai' / 'DeepSeek-V4-Pro'}" in out
    assert "looks like a Hugging Face model id, which is not downloaded here" in out
    assert "huggingface-cli download deepseek-ai/DeepSeek-V4-Pro config.json" in out
    rc, out = info(capsys, "--model", "/models/DeepSeek-V4-Pro")
    assert rc == 2 and "config file not found: tried /models/DeepSeek-V4-Pro; point --model at" in out
    assert "Hugging Face" not in out  # an absolute path is not an id


# --- knob / plan errors ----------------------------------------------------------------------------------------

def test_fp8_wire_on_a4w4_offers_aiter_force_a8w4_which_then_works(clean_env, capsys):
    clean_env.setenv("MEGA_DISPATCH_WIRE", "fp8")
    rc, out = info(capsys, "--preset", "r1-mxfp4", "--device", "cpu")
    assert rc == 2
    assert ("MEGA_DISPATCH_WIRE=fp8 does not match the experts: quant=a4w4 multiplies fp4 activations on MXFP4 weights"
            in out)
    assert "Set MEGA_DISPATCH_WIRE=fp4, bf16, or unset it; or set AITER_FORCE_A8W4=1" in out
    assert "A operand" not in out
    clean_env.setenv("AITER_FORCE_A8W4", "1")  # what the message offers makes the wire legal
    rc, out = info(capsys, "--preset", "r1-mxfp4", "--device", "cpu")
    assert rc == 0 and "quant=a8w4" in out and "wire=fp8 " in out


def test_wire_errors_for_bf16_and_a8w4_experts_name_the_legal_wires():
    for quant, wire, needle, offers_force in (("bf16", "fp8", "Unset MEGA_DISPATCH_WIRE or set it to bf16", False),
                                               ("a8w4", "fp4", "Set MEGA_DISPATCH_WIRE=fp8, bf16, or unset it", False)):
        with pytest.raises(KnobError) as err:
            build_plan(preset("r1-mxfp4"), Knobs(dispatch_wire=wire), quant=quant)
        assert needle in str(err.value) and ("AITER_FORCE_A8W4=1" in str(err.value)) == offers_force


def test_symm_on_cpu_does_not_suggest_nccl(clean_env, capsys):
    clean_env.setenv("MEGA_DISPATCH", "symm")
    rc, out = info(capsys, "--preset", "dsv4-pro", "--device", "cpu")
    assert rc == 2 and "MEGA_DISPATCH=symm is the device P2P path and needs CUDA GPUs" in out
    assert "unset MEGA_DISPATCH (or set it to auto)" in out and "nccl" not in out


@pytest.mark.parametrize("args, needle", [
    (["--ep-size", "0"], "ep_size=0: the EP group needs at least 1 rank (megamoe info --ep-size N"),
    (["--ep-size", "0", "--redundant-experts", "64"], "ep_size=0: the EP group needs at least 1 rank"),
    (["--ep-size", "8", "--ep-rank", "8"], "ep_rank=8 must be in 0..7 for ep_size=8 (megamoe info --ep-rank R"),
])
def test_ep_size_and_rank_errors_name_the_flag(args, needle, clean_env, capsys):
    rc, out = info(capsys, "--preset", "dsv4-pro", "--device", "cpu", *args)
    assert rc == 2 and needle in out, out


def test_plan_checks_the_ep_position_first():
    """The plugins' path: a bad EP size is named before the wire or the placement is looked at."""
    with pytest.raises(ValueError, match=r"ep_size=0: the EP group needs at least 1 rank"):
        build_plan(preset("dsv4-pro"), Knobs(dispatch_wire="fp8"), ep_rank=0, ep_size=0)


# --- presets read as the engine reads their checkpoint -----------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_configs_declare_the_presets_scheme(name):
    cfg = PRESET_CONFIGS[name]
    assert quant_scheme_from_config(cfg["quantization_config"], cfg.get("expert_dtype"), cfg["model_type"]) == \
        PRESETS[name].quant
    assert cfg["model_type"] == PRESETS[name].model_type


def test_preset_with_engine_answers_as_the_checkpoint_does(fixtures, clean_env, capsys):
    """--preset dsv4-pro --engine vllm-0.33 (what the serve scripts ask for a Hugging Face id) = the same
    question on the published config (tests/fixtures/dsv4_pro_fp4_experts_config.json)."""
    answers = []
    for src in (["--preset", "dsv4-pro"], ["--model", str(fixtures / "dsv4_pro_fp4_experts_config.json")]):
        rc, out = info(capsys, *src, "--engine", "vllm-0.33", "--device", "cuda", "--json")
        assert rc == 0, out
        got = json.loads(out)
        answers.append((got["engine_reading"], got["spec"]["quant"], got["scheme"]["dispatch_wire"]))
    assert answers[0] == answers[1] and answers[0][1:] == ("a8w4", "fp8")


# --- memory per GPU ----------------------------------------------------------------------------------------------

def _plan(mtpr: int, ep: int, transport: str, quant: str = "a8w4", wire: str = "fp8", name: str = "r1-mxfp4"):
    return build_plan(preset(name), Knobs(dispatch_wire=wire, transport=transport, max_tokens_per_rank=mtpr),
                      0, ep, device_type="cuda", quant=quant)


def test_memory_is_what_the_workspaces_allocate():
    """ep_size 1: DeviceWorkspace's tensors, allocated here on CPU; symm / ipc: the arena layout
    P2PWorkspace is built from (p2p_arena_layout) plus its pair tables."""
    import torch

    from megamoe_backend.layer.device.workspace import DeviceWorkspace, p2p_arena_layout
    from megamoe_backend.layer.memory import layer_memory
    from megamoe_backend.plan import manual_choice

    small = preset("r1-mxfp4").scaled(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8,
                                      num_experts_per_tok=2, n_group=1, topk_group=1)
    knobs = Knobs(dispatch_wire="fp8", max_tokens_per_rank=64)
    plan = build_plan(small, knobs, quant="a8w4", backends=manual_choice("triton", "nccl", knobs))
    allocated = DeviceWorkspace(plan, torch.device("cpu")).bytes  # scratch is empty before the first forward
    assert layer_memory(plan, "cuda", ("test GPU", 10**9)).workspace == allocated > 0
    p2p = _plan(8192, 8, "ipc")
    mem = layer_memory(p2p, "cuda", ("test GPU", 141 * 10**9))
    lay = p2p_arena_layout(p2p)
    assert mem.arena == lay.total and lay.ep == 8 and lay.mtpr == 8192
    assert mem.workspace == lay.total + 8 * (8 * 8192 * 8 + 8192 * 8 + 2)  # + pair_row, pair_live, epochs (int64)
    assert mem.weights == p2p.num_local_experts * 58 * mem.weights_per_layer // p2p.num_local_experts
    assert mem.warning() is None


def test_info_prints_memory_and_warns_on_a_large_mtpr(clean_env, capsys):
    clean_env.setenv("MEGA_DISPATCH_WIRE", "fp8")
    clean_env.setenv("AITER_FORCE_A8W4", "1")
    clean_env.setenv("MEGA_DISPATCH", "ipc")
    rc, out = info(capsys, "--preset", "r1-mxfp4", "--device", "cuda", "--gpu-memory-gb", "141", "--json")
    assert rc == 0
    mem = json.loads(out)["memory_per_gpu"]
    assert mem["warning"] is None and mem["mtpr"] == 8192 and 1e9 < mem["arena"] < 2e9
    assert 40e9 < mem["weights"] < 50e9  # R1: 32 local MXFP4 experts x 58 MoE layers
    clean_env.setenv("MEGA_MAX_TOKENS_PER_RANK", "100000")
    rc, out = info(capsys, "--preset", "r1-mxfp4", "--device", "cuda", "--gpu-memory-gb", "141")
    assert rc == 0 and "memory per GPU" in out
    assert ("[megamoe] warning: the device P2P workspace (ipc peer arena) needs 17." in out and
            "at MEGA_MAX_TOKENS_PER_RANK=100000, more than 5% of the GPU of 141 GB" in out)
    assert "Lower MEGA_MAX_TOKENS_PER_RANK" in out
    rc, out = info(capsys, "--preset", "r1-mxfp4", "--device", "cuda", "--gpu-memory-gb", "40")
    assert rc == 0 and "more than the GPU of 40 GB (--gpu-memory-gb) has" in out  # does not fit at all


def test_memory_on_paths_without_a_fixed_workspace_says_so(clean_env, capsys):
    rc, out = info(capsys, "--preset", "dsv4-pro", "--device", "cpu", "--json")
    mem = json.loads(out)["memory_per_gpu"]
    assert rc == 0 and mem["workspace"] is None and "allocated per forward" in mem["workspace_kind"]
    clean_env.setenv("MEGA_DISPATCH", "nccl")
    rc, out = info(capsys, "--preset", "dsv4-pro", "--device", "cuda", "--json")
    mem = json.loads(out)["memory_per_gpu"]
    assert rc == 0 and mem["workspace"] is None and mem["workspace_kind"].startswith("nccl torch forward")


# --- what MEGA_DISPATCH=auto picks on CUDA -------------------------------------------------------------------------

def test_info_cuda_says_what_auto_picks_and_on_which_fact(clean_env, capsys):
    rc, out = info(capsys, "--preset", "dsv4-pro", "--device", "cuda")
    assert rc == 0
    assert "transport=nccl" not in out  # the pending placeholder is not printed as the decision
    assert "auto -> symm when every EP rank is on one host with CUDA peer access (ipc if ranks share a GPU), else nccl" in out
    assert "startup line when auto picks symm (on one host with peer access; nccl, eager, across hosts):" in out
    rc, out = info(capsys, "--preset", "dsv4-pro", "--device", "cuda", "--json")
    got = json.loads(out)
    assert got["transport"].startswith("auto: symm on one host with peer access, else nccl")
    assert (got["transport_auto"]["one_host"], got["transport_auto"]["shared_gpu"], got["transport_auto"]["several_hosts"]) == (
        "symm", "ipc", "nccl")
    assert not any("decided at start-up over the EP group: ipc" in r for r in got["selection_reasons"])
    rc, out = info(capsys, "--preset", "dsv4-pro", "--device", "cuda", "--ep-size", "1", "--json")
    assert json.loads(out)["transport_auto"] is None  # ep_size 1: auto's answer is final, nothing to forecast


class _FakeCuda:
    """torch.cuda as local_topology asks it: device count, peer access, GPU ids."""

    def __init__(self, count: int, peer: bool) -> None:
        self.count, self.peer = count, peer

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return 0

    def can_device_access_peer(self, a: int, b: int) -> bool:
        return self.peer

    def get_device_properties(self, i: int):
        return SimpleNamespace(uuid=f"GPU-{i}")


def _fake_torch(count: int, peer: bool):
    import torch

    return SimpleNamespace(cuda=_FakeCuda(count, peer), version=SimpleNamespace(hip=None), device=torch.device)


@pytest.mark.parametrize("count, peer, here", [(8, True, "symm"), (8, False, "nccl"), (4, True, None)])
def test_forecast_on_this_host_runs_selections_decision(count, peer, here):
    from megamoe_backend.platform.auto_forecast import cuda_auto_forecast, local_topology
    from megamoe_backend.platform.select import cuda_auto_transport

    topo = local_topology(8, _fake_torch(count, peer))
    forecast = cuda_auto_forecast("triton", 8, True, topo)
    assert forecast.here == here
    if topo is not None:
        assert forecast.here == cuda_auto_transport("triton", 8, topo)[0]
        assert ("on this host: " + here) in forecast.describe()
    no_symm = cuda_auto_forecast("triton", 8, False)
    assert (no_symm.one_host, no_symm.several_hosts) == ("ipc", "nccl")  # no symmetric memory in this torch
    assert cuda_auto_forecast("triton", 1, True) is None and cuda_auto_forecast("torch", 8, True) is None
