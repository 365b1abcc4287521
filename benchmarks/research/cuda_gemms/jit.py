"""Build the sm_90a expert GEMMs (frag8_sm90.cu) with the machine's nvcc at first use, cached on disk.

Why JIT: the kernels need the sm_90a target (wgmma, setmaxnreg) and nothing else of the CUDA toolkit,
so this research code ships source, as DeepGEMM and FlashInfer do, and a GPU host compiles it once (a few
seconds); the cubin is cached under ``MEGA_CUDA_CACHE_DIR`` (default ``~/.cache/megamoe/cuda``) by a
hash of the source, the generated wrappers and the nvcc version. ``MEGA_NVCC`` names the compiler
(default: ``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on PATH). A build that fails raises RuntimeError with
the reason (gemms.py hands it to experts.CudaFrag8Experts, which raises it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("frag8_sm90.cu")
WGMMA_NS = (16, 32, 64, 128)  # the token-side wgmma N the kernels pick per tile
ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
NVCC_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-Xptxas=-v")


@dataclass(frozen=True)
class Build:
    """A compiled cubin: its path, whether this call compiled it, and how long that took."""

    cubin: Path
    compiled: bool
    seconds: float
    ptxas_log: str


def wgmma_wrappers(ns: tuple[int, ...] = WGMMA_NS) -> str:
    """``mm_wgmma_rs<N>``: one m64nNk32 e4m3 x e4m3 -> f32 wgmma, A from four registers, B by descriptor.
    Generated because each N has N / 2 accumulator operands."""
    out = ["namespace mm {", "template <int N> __device__ __forceinline__ void mm_wgmma_rs(float* d, const uint32_t* a, uint64_t b);"]
    for n in ns:
        acc = n // 2
        regs = ", ".join(f"%{i}" for i in range(acc))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(acc))
        out.append(
            f"template <> __device__ __forceinline__ void mm_wgmma_rs<{n}>(float* d, const uint32_t* a, uint64_t b) {{\n"
            f"  asm volatile(\"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 "
            f"{{{regs}}}, {{%{acc}, %{acc + 1}, %{acc + 2}, %{acc + 3}}}, %{acc + 4}, 1, 1, 1;\"\n"
            f"               : {outs}\n"
            f"               : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(b) : \"memory\");\n"
            "}"
        )
    out.append("}  // namespace mm")
    return "\n".join(out) + "\n"


def full_source(defines: tuple[str, ...] = ()) -> str:
    """The translation unit nvcc compiles: the wrappers inserted after the kernel file's includes.
    ``defines``: preprocessor switches of the research probes (benchmarks/research/cuda_gemm_probe.py)."""
    text = SOURCE.read_text()
    marker = "namespace mm {"
    head, tail = text.split(marker, 1)
    lines = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines)  # NAME or NAME=VALUE
    return lines + head + wgmma_wrappers() + marker + tail


def nvcc_path() -> str | None:
    explicit = os.environ.get("MEGA_NVCC")
    if explicit:
        return explicit
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    return Path(os.environ.get("MEGA_CUDA_CACHE_DIR") or Path.home() / ".cache" / "megamoe" / "cuda")


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout


def build(nvcc: str | None = None, defines: tuple[str, ...] = ()) -> Build:
    """The cubin of full_source() for sm_90a; raises RuntimeError naming the cause when it cannot build."""
    nvcc = nvcc or nvcc_path()
    if not nvcc:
        raise RuntimeError("no nvcc found (set MEGA_NVCC or CUDA_HOME)")
    try:
        version = _nvcc_version(nvcc)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{nvcc} --version failed: {exc}") from exc
    src = full_source(defines)
    key = hashlib.sha256("\0".join((src, version, *ARCH_FLAGS, *NVCC_FLAGS)).encode()).hexdigest()[:20]
    out_dir = cache_dir()
    cubin = out_dir / f"frag8_sm90_{key}.cubin"
    if cubin.exists():
        return Build(cubin, False, 0.0, "")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        cu = Path(tmp) / "frag8_sm90.cu"
        cu.write_text(src)
        tmp_cubin = Path(tmp) / "out.cubin"
        cmd = [nvcc, *ARCH_FLAGS, *NVCC_FLAGS, "-cubin", "-o", str(tmp_cubin), str(cu)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"nvcc failed to run: {exc}") from exc
        if res.returncode != 0:
            raise RuntimeError(f"nvcc exited {res.returncode}: {(res.stderr or res.stdout).strip()[-2000:]}")
        os.replace(tmp_cubin, cubin)  # atomic: concurrent ranks building the same key both end with one file
    return Build(cubin, True, time.perf_counter() - t0, res.stderr)
