#!/usr/bin/env bash
# The GPU engine runs on the device, in one call each (docs/vllm.md, "On a GPU"):
#   bash tests/gpu_engine/run_on_device.sh matrix|startup|dp|kill|runs|serving OUT_DIR [DEADLINE_S] [runs: NAME=SPEC ... | serving args, e.g. --profile]
# Needs the vLLM 0.34 bundle carried as .engine-gpu (../shared/engine-gpu, its README) and, for
# `serving`, humming-kernels as a wheel in .whl (vLLM's default MXFP4 MoE backend on Hopper).
set -uo pipefail
what=${1:?matrix|startup|dp|kill|runs|serving}; out=${2:?OUT_DIR}; deadline=${3:-520}
cd "$(dirname "$0")/../.."
. .engine-gpu/setup_device.sh .engine-gpu || exit 3
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONPATH=.:plugins/vllm:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
specs() { python3 -c "import sys; sys.path.insert(0, 'tests/gpu_engine'); import gpu_engine_checks as c; print(' '.join(f'{k}={v}' for k, v in c.$1.items()))"; }
case $what in
  matrix)  python3 tests/gpu_engine/run_matrix.py --out "$out/gpu_engine_matrix.json" --deadline-s "$deadline" $(specs MATRIX) ;;
  startup) python3 tests/gpu_engine/run_matrix.py --out "$out/gpu_engine_startup.json" --deadline-s "$deadline" \
             default-bf16-eager=bf16:default:eager mega-bf16-eager=bf16:megamoe_ep:eager $(specs STARTUP_RUNS) ;;
  dp)      m=/tmp/gpu-engine-models; python3 -c "import sys; sys.path.insert(0,'tests/gpu_engine'); from run_matrix import build_models; from pathlib import Path; build_models(Path('$m'), {'bf16'})"
           for g in eager full_decode_only; do
             timeout 300 python3 tests/gpu_engine/serve_dp.py $m/bf16 --dp 1 --groups 2 --graphs $g --moe-backend megamoe_ep > "$out/dp1_$g.txt" 2>&1
             timeout 330 python3 tests/gpu_engine/serve_dp.py $m/bf16 --dp 2 --graphs $g --moe-backend megamoe_ep --log-prefix "$out/dp2_$g" > "$out/dp2_$g.txt" 2>&1
             tail -c 3000 "$out/dp2_$g.txt"
           done ;;
  runs)    python3 tests/gpu_engine/run_matrix.py --out "$out/gpu_engine_runs.json" --deadline-s "$deadline" "${@:4}" ;;
  kill)    m=/tmp/gpu-engine-models; python3 -c "import sys; sys.path.insert(0,'tests/gpu_engine'); from run_matrix import build_models; from pathlib import Path; build_models(Path('$m'), {'bf16'})"
           MEGA_P2P_TIMEOUT_S=10 timeout 400 python3 tests/gpu_engine/serve_dp.py $m/bf16 --dp 2 --graphs full_decode_only \
             --moe-backend megamoe_ep --kill-rank 1 --kill-bound-s 120 --log-prefix /tmp/kill > /tmp/kill.txt 2>&1
           grep "^KILL " /tmp/kill.txt | cut -c6- > "$out/gpu_engine_kill.json"; tail -c 2500 /tmp/kill.txt
           tail -c 4000 /tmp/kill.rank0.log ;;
  serving) python3 benchmarks/vllm_serving.py --compare --out "$out/vllm_serving.json" --plot "$out/vllm_serving.png" "${@:4}" ;;
esac
