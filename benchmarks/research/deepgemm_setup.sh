#!/usr/bin/env bash
# Build DeepGEMM on the GPU machine (no network) for the deepgemm_block_fp8 peer, from the source bundle that
# benchmarks/research/deepgemm_bundle.py wrote (.deepgemm/deepgemm.tar.xz, carried).
#
#     eval "$(bash benchmarks/research/deepgemm_setup.sh .deepgemm)"      # BUNDLE_DIR [TARGET, default /tmp/deepgemm]
#
# Unpacks the bundle into TARGET, copies CuTe / CUTLASS into deep_gemm/include (DeepGEMM's build_py step does the
# same: its JIT includes that folder), and builds deep_gemm._C in place against the torch of PYTHON (default
# python3) with that machine's nvcc / g++ (setup.py build_ext --inplace; DG_USE_LOCAL_VERSION=0: no git there).
# A TARGET that already holds a built _C is kept (a warm machine builds once). Progress and the build log's tail
# go to stderr; stdout is only the export lines: PYTHONPATH (TARGET first) and DG_JIT_CACHE_DIR (the kernels
# DeepGEMM compiles at first use, kept while the machine is warm).
set -euo pipefail
D=${1:?usage: deepgemm_setup.sh BUNDLE_DIR [TARGET]}
T=${2:-/tmp/deepgemm}
PY=${PYTHON:-python3}
if ! ls "$T"/DeepGEMM/deep_gemm/_C*.so >/dev/null 2>&1; then
  rm -rf "$T" && mkdir -p "$T"
  tar -xJf "$D/deepgemm.tar.xz" -C "$T"
  cp "$D/BUNDLE.json" "$T/BUNDLE.json" 2>/dev/null || true
  cd "$T/DeepGEMM"
  cp -r third-party/cutlass/include/cute third-party/cutlass/include/cutlass deep_gemm/include/
  s=$SECONDS
  if ! DG_USE_LOCAL_VERSION=0 MAX_JOBS=16 "$PY" setup.py build_ext --inplace > "$T/build.log" 2>&1; then
    tail -40 "$T/build.log" >&2
    echo "deepgemm_setup: build failed (log $T/build.log)" >&2
    exit 3
  fi
  echo "deepgemm_setup: deep_gemm._C built in $((SECONDS - s)) s" >&2
fi
echo "export PYTHONPATH=$T/DeepGEMM\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export DG_JIT_CACHE_DIR=/tmp/deepgemm-jit"
