#!/usr/bin/env bash
# Benchmark a running SGLang server (e.g. one started by scripts/serve_sglang_*.sh) with
# sglang.benchmark.serving, or check its accuracy (DATASET=gsm8k: lm_eval through /v1/completions).
# DATASET=random draws random token ids (--dataset-name random-ids: no dataset download).
#   scripts/bench_sglang_serve.sh [--help] [--dry-run] [extra sglang.benchmark.serving args]
#   MODEL=/models/DeepSeek-V4-Pro PRESET=reference scripts/bench_sglang_serve.sh
#   MODEL=/models/DeepSeek-V4-Pro DATASET=gsm8k scripts/bench_sglang_serve.sh
# PYTHON: the interpreter of the venv that has sglang. Variables (the same as the vLLM script's): --help.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bench_common.sh"
bench_parse_args "$@"
bench_resolve || exit 2
host=${HOST:-127.0.0.1} port=${PORT:-30000}
BENCH_LINES=()
for point in "${POINTS[@]}"; do
  c=${point%%:*} n=${point##*:}
  name=sglang_${LABEL}_${DATASET}_c${c}_${STAMP}
  if [[ $DATASET == gsm8k ]]; then
    bench_gsm8k_cmd "http://$host:$port" "$c" "$RESULT_DIR/$name"
  else
    BENCH_CMD=("${PYTHON:-python3}" -m sglang.benchmark.serving --backend sglang --host "$host" --port "$port"
               --model "$MODEL" --tokenizer "$MODEL")
    if [[ $DATASET == random ]]; then
      # 1.0 = fixed lengths on SGLang's scale ([ratio x L, L])
      BENCH_CMD+=(--dataset-name random-ids --random-input-len "$ISL" --random-output-len "$OSL" --random-range-ratio 1.0)
    else
      BENCH_CMD+=(--dataset-name sharegpt --dataset-path "$DATASET_PATH")
    fi
    # SGLang ignores EOS unless --disable-ignore-eos
    BENCH_CMD+=(--seed "$SEED" --request-rate "$RATE" --warmup-requests "$WARMUPS"
                --max-concurrency "$c" --num-prompts "$n" --output-file "$RESULT_DIR/$name.jsonl" "${EXTRA[@]}")
  fi
  BENCH_LINES+=("$(shell_line "${BENCH_CMD[@]}")")
done
bench_run
