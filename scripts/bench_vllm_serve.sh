#!/usr/bin/env bash
# `vllm bench serve` with the standard workload against a running server (e.g. one started by
# scripts/serve_vllm_*.sh): random prompts, ISL/OSL 8192/1024, range ratio 1.0, ignore EOS, seed 0.
#   MODEL=... CONCURRENCY=64 scripts/bench_vllm_serve.sh [--dry-run] [-- extra bench flags]
# Environment: MODEL (required: the served model name), HOST (127.0.0.1), PORT (8000), ISL (8192),
# OSL (1024), CONCURRENCY (64), NUM_PROMPTS (4 x CONCURRENCY), RESULT_DIR (benchmarks/results),
# VLLM (the vllm executable).
set -euo pipefail

DRY_RUN=0
PASSTHROUGH=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --) shift; PASSTHROUGH=("$@"); break ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (use --dry-run, or pass bench flags after --)" >&2; exit 2 ;;
  esac
  shift
done

: "${MODEL:?set MODEL to the served model name}"
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
ISL=${ISL:-8192}
OSL=${OSL:-1024}
CONCURRENCY=${CONCURRENCY:-64}
NUM_PROMPTS=${NUM_PROMPTS:-$((4 * CONCURRENCY))}
RESULT_DIR=${RESULT_DIR:-benchmarks/results}
VLLM=${VLLM:-vllm}

CMD=("$VLLM" bench serve --backend vllm --model "$MODEL" --host "$HOST" --port "$PORT"
     --dataset-name random --random-input-len "$ISL" --random-output-len "$OSL" --random-range-ratio 1.0
     --ignore-eos --seed 0 --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY"
     --save-result --result-dir "$RESULT_DIR" "${PASSTHROUGH[@]}")

if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
mkdir -p "$RESULT_DIR"
exec "${CMD[@]}"
