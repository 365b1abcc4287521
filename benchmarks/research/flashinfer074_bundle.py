"""Builds the FlashInfer 0.7.4 bundle the ``flashinfer_megamoe_sm90`` peer needs on the GPU machine (issue 58 item 2).

Why a bundle: the GPU machine has no network and a device call carries at most 64 MiB, while FlashInfer 0.7.4's
wheel alone is 101 MB (715 MB unpacked, most of it JIT sources) and its fused SM90 MegaMoE is CuTe DSL, compiled
at the first forward by nvidia-cutlass-dsl (a 92 MB wheel). So this keeps what that one path can import, packs
it as one ``tar.xz`` of wheels and splits the archive, byte for byte, into ``part1``, ``part2``, ... of at most
``--chunk-mib`` MiB each: one part per device call, put back together by ``flashinfer074_setup.sh`` with ``cat``.

What is in it (wheels, re-zipped uncompressed so that xz, not deflate, compresses them; contents unchanged):

- ``flashinfer_python-0.7.4``, trimmed: every directory of the package that holds no module the path can import
  is dropped (``import_walk.py``: an over-approximation, every import at any depth of every reachable module,
  plus module names written as strings), which drops ``flashinfer/data`` (JIT sources, 450 MB), the other
  architectures' kernel drops, the ``cake_*`` and ``experimental/*`` backends the path never reaches and their
  CUDA sources. The wheel's RECORD is written anew for the files kept. The path's entries: ``flashinfer``
  (its ``__init__`` imports most top-level modules), ``flashinfer.moe_ep`` (its ``__init__`` imports every
  backend's config, the ``experimental`` cake one included), the SM90 MXFP4 backend, and the SM90 kernel drop,
  whose ``shim`` puts its ``src/`` on ``sys.path`` (indexed here as top-level modules, as Python finds them).
- FlashInfer's prebuilt ``fused_moe_90`` module, as ``flashinfer/data/aot/fused_moe_90/fused_moe_90.so``: the
  MegaMoE backend's weight preparation calls ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4_fp8")``, an
  op of the CUTLASS fused-MoE JIT module (a 30+ minute nvcc build from ``data/csrc``). It is taken from the
  project's 0.7.2.post1 peer build (``.peers/flashinfer/aot.tar.xz``, ../shared/peers/README.md): the op's
  source, its error text and its Python caller (``fused_moe/prepare.py``'s Humming path) are the same in both
  releases; FLASHINFER_DISABLE_JIT=1 (set by the setup) makes a mismatch fail loudly instead of building.
- ``nvidia-cutlass-dsl-libs-base`` / ``-libs-core`` / ``-libs-cu13`` 4.8.1 (cp312): the CuTe DSL and its
  MLIR compiler. The ``nvidia-cutlass-dsl`` meta wheel only adds a ``.pth`` (not read from a ``--target``
  directory): the setup puts ``nvidia_cutlass_dsl/dsl_packages`` on PYTHONPATH instead.
- ``apache-tvm-ffi`` 0.1.15.post2 (cp312): FlashInfer's module loader.

Not in it, and why (read in 0.7.4's sources): ``nvshmem4py`` / ``nccl4py`` / ``nccl-extensions``: only an EP
group across processes needs them (``core/runtime/bootstrap.py``: ``MEGA_NO_DIST=1`` makes the ep_size-1
workspace plain CUDA memory); ``cuda-tile``, ``nvidia-cudnn-frontend``: other backends'; ``cuda-bindings``,
``cuda-core``, ``numpy``, ``nvidia-ml-py``, ``einops``, ``protobuf``, ``typing-extensions``: on the device image.

    PYTHONPATH=. python3 benchmarks/research/flashinfer074_bundle.py --out /work/main/.fi074 \\
        [--check-path DIR ...]   # also import the trimmed tree here (CPU torch) and record it in BUNDLE.json

Writes ``OUT/part1 .. partN``, ``OUT/SHA256`` (the archive's sha256 and the part count, checked by the setup)
and ``OUT/BUNDLE.json`` (what was kept and dropped, sizes, sources). Needs ``xz`` on PATH.
"""

from __future__ import annotations

import argparse
import base64
import csv
import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_walk import closure, index_modules, prune_dirs  # noqa: E402

MAIN = Path("/work/main")
BACKEND = "flashinfer.moe_ep.backends.mega.kernel.sm90.fp8_mxfp4_bf16_pull_cutedsl"
DROP = "flashinfer.moe_ep.kernel_src.sm90.pull_style_cutedsl_megakernel"
DROP_SRC = Path(*DROP.split(".")) / "src"  # on sys.path at run time (the drop's shim/_paths.py)
ENTRIES = ("flashinfer", "flashinfer.moe_ep", BACKEND, f"{BACKEND}.backend", DROP, "flashinfer.fused_moe.prepare")
AOT_MEMBERS = ("flashinfer/data/aot/fused_moe_90/fused_moe_90.so", "flashinfer/data/aot/fused_moe_90/trim_manifest.json")
DEFAULTS = {
    "flashinfer": "/tmp/fi074/flashinfer_python-0.7.4-py3-none-any.whl",
    "wheels": ["/tmp/fidep312/nvidia_cutlass_dsl_libs_base-4.8.1-cp312-*.whl",
               "/tmp/fidep312/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-*.whl",
               "/tmp/fidep312*/nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl",
               f"{MAIN}/.peers/flashinfer/apache_tvm_ffi-*-cp312-*.whl"],
    "aot": f"{MAIN}/.peers/flashinfer/aot.tar.xz",
}
CHECK_IMPORTS = ("flashinfer.moe_ep", BACKEND + ".backend", DROP, "flashinfer.fused_moe.prepare")
# the modules the first forward imports (CuTe DSL at module level): checked where cutlass imports
CHECK_KERNEL_IMPORTS = (f"{DROP}.shim.hopper_mxfp4", "moe_hopper_fp8.kernel_mxfp4_fp8_glu_fc12_swapab")


# ------------------------------------------------------------------------------------- trimming
def trim_flashinfer(tree: Path) -> dict:
    """Drop, in an unpacked FlashInfer wheel at ``tree``, every directory of ``flashinfer/`` holding no module
    the MegaMoE path can import (import_walk); return what was kept and dropped."""
    index = index_modules(tree)
    for name, path in index_modules(tree / DROP_SRC).items():
        index.setdefault(name, path)
    reached = closure(ENTRIES, index)
    keep_files = {index[m] for m in reached}
    dropped = prune_dirs(tree / "flashinfer", keep_files)
    sizes = {str(d.relative_to(tree)): sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in dropped}
    for d in dropped:
        shutil.rmtree(d)
    missing = sorted(m for m in reached if not index[m].exists())
    if missing:
        raise RuntimeError(f"trimming removed reachable modules: {missing[:10]}")
    return {"entries": list(ENTRIES), "modules_indexed": len(index), "modules_reachable": len(reached),
            "dropped_dirs": len(dropped), "dropped_bytes": sum(sizes.values()),
            "dropped_largest": dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:40]),
            "top_level_reachable": sorted({m.split(".")[0] for m in reached})}


def add_aot(tree: Path, aot_tar: Path) -> list[str]:
    """FlashInfer's prebuilt fused_moe_90 module from ``aot_tar`` into the tree, where FlashInfer's loader
    looks first (``jit/env.py``: ``flashinfer/data/aot/<name>/<name>.so``)."""
    out = []
    with tarfile.open(aot_tar) as tar:
        for name in AOT_MEMBERS:
            member = tar.getmember(name)
            dest = tree / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(member).read())
            dest.chmod(0o755 if name.endswith(".so") else 0o644)
            out.append(name)
    return out


# --------------------------------------------------------------------------------------- wheels
def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(tree: Path, out: Path) -> int:
    """Zip an unpacked wheel ``tree`` (one ``*.dist-info``) as ``out``, uncompressed, with its RECORD written
    anew for the files it holds now; returns the number of files."""
    dist_info = [p for p in tree.iterdir() if p.name.endswith(".dist-info")]
    if len(dist_info) != 1:
        raise ValueError(f"{tree}: expected one .dist-info, found {[p.name for p in dist_info]}")
    record_name = f"{dist_info[0].name}/RECORD"
    files = sorted(p for p in tree.rglob("*") if p.is_file() and p.relative_to(tree).as_posix() != record_name)
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for path in files:
            rel = path.relative_to(tree).as_posix()
            data = path.read_bytes()
            info = zipfile.ZipInfo(rel, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (path.stat().st_mode & 0o777 | 0o100000) << 16
            zf.writestr(info, data)
            writer.writerow([rel, _record_hash(data), len(data)])
        writer.writerow([record_name, "", ""])
        zf.writestr(zipfile.ZipInfo(record_name, date_time=(2026, 1, 1, 0, 0, 0)), rows.getvalue())
    return len(files) + 1


def restore_stored(src: Path, out: Path) -> None:
    """The wheel ``src`` re-zipped uncompressed as ``out``: the same entries, bytes and modes (RECORD stays valid)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)  # before the copy below: zin's own ZipInfo must keep its compression
            stored = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            stored.external_attr, stored.compress_type = info.external_attr, zipfile.ZIP_STORED
            zout.writestr(stored, data)


# ------------------------------------------------------------------------------ archive and parts
def split(archive: Path, out_dir: Path, chunk_bytes: int) -> list[Path]:
    """``archive`` cut into ``out_dir/part1 .. partN`` of at most ``chunk_bytes`` each (old parts removed);
    ``cat part1 part2 ...`` gives the archive back."""
    for old in out_dir.glob("part*"):
        old.unlink()
    parts = []
    with open(archive, "rb") as f:
        while chunk := f.read(chunk_bytes):
            part = out_dir / f"part{len(parts) + 1}"
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_imports(tree: Path, extra_paths: list[str]) -> dict:
    """Import the trimmed tree's entry modules in a fresh interpreter (this machine's torch; no GPU needed: the
    path keeps CUDA and CuTe DSL imports inside functions). Extra paths: what the device image has and this
    machine may not (nvidia-ml-py), and a CuTe DSL built for this interpreter, if any, to import the kernel's
    own modules too."""
    code = ("import importlib, json, sys\nout = {}\n"
            f"for name in {list(CHECK_IMPORTS)!r}:\n"
            "    try:\n        importlib.import_module(name); out[name] = 'ok'\n"
            "    except Exception as exc:\n        out[name] = f'{type(exc).__name__}: {exc}'\n"
            "try:\n    import cutlass.cute\n    cute = True\nexcept Exception:\n    cute = False\n"
            f"for name in {list(CHECK_KERNEL_IMPORTS)!r}:\n"
            "    if not cute:\n        out[name] = 'not checked: no cutlass (CuTe DSL) in this interpreter'; continue\n"
            "    try:\n        importlib.import_module(name); out[name] = 'ok'\n"
            "    except Exception as exc:\n        out[name] = f'{type(exc).__name__}: {exc}'\n"
            "print(json.dumps(out))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *extra_paths]), "FLASHINFER_DISABLE_JIT": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}


def _one(pattern: str) -> Path:
    found = sorted(glob.glob(pattern))
    if len(found) != 1:
        raise FileNotFoundError(f"{pattern}: expected one file, found {found}")
    return Path(found[0])


def build(args) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"sources": {}}
    with tempfile.TemporaryDirectory(prefix="fi074-bundle-") as tmp:
        tmp = Path(tmp)
        fi_wheel = _one(args.flashinfer)
        tree = tmp / "flashinfer_tree"
        with zipfile.ZipFile(fi_wheel) as zf:
            zf.extractall(tree)
        report["sources"][fi_wheel.name] = sha256_file(fi_wheel)
        report["trim"] = trim_flashinfer(tree)
        aot = _one(args.aot)
        report["aot"] = {"from": str(aot), "sha256": sha256_file(aot), "members": add_aot(tree, aot)}
        if args.check_path is not None:
            report["import_check"] = check_imports(tree, args.check_path)
            if any(v != "ok" and not v.startswith("not checked") for v in report["import_check"].values()):
                raise RuntimeError(f"the trimmed tree does not import: {report['import_check']}")
        wheels = tmp / "wheels"
        wheels.mkdir()
        report["files_in_flashinfer_wheel"] = write_wheel(tree, wheels / fi_wheel.name)
        shutil.rmtree(tree)
        for pattern in args.wheels:
            src = _one(pattern)
            report["sources"][src.name] = sha256_file(src)
            restore_stored(src, wheels / src.name)
        report["wheels"] = {p.name: p.stat().st_size for p in sorted(wheels.iterdir())}
        (wheels / "BUNDLE.json").write_text(json.dumps(report, indent=1))
        archive = tmp / "fi074.tar.xz"
        with open(archive, "wb") as f:  # tar | xz, streamed
            tar = subprocess.Popen(["tar", "--sort=name", "-C", str(tmp), "-cf", "-", "wheels"], stdout=subprocess.PIPE)
            subprocess.run(["xz", f"-T{args.threads}", f"-{args.level}", "-c"], stdin=tar.stdout, stdout=f, check=True)
            tar.stdout.close()
            if tar.wait() != 0:
                raise RuntimeError("tar failed")
        parts = split(archive, out_dir, int(args.chunk_mib * 2**20))
        digest = sha256_file(archive)
    (out_dir / "SHA256").write_text(f"{digest}  fi074.tar.xz\nparts {len(parts)}\n")
    report["archive"] = {"sha256": digest, "parts": {p.name: p.stat().st_size for p in parts}}
    (out_dir / "BUNDLE.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(MAIN / ".fi074"), help="folder of part1 .. partN (default: %(default)s)")
    ap.add_argument("--chunk-mib", type=float, default=50.0,
                    help="largest part in MiB (default: %(default)s: with the ~10 MiB working tree, under a call's 64 MiB)")
    ap.add_argument("--flashinfer", default=DEFAULTS["flashinfer"], help="the flashinfer-python 0.7.4 wheel")
    ap.add_argument("--wheels", nargs="+", default=DEFAULTS["wheels"], help="the other wheels (globs, one match each)")
    ap.add_argument("--aot", default=DEFAULTS["aot"], help="tar holding flashinfer/data/aot/fused_moe_90/")
    ap.add_argument("--check-path", nargs="*", default=None, metavar="DIR",
                    help="import the trimmed tree here first, with these extra PYTHONPATH entries")
    ap.add_argument("--level", type=int, default=6, help="xz preset (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="xz threads, 0: all cores")
    args = ap.parse_args(argv)
    report = build(args)
    print(json.dumps({"archive": report["archive"], "wheels": report["wheels"],
                      "dropped_bytes": report["trim"]["dropped_bytes"],
                      "import_check": report.get("import_check")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
