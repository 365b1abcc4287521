"""Who runs the expert GEMMs (experts/gemm_choice.py): the oracle's answers on injected facts, humming-kernels'
accepted versions, the refusal of MEGA_EXPERTS_GEMM=humming naming what is missing and the fix, where the
facts come from (humming is imported only where it could serve), the registry and ``megamoe info`` following
the answer, and the humming layout's rounding check (experts/humming/weights.py) on planted blocks."""

from __future__ import annotations

import pytest
import torch

from megamoe_backend.experts import gemm_choice
from megamoe_backend.experts.gemm_choice import GemmFacts, choose_experts_gemm, gemm_facts, humming_version_accepted
from megamoe_backend.experts.humming.weights import HUMMING_WINDOW, check_shape, rounded_block
from megamoe_backend.experts.registry import describe_experts_gemm, experts_gemm_choice
from megamoe_backend.formats import quantize_mx
from megamoe_backend.knobs import KnobError, Knobs
from megamoe_backend.plan import build_plan
from megamoe_backend.spec import preset

HOPPER = dict(device="cuda", quant="a8w4", capability=(9, 0), humming_version="0.1.20")


def facts(**over) -> GemmFacts:
    return GemmFacts(**{"knob": "auto", **HOPPER, **over})


@pytest.fixture(params=[(), ("ep1",)], ids=["auto-keeps-triton", "auto-picks-humming-at-ep1"])
def auto_policy(request, monkeypatch):
    """Both answers of AUTO_HUMMING_FORWARDS for the ep_size-1 forward (gemm_choice's measured policy): each test
    runs under both."""
    monkeypatch.setattr(gemm_choice, "AUTO_HUMMING_FORWARDS", request.param)
    return bool(request.param)


def test_auto_runs_humming_on_the_forwards_it_was_measured_faster_on(auto_policy):
    choice = choose_experts_gemm(facts())
    assert choice.gemm == ("humming" if auto_policy else "triton")
    if not auto_policy:
        assert "not measured faster at ep_size 1" in choice.why
        assert "humming-kernels 0.1.20 could serve here, MEGA_EXPERTS_GEMM=humming runs it" in choice.why
        assert choose_experts_gemm(facts(capability=None)).gemm == "triton"  # auto's answer needs no GPU facts then
    ep = choose_experts_gemm(facts(ep_size=8))  # an EP rank's forward is listed on its own
    assert ep.gemm == "triton" and "on an EP rank (ep_size 8)" in ep.why


def test_block_fp8_auto_runs_humming_on_the_forwards_measured_for_it(monkeypatch):
    """Block-FP8 has its own measured forwards (AUTO_HUMMING_BLOCK_FP8_FORWARDS: the ep_size-1 forward and an EP
    rank's, both measured on an H100); a forward missing from that list keeps Triton under auto and runs humming when
    asked by name; MXFP4's list does not apply to it."""
    assert gemm_choice.auto_forwards("fp8_block") == ("ep1", "ep")
    assert choose_experts_gemm(facts(quant="fp8_block")).gemm == "humming"
    assert choose_experts_gemm(facts(quant="fp8_block", ep_size=8)).gemm == "humming"
    monkeypatch.setattr(gemm_choice, "AUTO_HUMMING_FORWARDS", ())
    assert choose_experts_gemm(facts(quant="fp8_block", ep_size=8)).gemm == "humming"
    monkeypatch.setattr(gemm_choice, "AUTO_HUMMING_BLOCK_FP8_FORWARDS", ("ep1",))
    ep = choose_experts_gemm(facts(quant="fp8_block", ep_size=8))
    assert ep.gemm == "triton" and "on an EP rank (ep_size 8)" in ep.why
    assert choose_experts_gemm(facts(quant="fp8_block", ep_size=8, knob="humming")).gemm == "humming"


@pytest.mark.parametrize("scratch, gemm", [(4 * 10**9, "humming"), (4 * 10**9 + 1, "triton"), (None, "humming")])
def test_auto_spends_at_most_its_share_of_the_gpu_on_humming_scratch(scratch, gemm, monkeypatch):
    """At 5 % of an 80 GB GPU (4 GB) the scratch is allowed, a byte more is not (the why names the knob that
    shrinks it), and MEGA_EXPERTS_GEMM=humming runs it whatever its size."""
    monkeypatch.setattr(gemm_choice, "AUTO_HUMMING_FORWARDS", ("ep1", "ep"))
    f = facts(ep_size=8, scratch_bytes=scratch, gpu_bytes=80 * 10**9)
    choice = choose_experts_gemm(f)
    assert choice.gemm == gemm, choice
    if gemm == "triton":
        assert "4.0 GB, more than 5% of this GPU's 80 GB" in choice.why and "MEGA_MAX_TOKENS_PER_RANK" in choice.why
    assert choose_experts_gemm(facts(knob="humming", ep_size=8, scratch_bytes=scratch, gpu_bytes=80 * 10**9)).gemm == \
        "humming"


def test_the_scratch_auto_weighs_is_what_megamoe_info_counts():
    """One figure: at DSV4-Pro shapes, fp8 wire and MTPR 8192, 0.81 GB at ep_size 1 (bf16 combine rows written in
    place), 7.32 GB on an EP 8 rank (GEMM1's and GEMM2's bf16 rows in one buffer; footprint.py; megamoe info's
    memory)."""
    from megamoe_backend.layer.memory import humming_scratch_of, layer_memory

    ep1 = build_plan(preset("dsv4-pro"), Knobs(dispatch_wire="fp8"), 0, 1, device_type="cuda", quant="a8w4")
    ep8 = build_plan(preset("dsv4-pro"), Knobs(dispatch_wire="fp8", transport="ipc"), 0, 8, device_type="cuda",
                     quant="a8w4")
    assert 0.81e9 < humming_scratch_of(ep1) < 0.82e9 and 7.31e9 < humming_scratch_of(ep8) < 7.33e9
    assert layer_memory(ep8, "cuda", ("GPU", 80 * 10**9), experts_gemm="humming").humming_scratch == humming_scratch_of(ep8)
    assert layer_memory(ep8, "cuda", ("GPU", 80 * 10**9), experts_gemm="triton").humming_scratch is None


@pytest.mark.parametrize("over, gemm, says", [
    ({"knob": "humming"}, "humming", "humming-kernels 0.1.20 on sm_90, a8w4"),
    ({"quant": "fp8_block"}, "humming", "fp8_block (MEGA_EXPERTS_GEMM=auto): humming's Hopper GEMMs, FP8 in 1 x 128 groups"),
    ({"knob": "humming"}, "humming", "MEGA_EXPERTS_GEMM=humming"),
    ({"knob": "triton"}, "triton", "MEGA_EXPERTS_GEMM=triton"),
    ({"capability": (10, 0)}, "triton", "this GPU is sm_100"),
    ({"capability": (8, 9)}, "triton", "this GPU is sm_89"),
    ({"device": "rocm", "capability": None}, "triton", "device rocm"),
    ({"device": "cpu", "capability": None}, "triton", "device cpu"),
    ({"interpreting": True}, "triton", "the Triton interpreter"),
    ({"quant": "a4w4"}, "triton", "these are a4w4"),
    ({"quant": "bf16"}, "triton", "these are bf16"),
    ({"humming_version": None}, "triton", "humming-kernels is not installed"),
    ({"humming_version": "0.1.18"}, "triton", "0.1.18 is outside the accepted >= 0.1.19, < 0.2"),
    ({"humming_version": "0.2.0"}, "triton", "0.2.0 is outside"),
    ({"humming_error": "no CUDA headers for its NVRTC JIT"}, "triton", "cannot run here: no CUDA headers"),
    ({"capability": None}, "pending", "decided on the GPU host"),
    ({"capability": None, "humming_version": None, "knob": "humming"}, "pending", "else refused"),
])
def test_the_oracle_answers_each_platform(over, gemm, says, monkeypatch):
    """Where auto picks humming (AUTO_HUMMING_FORWARDS lists the forward); with none listed auto answers triton."""
    for name in ("AUTO_HUMMING_FORWARDS", "AUTO_HUMMING_BLOCK_FP8_FORWARDS"):
        monkeypatch.setattr(gemm_choice, name, ("ep1",))
    choice = choose_experts_gemm(facts(**over))
    assert choice.gemm == gemm and says in choice.why, choice
    for name in ("AUTO_HUMMING_FORWARDS", "AUTO_HUMMING_BLOCK_FP8_FORWARDS"):
        monkeypatch.setattr(gemm_choice, name, ())
    if facts(**over).knob == "auto":
        assert choose_experts_gemm(facts(**over)).gemm == "triton"


@pytest.mark.parametrize("over, missing, fix", [
    ({"capability": (10, 0)}, "this GPU is sm_100", "Run on an H100 / H200"),
    ({"device": "cpu", "capability": None}, "this layer is on device cpu", "Run on an H100 / H200"),
    ({"quant": "a4w4"}, "it serves A8W4 experts", "MEGA_DISPATCH_WIRE=fp8 or AITER_FORCE_A8W4=1"),
    ({"humming_version": None}, "humming-kernels is not installed", "pip install 'megamoe-backend[humming]'"),
    ({"humming_version": "0.3.1"}, "0.3.1 is outside the accepted", "Install an accepted one"),
    ({"humming_error": "import humming failed (ModuleNotFoundError: No module named 'cuda')"},
     "import humming failed", "Fix that"),
])
def test_humming_asked_for_where_it_cannot_serve_is_refused_naming_the_fix(over, missing, fix):
    with pytest.raises(KnobError, match="MEGA_EXPERTS_GEMM=humming cannot be served") as info:
        choose_experts_gemm(facts(knob="humming", **over))
    text = str(info.value)
    assert missing in text and fix in text and "set it to triton" in text


@pytest.mark.parametrize("version, ok", [
    ("0.1.19", True), ("0.1.20", True), ("0.1.25", True), ("0.1.19.post1", True), ("0.1.21.dev3", True),
    ("0.1.20+cu13", True), ("0.1.18", False), ("0.1", False), ("0.2.0", False), ("1.0.0", False), ("", False),
    (None, False), ("garbage", False),
])
def test_humming_versions_accepted(version, ok):
    assert humming_version_accepted(version) is ok


def test_the_knob_takes_humming_and_names_every_value():
    assert Knobs.from_env({"MEGA_EXPERTS_GEMM": "Humming"}).experts_gemm == "humming"
    with pytest.raises(KnobError, match=r"MEGA_EXPERTS_GEMM='cutlass' is not valid; allowed values: auto \| triton \| humming"):
        Knobs.from_env({"MEGA_EXPERTS_GEMM": "cutlass"})
    with pytest.raises(KnobError, match="not valid"):
        choose_experts_gemm(facts(knob="flashinfer"))


def test_facts_import_humming_only_where_it_could_serve(auto_policy, monkeypatch):
    """On this CPU machine: no GPU, so humming is never imported (the probe is not called); the facts say so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # an interpreter test module may have set it
    called = []
    f = gemm_facts("humming", "cpu", "a8w4", probe=lambda d: called.append(d))
    assert (f.device, f.capability, f.humming_error) == ("cpu", None, None) and not called
    f = gemm_facts("auto", "cuda", "a8w4", probe=lambda d: called.append(d))
    assert f.device == "cuda" and not called  # planning for a GPU this machine lacks: nothing probed
    if not torch.cuda.is_available():
        assert choose_experts_gemm(f).gemm == ("pending" if auto_policy else "triton")


def test_info_and_the_registry_follow_the_oracle(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert describe_experts_gemm("auto", "triton", "cpu").startswith("Triton (MEGA_EXPERTS_GEMM=auto)")
    assert describe_experts_gemm("auto", "torch").startswith("torch provider")
    if not torch.cuda.is_available():
        assert experts_gemm_choice("humming", "cuda", "a8w4").gemm == "pending"
        refused = experts_gemm_choice("humming", "cpu", "a8w4")
        assert refused.gemm == "refused" and "MEGA_EXPERTS_GEMM=humming cannot be served" in refused.why
        assert describe_experts_gemm("humming", "triton", "cpu").startswith("refused at start-up")


def test_the_startup_line_names_the_provider_that_runs():
    spec = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)
    plan = build_plan(spec, Knobs(), quant="a8w4", backends=("triton", "local"))
    assert "experts_provider=triton " in plan.startup_line()
    assert "experts_provider=humming " in plan.startup_line(experts="humming")


def mx_weights(scale_rows: dict):
    """MXFP4 w1 of 2 experts x 4 rows x K=128 (4 blocks), every value the same non-zero code, block scales 127 but those
    set by ``scale_rows`` {(expert, row, block): E8M0}."""
    w = quantize_mx(torch.ones(2, 4, 128), "fp4")
    scales = torch.full_like(w.scales, 127)
    for (e, r, b), s in scale_rows.items():
        scales[e, r, b] = s
    return w.data, scales


def test_rounded_block_finds_the_first_block_humming_rounds():
    packed, scales = mx_weights({})
    assert rounded_block("w13", packed, scales) is None
    packed, scales = mx_weights({(1, 2, 3): 127 + HUMMING_WINDOW})  # its row's others 11 binades below: exact
    assert rounded_block("w13", packed, scales) is None
    packed, scales = mx_weights({(1, 2, 3): 127 + HUMMING_WINDOW + 1})
    assert rounded_block("w13", packed, scales) == "w13 expert 1 row 2 block 0: scale 2**0, 12 binades below the row's 2**12"
    packed = packed.clone()
    packed[1, 2, :48] = 0  # blocks 0-2 of that row hold zeros only: nothing to round there
    assert rounded_block("w13", packed, scales) is None


def test_shapes_humming_takes_unpadded():
    check_shape(7168, 3072)
    with pytest.raises(ValueError, match="% 128 == 0 .* MEGA_EXPERTS_GEMM=triton"):
        check_shape(7168, 3000)
