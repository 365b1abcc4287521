"""Builds the DeepGEMM source bundle the ``deepgemm_block_fp8`` peer needs on the GPU machine (issue 61 item 5).

Why a source bundle: DeepGEMM ships no wheel for the device's torch (2.11, cu130), vLLM's bundled copy has no
compiled extension there ("Expected one _C_extension*.so file, found 0"), and the GPU machine cannot download.
DeepGEMM is a small C++ extension (``deep_gemm._C``: its Python API and host-side JIT, one translation unit) plus
CUDA kernels it JIT-compiles with the machine's NVCC at first use, against CUTLASS / CuTe headers. So this packs
the source: DeepGEMM at its snapshot's HEAD, its two submodules at the commits that HEAD pins (CUTLASS's
``include/`` only, {fmt}'s ``include/`` only), as one ``tar.xz`` (~3 MB). ``deepgemm_setup.sh`` unpacks it on the
device, copies CuTe / CUTLASS into ``deep_gemm/include`` (what DeepGEMM's own ``build_py`` step does, so its JIT
finds them) and builds ``deep_gemm._C`` in place against the device's torch (``setup.py build_ext --inplace``).

    python3 benchmarks/research/deepgemm_bundle.py --out /work/main/.deepgemm \\
        [--deepgemm DIR] [--cutlass DIR] [--fmt DIR]     # git directories (default: the fetch tool's mirrors)

Writes ``OUT/deepgemm.tar.xz`` and ``OUT/BUNDLE.json`` (the three commits, the file counts, the size).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import tarfile
from pathlib import Path

MIRRORS = Path("/work/.mirror")
DEFAULTS = {"deepgemm": MIRRORS / "deepseek-ai+DeepGEMM/repo", "cutlass": MIRRORS / "NVIDIA+cutlass/repo",
            "fmt": MIRRORS / "fmtlib+fmt/repo"}
SUBMODULES = {"cutlass": "third-party/cutlass", "fmt": "third-party/fmt"}  # DeepGEMM's .gitmodules paths


def git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def archive(repo: Path, rev: str, path: str | None = None) -> tarfile.TarFile:
    """``git archive`` of ``rev`` (``path`` only, if given) as an open tar."""
    data = git(repo, "archive", "--format=tar", rev, *([path] if path else []))
    return tarfile.open(fileobj=io.BytesIO(data))


def pinned_commit(deepgemm: Path, head: str, submodule_path: str) -> str:
    """The commit DeepGEMM's tree at ``head`` pins for a submodule (a gitlink entry)."""
    line = git(deepgemm, "ls-tree", head, submodule_path).decode().split()
    if len(line) < 3 or line[1] != "commit":
        raise SystemExit(f"{submodule_path} is not a submodule in DeepGEMM {head}: {line}")
    return line[2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    for name, default in DEFAULTS.items():
        ap.add_argument(f"--{name}", type=Path, default=default, help=f"git directory of {name}")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = git(args.deepgemm, "rev-parse", "HEAD").decode().strip()
    record = {"deepgemm": {"commit": head, "subject": git(args.deepgemm, "log", "-1", "--format=%s").decode().strip()}}
    counts = {}
    with tarfile.open(out / "deepgemm.tar.xz", "w:xz") as tar:
        def add_all(src: tarfile.TarFile, prefix: str, what: str) -> None:
            n = 0
            for member in src.getmembers():
                if not member.isfile():  # directories are implied; the three trees hold no links
                    continue
                data = src.extractfile(member)
                member.name = f"DeepGEMM/{prefix}{member.name}"
                tar.addfile(member, data)
                n += 1
            counts[what] = n

        add_all(archive(args.deepgemm, head), "", "deepgemm")
        for name, sub in SUBMODULES.items():
            commit = pinned_commit(args.deepgemm, head, sub)
            record[name] = {"commit": commit, "path": f"{sub}/include"}
            add_all(archive(getattr(args, name), commit, "include"), f"{sub}/", name)
    record["files"] = counts
    record["bytes"] = (out / "deepgemm.tar.xz").stat().st_size
    (out / "BUNDLE.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
