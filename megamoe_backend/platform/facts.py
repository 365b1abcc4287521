"""What this machine can run: torch build, GPU arch, installed packages, the raw env values aiter reads.

Why a frozen bag of facts: backend selection must be testable without the hardware. Everything
that touches torch.cuda, importlib or os.environ happens in :func:`detect_facts`, whose every
probe can be injected; selection (``select.py``) is a pure function of these facts and the knobs.
The EP group's topology (one host? peer access?) needs the group, so it is gathered apart
(``topology.py``) and injected as ``ep_topology``.

None of this has been run on an AMD GPU; the ROCm probes follow torch's and aiter's published
APIs (``torch.version.hip``, ``get_device_properties().gcnArchName``, ``inspect.signature``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .rocm_probes import installed_builder_takes_a_dtype
from .topology import EpTopology

# Package key -> (importable top-level module, distribution names in preference order).
PACKAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mori": ("mori", ("amd-mori", "amd-mori-nightly", "mori")),
    "aiter": ("aiter", ("amd-aiter", "aiter")),
    "flydsl": ("flydsl", ("flydsl",)),
    "triton": ("triton", ("triton", "pytorch-triton-rocm")),
}

# aiter modules holding the fused MegaMoE runtimes (lazy packages: importing them is cheap).
AITER_V2_MODULE = "aiter.ops.flydsl.kernels.mega_moe"
AITER_GFX1250_MODULE = "aiter.ops.flydsl.kernels.mega_moe_gfx1250"


@dataclass(frozen=True)
class PackageInfo:
    name: str
    importable: bool
    version: str | None = None  # distribution version, None when no distribution metadata


@dataclass(frozen=True)
class AiterCaps:
    """What the installed aiter's MegaMoE classes accept, read from their signatures.

    Why signatures: aiter's MegaMoE API moved within weeks (dispatch_wire / combine_quant appeared
    in later revisions); passing an argument the installed class lacks is a TypeError at model load,
    and silently not passing one ships the wrong wire. ``None`` means "class not importable".
    """

    v2_init: tuple[str, ...] | None = None
    v2_forward: tuple[str, ...] | None = None
    v2_has_set_weights: bool = False
    v2_accepts_a4w4: bool = False  # the plan builder takes a_dtype= (rocm_probes.installed_builder_takes_a_dtype)
    gfx1250_init: tuple[str, ...] | None = None
    gfx1250_forward: tuple[str, ...] | None = None

    @property
    def has_v2(self) -> bool:
        return self.v2_init is not None

    @property
    def has_gfx1250(self) -> bool:
        return self.gfx1250_init is not None


@dataclass(frozen=True)
class PlatformFacts:
    device: str  # "rocm" | "cuda" | "cpu": where this process's tensors will live
    torch_build: str  # "rocm" | "cuda" | "cpu": what torch was compiled for
    torch_version: str = ""
    hip_version: str | None = None
    cuda_version: str | None = None
    gfx_arch: str | None = None  # "gfx950", "gfx1250", ... (target features stripped)
    gpu_count: int = 0
    packages: Mapping[str, PackageInfo] = field(default_factory=dict)
    aiter_caps: AiterCaps = field(default_factory=AiterCaps)
    # Raw env strings read by aiter/mori themselves (not by our Knobs): their parsing differs.
    aiter_force_a8w4_raw: str | None = None
    mori_fp8_combine_scale_dim_raw: str | None = None
    # Where the EP ranks run (host, GPU, peer access): gathered over the EP group at start-up
    # (platform/topology.py); None where no group is at hand (planning, ``megamoe info``).
    ep_topology: EpTopology | None = None

    def has(self, name: str) -> bool:
        info = self.packages.get(name)
        return bool(info and info.importable)

    def version(self, name: str) -> str | None:
        info = self.packages.get(name)
        return info.version if info else None

    def describe(self) -> list[str]:
        """Human lines for ``megamoe info``."""
        lines = [
            f"torch {self.torch_version} ({self.torch_build} build"
            + (f", HIP {self.hip_version}" if self.hip_version else "")
            + (f", CUDA {self.cuda_version}" if self.cuda_version else "")
            + ")",
            f"device: {self.device}" + (f" x{self.gpu_count} {self.gfx_arch}" if self.gfx_arch else ""),
        ]
        for key in PACKAGES:
            info = self.packages.get(key)
            if info is None or not info.importable:
                lines.append(f"{key}: not importable")
            else:
                lines.append(f"{key}: {info.version or 'importable (no distribution metadata)'}")
        if self.has("aiter"):
            caps = self.aiter_caps
            lines.append(f"aiter MegaMoEV2: {'yes' if caps.has_v2 else 'no'}; MegaMoEGfx1250: {'yes' if caps.has_gfx1250 else 'no'}")
        return lines


def device_kind(device) -> str:
    """"cuda" | "rocm" | "cpu": the platform a tensor on ``device`` runs on (a ROCm torch names its
    GPUs "cuda" too). The one place the plugins and the layer ask; CPU tests of the engines' start-up
    replace it here to plan as a GPU host does."""
    import torch

    if getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def _default_find_spec(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _default_dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_packages(
    find_spec: Callable[[str], bool] = _default_find_spec,
    dist_version: Callable[[str], str | None] = _default_dist_version,
) -> dict[str, PackageInfo]:
    out = {}
    for key, (module, dists) in PACKAGES.items():
        version = next((v for v in (dist_version(d) for d in dists) if v), None)
        out[key] = PackageInfo(key, find_spec(module), version)
    return out


def _param_names(fn) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def probe_aiter_caps(import_module: Callable[[str], object] = importlib.import_module) -> AiterCaps:
    """Read the installed MegaMoE classes' signatures. Imports aiter; call only on a ROCm box."""
    v2_init = v2_forward = g_init = g_forward = None
    has_set_weights = accepts_a4w4 = False
    try:
        cls = import_module(AITER_V2_MODULE).MegaMoEV2
        v2_init, v2_forward = _param_names(cls.__init__), _param_names(cls.forward)
        has_set_weights = callable(getattr(cls, "set_weights", None))
        accepts_a4w4 = installed_builder_takes_a_dtype(import_module)
    except (ImportError, AttributeError, OSError, RuntimeError):
        pass
    try:
        cls = import_module(AITER_GFX1250_MODULE).MegaMoEGfx1250
        g_init, g_forward = _param_names(cls.__init__), _param_names(cls.forward)
    except (ImportError, AttributeError, OSError, RuntimeError):
        pass
    return AiterCaps(v2_init, v2_forward, has_set_weights, accepts_a4w4, g_init, g_forward)


def _gfx_from_props(props) -> str | None:
    name = getattr(props, "gcnArchName", None)
    if not name:
        return None
    return str(name).split(":")[0]


def detect_facts(
    torch_module=None,
    env: Mapping[str, str] | None = None,
    find_spec: Callable[[str], bool] = _default_find_spec,
    dist_version: Callable[[str], str | None] = _default_dist_version,
    aiter_probe: Callable[[], AiterCaps] | None = None,
) -> PlatformFacts:
    """Gather facts; every side-effecting probe can be replaced (tests pass fakes)."""
    if torch_module is None:
        import torch as torch_module
    env = os.environ if env is None else env
    version = getattr(torch_module, "version", None)
    hip = getattr(version, "hip", None)
    cuda = getattr(version, "cuda", None)
    build = "rocm" if hip else ("cuda" if cuda else "cpu")
    available = build != "cpu" and bool(torch_module.cuda.is_available())
    gpu_count = int(torch_module.cuda.device_count()) if available else 0
    gfx = _gfx_from_props(torch_module.cuda.get_device_properties(0)) if available and build == "rocm" else None
    packages = detect_packages(find_spec, dist_version)
    caps = AiterCaps()
    if build == "rocm" and available and packages["aiter"].importable:
        caps = (aiter_probe or probe_aiter_caps)()
    return PlatformFacts(
        device=build if available else "cpu",
        torch_build=build,
        torch_version=str(getattr(torch_module, "__version__", "")),
        hip_version=hip,
        cuda_version=cuda,
        gfx_arch=gfx,
        gpu_count=gpu_count,
        packages=packages,
        aiter_caps=caps,
        aiter_force_a8w4_raw=env.get("AITER_FORCE_A8W4"),
        mori_fp8_combine_scale_dim_raw=env.get("MORI_FP8_COMBINE_SCALE_DIM"),
    )
