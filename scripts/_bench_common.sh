# Shared by scripts/bench_{vllm,sglang}_serve.sh (sourced, not run): the workload variables both engines'
# bench scripts read, with the same names and defaults, and the reference run's points.
#
# Lengths are fixed in both engines (ISL / OSL exactly): the reference plan's "range ratio 1.0" is SGLang's
# scale (lengths drawn from [ratio x L, L]); vLLM's scale is [L x (1 - r), L x (1 + r)] with r in [0, 1),
# so the vLLM script passes 0.0 for the same fixed lengths.

source "$(dirname "${BASH_SOURCE[0]}")/_quote.sh"

BENCH_VARIABLES='Variables (the same in both engines; unset = the default shown):
  MODEL          the served model: its name on the server and its tokenizer (a local folder works
                 offline; default deepseek-ai/DeepSeek-V4-Pro)
  HOST=127.0.0.1 PORT (vLLM 8000, SGLang 30000: the serve scripts'"'"' defaults)
  DATASET=random random (random token ids, ISL / OSL fixed) | sharegpt (DATASET_PATH: the ShareGPT json,
                 e.g. ShareGPT_V3_unfiltered_cleaned_split.json) | gsm8k (accuracy: lm_eval 5-shot GSM8K
                 through the server'"'"'s OpenAI /v1/completions; lm_eval reads the dataset from the HF hub)
  ISL=8192 OSL=1024  input / output tokens per request (random)
  CONCURRENCY=64 requests in flight (gsm8k: lm_eval num_concurrent); PROMPTS=4 x CONCURRENCY requests
  REQUEST_RATE=inf  WARMUPS=1 (warm-up requests)  SEED=0
  PRESET         unset | reference: the reference run (docs/serving.md): random 8192 / 1024, ignore EOS,
                 seed 0, request rate inf, 64 warm-ups, concurrency 512 x 5120 prompts then 4096 x 8192
                 prompts; DATASET=sharegpt with it: 512 x 5120. POINT=512 | 4096 runs one point only
  LABEL=megamoe  the name of this run in the result files (letters, digits, . _ -), e.g. LABEL=default
                 for the A/B run against a server started with BACKEND=default: the bench measures
                 whichever server is running (BACKEND is the serve scripts'"'"' variable and is refused here)
  RESULT_DIR=bench_results  where results go: <engine>_<LABEL>_<DATASET>_c<CONCURRENCY>_<time>.json(l)
  LM_EVAL=lm_eval  the lm_eval executable (DATASET=gsm8k)
Options: --help, --dry-run (print the commands, run nothing); other arguments go to the bench command.'

bench_parse_args() { script_parse_args "$BENCH_VARIABLES" "$@"; }

# bench_resolve: validates the variables and sets MODEL, DATASET, ISL, OSL, RATE, WARMUPS, SEED, LABEL,
# RESULT_DIR, STAMP and POINTS (one "concurrency:prompts" per run, in order).
bench_resolve() {
  MODEL=${MODEL:-deepseek-ai/DeepSeek-V4-Pro}
  DATASET=${DATASET:-random}
  case $DATASET in random|sharegpt|gsm8k) ;; *)
    script_fail "DATASET=$DATASET is not valid; allowed: random | sharegpt | gsm8k"; return 2;;
  esac
  PRESET=${PRESET:-}
  case $PRESET in ''|none) PRESET= ;; reference) ;; *)
    script_fail "PRESET=$PRESET is not valid; allowed: reference (or unset)"; return 2;;
  esac
  local warm_default=1
  [[ $PRESET == reference ]] && warm_default=64
  ISL=${ISL:-8192} OSL=${OSL:-1024} WARMUPS=${WARMUPS:-$warm_default} SEED=${SEED:-0} RATE=${REQUEST_RATE:-inf}
  local v
  for v in ISL OSL; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { script_fail "$v=${!v} must be a positive integer (tokens)"; return 2; }
  done
  [[ $WARMUPS =~ ^[0-9]+$ ]] || { script_fail "WARMUPS=$WARMUPS must be a number of requests >= 0"; return 2; }
  [[ $SEED =~ ^[0-9]+$ ]] || { script_fail "SEED=$SEED must be an integer >= 0"; return 2; }
  [[ $RATE == inf || $RATE =~ ^[0-9]+(\.[0-9]+)?$ ]] || { script_fail "REQUEST_RATE=$RATE must be inf or requests per second"; return 2; }
  if [[ -n ${BACKEND:-} ]]; then
    script_fail "BACKEND=$BACKEND: the bench measures whichever server is running (BACKEND picks the server's MoE backend in the serve scripts); set LABEL=$BACKEND to name the results"; return 2
  fi
  LABEL=${LABEL:-megamoe}
  [[ $LABEL =~ ^[A-Za-z0-9._-]+$ ]] || { script_fail "LABEL=$LABEL: use letters, digits, . _ - (it names the result files)"; return 2; }
  if [[ $DATASET == sharegpt ]]; then
    [[ -n ${DATASET_PATH:-} ]] || { script_fail "DATASET=sharegpt needs DATASET_PATH=<ShareGPT json> (nothing is downloaded)"; return 2; }
  fi
  if [[ $PRESET == reference && $DATASET != gsm8k ]]; then
    [[ -n ${CONCURRENCY:-}${PROMPTS:-}${NUM_PROMPTS:-} ]] &&
      echo "note: PRESET=reference sets CONCURRENCY / PROMPTS per point; yours are ignored (POINT=512 | 4096 picks one)" >&2
    case ${POINT:-} in
      '') POINTS=("512:5120"); [[ $DATASET == random ]] && POINTS+=("4096:8192") ;;
      512) POINTS=("512:5120") ;;
      4096) POINTS=("4096:8192") ;;
      *) script_fail "POINT=$POINT is not valid; allowed: 512 | 4096 (the reference run's concurrencies)"; return 2 ;;
    esac
  else
    local c=${CONCURRENCY:-64}
    local n=${PROMPTS:-${NUM_PROMPTS:-$((4 * ${c//[!0-9]/0}))}}
    for v in c n; do
      [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { script_fail "$([[ $v == c ]] && echo CONCURRENCY || echo PROMPTS)=${!v} must be a positive integer"; return 2; }
    done
    POINTS=("$c:$n")
  fi
  RESULT_DIR=${RESULT_DIR:-bench_results}
  STAMP=$(date +%Y%m%d_%H%M%S)
}

# bench_gsm8k_cmd BASE_URL CONCURRENCY OUT: lm_eval's 5-shot GSM8K through an OpenAI completions endpoint
# (the same harness and prompts for both engines and both backends), into BENCH_CMD.
bench_gsm8k_cmd() {
  BENCH_CMD=("${LM_EVAL:-lm_eval}" run --model local-completions
             --model_args "model=$MODEL,base_url=$1/v1/completions,num_concurrent=$2,max_retries=3,tokenized_requests=False"
             --tasks gsm8k --num_fewshot 5 --batch_size 1 --seed "$SEED" --output_path "$3" "${EXTRA[@]}")
}

# bench_run: prints each command (shell-quoted, one line) and runs them in order unless --dry-run.
bench_run() {
  local line
  for line in "${BENCH_LINES[@]}"; do echo "$line"; done
  ((DRY_RUN)) && return 0
  mkdir -p "$RESULT_DIR"
  for line in "${BENCH_LINES[@]}"; do eval "$line"; done
}
