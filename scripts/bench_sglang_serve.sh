#!/usr/bin/env bash
# Benchmark a running SGLang server (e.g. from serve_sglang_*_ep.sh) with sglang.benchmark.serving,
# offline: --dataset-name random-ids draws random token ids (no dataset download); the tokenizer is
# read from MODEL, so point MODEL at a local checkpoint folder when the machine has no network.
#   scripts/bench_sglang_serve.sh [--dry-run] [extra sglang.benchmark.serving args]
#   MODEL=/models/DeepSeek-R1-MXFP4 ISL=1024 OSL=1024 PROMPTS=512 CONCURRENCY=64 scripts/bench_sglang_serve.sh
# Results are appended as JSONL to OUT (default bench_sglang_<time>.jsonl). PYTHON picks the
# interpreter of the venv that has sglang.
set -euo pipefail
dry_run=0; extra=()
for arg in "$@"; do
  if [[ $arg == --dry-run ]]; then dry_run=1; else extra+=("$arg"); fi
done
for v in ISL OSL PROMPTS CONCURRENCY; do
  val=${!v:-1}
  if ! [[ $val =~ ^[1-9][0-9]*$ ]]; then echo "error: $v=$val must be a positive integer" >&2; exit 2; fi
done
model=${MODEL:-deepseek-ai/DeepSeek-V4-Pro}
cmd=("${PYTHON:-python3}" -m sglang.benchmark.serving --backend sglang
     --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}"
     --model "$model" --tokenizer "$model"
     --dataset-name random-ids --random-input-len "${ISL:-1024}" --random-output-len "${OSL:-1024}"
     --random-range-ratio "${RANGE_RATIO:-1.0}" --num-prompts "${PROMPTS:-256}"
     --max-concurrency "${CONCURRENCY:-64}" --seed "${SEED:-42}"
     --output-file "${OUT:-bench_sglang_$(date +%Y%m%d_%H%M%S).jsonl}" "${extra[@]}")
echo "env HF_HUB_OFFLINE=1"
echo "${cmd[*]}"
if (( dry_run )); then exit 0; fi
exec env HF_HUB_OFFLINE=1 "${cmd[@]}"
