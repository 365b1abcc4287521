"""Capability detection with injected probes: torch build, gfx arch, packages, aiter signatures."""

from __future__ import annotations

from types import SimpleNamespace

from megamoe_backend.platform import aiter_reads_force_a8w4, detect_facts, next_power_of_two, probe_aiter_caps
from megamoe_backend.platform.facts import AiterCaps


def fake_torch(hip=None, cuda=None, available=True, arch="gfx950:sramecc+:xnack-", count=8):
    props = SimpleNamespace(gcnArchName=arch)
    return SimpleNamespace(
        __version__="2.9.0",
        version=SimpleNamespace(hip=hip, cuda=cuda),
        cuda=SimpleNamespace(is_available=lambda: available, device_count=lambda: count, get_device_properties=lambda i: props),
    )


def test_rocm_build_with_gpu_reports_arch_without_target_features_and_probes_aiter():
    probed = []
    caps = AiterCaps(v2_init=("rank",))
    facts = detect_facts(
        fake_torch(hip="7.0.0"),
        env={"AITER_FORCE_A8W4": "1"},
        find_spec=lambda m: m in ("mori", "aiter"),
        dist_version=lambda d: {"amd-mori": "1.2.4", "amd-aiter": "0.1.10"}.get(d),
        aiter_probe=lambda: probed.append(1) or caps,
    )
    assert (facts.device, facts.torch_build, facts.gfx_arch, facts.gpu_count) == ("rocm", "rocm", "gfx950", 8)
    assert facts.has("mori") and facts.version("mori") == "1.2.4" and not facts.has("triton")
    assert facts.aiter_caps is caps and probed == [1]
    assert facts.aiter_force_a8w4_raw == "1"
    text = "\n".join(facts.describe())
    assert "HIP 7.0.0" in text and "mori: 1.2.4" in text and "MegaMoEV2: yes" in text


def test_rocm_build_without_gpu_is_cpu_and_does_not_import_aiter():
    facts = detect_facts(fake_torch(hip="7.0.0", available=False), env={}, find_spec=lambda m: True,
                         dist_version=lambda d: None, aiter_probe=lambda: (_ for _ in ()).throw(AssertionError("probed")))
    assert (facts.device, facts.torch_build, facts.gfx_arch) == ("cpu", "rocm", None)


def test_cuda_build_has_no_gfx_arch():
    facts = detect_facts(fake_torch(cuda="12.8"), env={}, find_spec=lambda m: m == "triton", dist_version=lambda d: None)
    assert (facts.device, facts.gfx_arch, facts.has("triton")) == ("cuda", None, True)


def test_this_machine_is_cpu():
    facts = detect_facts()
    assert facts.device == "cpu" and not facts.has("mori")


def test_probe_aiter_caps_reads_signatures_of_the_installed_classes(fakes):
    caps = probe_aiter_caps()
    assert caps.has_v2 and caps.has_gfx1250
    assert "max_tok_per_rank" in caps.v2_init and {"w1", "config_tokens", "mask_invalid_slots"} <= set(caps.v2_forward)
    assert not caps.v2_has_set_weights and not caps.v2_accepts_a4w4
    assert "dispatch_backend" in caps.gfx1250_init and "dispatch_wire" not in caps.gfx1250_init


def test_probe_aiter_caps_without_aiter():
    def missing(name):
        raise ImportError(name)

    caps = probe_aiter_caps(import_module=missing)
    assert not caps.has_v2 and not caps.has_gfx1250


def test_aiter_force_a8w4_is_read_as_aiter_reads_it():
    assert [aiter_reads_force_a8w4(v) for v in (None, "0", "1", "", "true", "11")] == [False, False, True, True, False, False]


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
