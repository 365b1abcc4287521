#!/usr/bin/env bash
# Install the FlashInfer 0.7.4 bundle on the GPU machine (no network) for the flashinfer_megamoe_sm90 peer.
#
#     eval "$(bash benchmarks/research/flashinfer074_setup.sh /tmp/fi074)"      # BUNDLE_DIR [TARGET, default /tmp/fisite]
#
# Each part reaches the device in a call of its own (.fi074/partN carried) and is copied to BUNDLE_DIR there
# (`mkdir -p /tmp/fi074 && cp .fi074/* /tmp/fi074/`): a later call's carry replaces the whole .fi074 folder.
#
# BUNDLE_DIR holds part1 .. partN (benchmarks/research/flashinfer074_bundle.py cut one tar.xz into them, one per
# device call) and, if carried, SHA256. The parts are put back together with cat, checked against SHA256 (the
# archive's sha256 and the part count), unpacked, and their wheels installed with pip into TARGET only (nothing
# system-wide; --upgrade so a second run replaces the first). Progress goes to stderr; stdout is only the export
# lines to use, so `eval "$(...)"` sets them:
#   PYTHONPATH        TARGET and TARGET/nvidia_cutlass_dsl/dsl_packages (the CuTe DSL: its wheel's .pth is not
#                     read from a --target folder), before what was there;
#   LD_LIBRARY_PATH   torch's nvidia/cu13/lib and /usr/local/cuda/lib64 (FlashInfer's prebuilt fused_moe_90.so
#                     needs libcudart.so.13);
#   FLASHINFER_DISABLE_JIT=1  a missing prebuilt module fails at once instead of starting an nvcc build;
#   FLASHINFER_WORKSPACE_BASE, FLASHINFER_CUDA_ARCH_LIST=9.0a, MEGA_NO_DIST=1 (FlashInfer's single-rank mode).
# PYTHON (default python3) is the interpreter that will run the peer: its pip installs, its torch is read.
set -euo pipefail
D=${1:?usage: flashinfer074_setup.sh BUNDLE_DIR [TARGET]}
T=${2:-/tmp/fisite}
PY=${PYTHON:-python3}
W=$(mktemp -d "${TMPDIR:-/tmp}/fi074-setup.XXXXXX")
trap 'rm -rf "$W"' EXIT

n=0
while [ -f "$D/part$((n + 1))" ]; do n=$((n + 1)); done
[ "$n" -gt 0 ] || { echo "flashinfer074_setup: no $D/part1" >&2; exit 2; }
for ((i = 1; i <= n; i++)); do cat "$D/part$i"; done > "$W/fi074.tar.xz"
if [ -f "$D/SHA256" ]; then
  want=$(awk 'NR == 1 {print $1}' "$D/SHA256")
  want_parts=$(awk '$1 == "parts" {print $2}' "$D/SHA256")
  got=$(sha256sum "$W/fi074.tar.xz" | cut -d' ' -f1)
  if [ "$got" != "$want" ] || { [ -n "$want_parts" ] && [ "$want_parts" != "$n" ]; }; then
    echo "flashinfer074_setup: $n parts in $D (SHA256 says ${want_parts:-?}) give sha256 $got, not $want" >&2
    exit 3
  fi
else
  echo "flashinfer074_setup: no $D/SHA256, the $n parts are not checked" >&2
fi
tar -xJf "$W/fi074.tar.xz" -C "$W"
rm -f "$W/fi074.tar.xz"
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$T" "$W"/wheels/*.whl >&2
cp "$W/wheels/BUNDLE.json" "$T/FI074_BUNDLE.json"
SITE=$("$PY" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" 2>/dev/null || true)
echo "flashinfer074_setup: $n parts -> $T" >&2
echo "export PYTHONPATH=$T:$T/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export LD_LIBRARY_PATH=${SITE:+$SITE/nvidia/cu13/lib:}/usr/local/cuda/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi074-ws FLASHINFER_CUDA_ARCH_LIST=9.0a MEGA_NO_DIST=1"
