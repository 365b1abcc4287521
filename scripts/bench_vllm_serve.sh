#!/usr/bin/env bash
# Benchmark a running vLLM server (e.g. one started by scripts/serve_vllm_*.sh) with `vllm bench serve`,
# or check its accuracy (DATASET=gsm8k: lm_eval through /v1/completions).
#   scripts/bench_vllm_serve.sh [--help] [--dry-run] [extra bench flags]
#   MODEL=/models/DeepSeek-V4-Pro PRESET=reference scripts/bench_vllm_serve.sh
#   MODEL=/models/DeepSeek-V4-Pro DATASET=gsm8k scripts/bench_vllm_serve.sh
# VLLM: the vllm executable (default vllm). Variables (the same as the SGLang script's): --help.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bench_common.sh"
bench_parse_args "$@"
bench_resolve || exit 2
host=${HOST:-127.0.0.1} port=${PORT:-8000}
BENCH_LINES=()
for point in "${POINTS[@]}"; do
  c=${point%%:*} n=${point##*:}
  name=vllm_${LABEL}_${DATASET}_c${c}_${STAMP}
  if [[ $DATASET == gsm8k ]]; then
    bench_gsm8k_cmd "http://$host:$port" "$c" "$RESULT_DIR/$name"
  else
    BENCH_CMD=("${VLLM:-vllm}" bench serve --backend vllm --model "$MODEL" --host "$host" --port "$port")
    if [[ $DATASET == random ]]; then
      # 0.0 = fixed lengths on vLLM's scale ([L(1-r), L(1+r)], r in [0, 1)): the reference's "1.0" on SGLang's
      BENCH_CMD+=(--dataset-name random --random-input-len "$ISL" --random-output-len "$OSL" --random-range-ratio 0.0)
    else
      BENCH_CMD+=(--dataset-name sharegpt --dataset-path "$DATASET_PATH")
    fi
    BENCH_CMD+=(--ignore-eos --seed "$SEED" --request-rate "$RATE" --num-warmups "$WARMUPS"
                --max-concurrency "$c" --num-prompts "$n"
                --save-result --result-dir "$RESULT_DIR" --result-filename "$name.json" "${EXTRA[@]}")
  fi
  BENCH_LINES+=("$(shell_line "${BENCH_CMD[@]}")")
done
bench_run
