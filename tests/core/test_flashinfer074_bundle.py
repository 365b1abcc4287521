"""benchmarks/research/import_walk.py and the FlashInfer 0.7.4 bundle (flashinfer074_bundle.py / _setup.sh) on
CPU, on small planted packages: the import walk finds lazy, relative, string-named and sys.path-vendored imports
and keeps nothing else; a trimmed wheel's RECORD matches its files; the parts add up to the archive byte for
byte; the setup script puts the parts back together, refuses a wrong or missing part, installs with pip into
its target only and prints the exports to use. The real bundle is built by the script itself (its BUNDLE.json
records the trim and a CPU import of the trimmed tree)."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

RESEARCH = Path(__file__).resolve().parents[2] / "benchmarks" / "research"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, RESEARCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


walk = _load("import_walk")
bundle = _load("flashinfer074_bundle")


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


PLANTED = {
    "pkg/__init__.py": "from . import a\n",
    "pkg/a.py": "def f():\n    from .sub import b  # lazy\n    return b\n",
    "pkg/sub/__init__.py": "",
    "pkg/sub/b.py": "import importlib\nLAZY = importlib.import_module('pkg.lazy')\n",
    "pkg/lazy.py": "def g():\n    import importlib\n    return importlib.import_module('.rel', __package__)\n",
    "pkg/rel.py": "from pkg.drop import shim\n",
    "pkg/drop/__init__.py": "",
    "pkg/drop/shim.py": "def h():\n    from common.consts import X  # src/ is on sys.path at run time\n    return X\n",
    "pkg/drop/src/common/__init__.py": "",
    "pkg/drop/src/common/consts.py": "X = 1\n",
    "pkg/drop/src/other/__init__.py": "",
    "pkg/unused/__init__.py": "import pkg.a\n",
    "pkg/unused/deep/x.py": "",
    "pkg/csrc/kernel.cu": "// JIT source\n",
    "pkg/sub/data.json": "{}",
}


def test_the_walk_finds_lazy_relative_string_and_vendored_imports(tmp_path):
    _write(tmp_path, PLANTED)
    index = walk.index_modules(tmp_path)
    index.update({k: v for k, v in walk.index_modules(tmp_path / "pkg/drop/src").items() if k not in index})
    reached = walk.closure(["pkg"], index)
    assert reached == {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.lazy", "pkg.rel", "pkg.drop", "pkg.drop.shim",
                       "common", "common.consts"}
    dropped = {p.relative_to(tmp_path).as_posix() for p in walk.prune_dirs(tmp_path / "pkg", {index[m] for m in reached})}
    # no reachable module below: gone whole (the vendored package nobody imports, JIT sources, unused code)
    assert dropped == {"pkg/csrc", "pkg/drop/src/other", "pkg/unused"}
    with pytest.raises(KeyError, match="not found"):
        walk.closure(["pkg.nope"], index)


def test_a_module_named_in_an_unrelated_string_is_kept_too(tmp_path):
    """Over-approximation by design: a string equal to a module's name keeps that module."""
    _write(tmp_path, {"p/__init__.py": "NOTE = 'p.extra'\n", "p/extra.py": "", "p/far/__init__.py": ""})
    index = walk.index_modules(tmp_path)
    assert walk.closure(["p"], index) == {"p", "p.extra"}


def _record(zf: zipfile.ZipFile, name: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(zf.read(name).decode())))


def test_a_trimmed_wheel_has_a_record_of_exactly_its_files(tmp_path):
    tree = tmp_path / "tree"
    _write(tree, {"probe/__init__.py": "V = 1\n", "probe/data/x.bin": "xyz",
                  "probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: probe\nVersion: 1.0\n",
                  "probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
                  "probe-1.0.dist-info/RECORD": "stale,sha256=x,1\n"})
    out = tmp_path / "probe-1.0-py3-none-any.whl"
    assert bundle.write_wheel(tree, out) == 5
    with zipfile.ZipFile(out) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        rows = _record(zf, "probe-1.0.dist-info/RECORD")
        assert sorted(r[0] for r in rows) == sorted(zf.namelist())
        for name, digest, size in rows:
            if digest:
                data = zf.read(name)
                want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert digest == f"sha256={want}" and int(size) == len(data)
    deflated, stored = tmp_path / "deflated.whl", tmp_path / "stored.whl"  # a wheel as PyPI serves it -> stored
    with zipfile.ZipFile(out) as a, zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as d:
        for info in a.infolist():
            d.writestr(info.filename, a.read(info), compress_type=zipfile.ZIP_DEFLATED)
    bundle.restore_stored(deflated, stored)
    with zipfile.ZipFile(out) as a, zipfile.ZipFile(stored) as b:
        assert [(i.filename, a.read(i)) for i in a.infolist()] == [(i.filename, b.read(i)) for i in b.infolist()]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in b.infolist())


def test_parts_are_plain_byte_slices_of_the_archive(tmp_path):
    archive = tmp_path / "a.bin"
    archive.write_bytes(os.urandom(1000))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "part9").write_text("stale")
    parts = bundle.split(archive, tmp_path / "out", 300)
    assert [p.name for p in parts] == ["part1", "part2", "part3", "part4"]
    assert [p.stat().st_size for p in parts] == [300, 300, 300, 100]
    assert b"".join(p.read_bytes() for p in parts) == archive.read_bytes()
    assert not (tmp_path / "out" / "part9").exists()


def _synthetic_bundle(tmp_path: Path, chunk: int) -> Path:
    """A bundle as the builder lays it out (wheels/*.whl + BUNDLE.json, tar.xz, parts, SHA256), with one small wheel."""
    tree = tmp_path / "tree"
    _write(tree, {"fi074probe/__init__.py": "WHO = 'fi074probe'\n",
                  "fi074probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fi074probe\nVersion: 1.0\n",
                  "fi074probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"})
    wheels = tmp_path / "stage" / "wheels"
    wheels.mkdir(parents=True)
    bundle.write_wheel(tree, wheels / "fi074probe-1.0-py3-none-any.whl")
    (wheels / "padding.bin").write_bytes(os.urandom(4000))  # more than one part
    (wheels / "BUNDLE.json").write_text("{}")
    archive = tmp_path / "fi074.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(wheels, arcname="wheels")
    out = tmp_path / "bundle"
    out.mkdir()
    parts = bundle.split(archive, out, chunk)
    (out / "SHA256").write_text(f"{bundle.sha256_file(archive)}  fi074.tar.xz\nparts {len(parts)}\n")
    return out


def _setup(bundle_dir: Path, target: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(target.parent)}
    return subprocess.run(["bash", str(RESEARCH / "flashinfer074_setup.sh"), str(bundle_dir), str(target)],
                          env=env, capture_output=True, text=True, timeout=300)


def test_setup_puts_the_parts_together_installs_and_prints_the_exports(tmp_path):
    bundle_dir = _synthetic_bundle(tmp_path, 1500)
    assert len(list(bundle_dir.glob("part*"))) >= 3
    target = tmp_path / "site"
    proc = _setup(bundle_dir, target)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (target / "fi074probe" / "__init__.py").is_file() and (target / "FI074_BUNDLE.json").is_file()
    lines = proc.stdout.strip().splitlines()
    assert all(line.startswith("export ") for line in lines)  # eval "$(...)" sets them, nothing else on stdout
    assert lines[0].startswith(f"export PYTHONPATH={target}:{target}/nvidia_cutlass_dsl/dsl_packages")
    assert "FLASHINFER_DISABLE_JIT=1" in proc.stdout and "MEGA_NO_DIST=1" in proc.stdout
    env = {**os.environ, "PYTHONPATH": str(target)}
    got = subprocess.run([sys.executable, "-c", "import fi074probe; print(fi074probe.WHO)"], env=env,
                         capture_output=True, text=True)
    assert got.stdout.strip() == "fi074probe"
    assert _setup(bundle_dir, target).returncode == 0  # a second run replaces the first (--upgrade)


def test_setup_refuses_a_missing_or_wrong_part(tmp_path):
    bundle_dir = _synthetic_bundle(tmp_path, 1500)
    parts = sorted(bundle_dir.glob("part*"), key=lambda p: int(p.name[4:]))
    parts[-1].unlink()
    proc = _setup(bundle_dir, tmp_path / "site")
    assert proc.returncode == 3 and "SHA256 says" in proc.stderr
    bundle_dir = _synthetic_bundle(tmp_path / "again", 1500)
    first = bundle_dir / "part1"
    first.write_bytes(first.read_bytes()[:-1] + b"\0")
    assert _setup(bundle_dir, tmp_path / "site2").returncode == 3
    assert _setup(tmp_path / "empty", tmp_path / "site3").returncode == 2
