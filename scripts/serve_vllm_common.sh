# Shared by scripts/serve_vllm_*.sh (sourced, not run): DP-attention + EP launch of `vllm serve`, MoE
# layers through --moe-backend megamoe_ep (or, with BACKEND=default, vLLM's own MoE backend). The caller
# sets MODEL_DEFAULT, MODEL_PRESET (the `megamoe info` preset of that checkpoint) and KV_DEFAULT, then
# calls serve_vllm "$@". Variables (the same as the SGLang scripts'): scripts/_serve_common.sh, or --help.
# VLLM: the vllm executable (default vllm); PYTHON: the interpreter whose vllm the check reads the version of.
source "$(dirname "${BASH_SOURCE[0]}")/_serve_common.sh"

serve_vllm() {
  serve_parse_args "$@"
  serve_resolve vllm || exit 2
  local model=$SERVE_MODEL
  local cmd=("${VLLM:-vllm}" serve "$model" --trust-remote-code
             --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}"
             --data-parallel-size "$N" --tensor-parallel-size 1 --enable-expert-parallel)
  [[ $BACKEND == megamoe ]] && cmd+=(--moe-backend megamoe_ep)
  ((GRAPHS)) || cmd+=(--enforce-eager)
  [[ -n $MAX_LEN ]] && cmd+=(--max-model-len "$MAX_LEN")
  [[ $KV == fp8 ]] && cmd+=(--kv-cache-dtype fp8)
  if [[ $PRESET == reference ]]; then
    cmd+=(--max-num-batched-tokens 8192 --max-num-seqs 512 --block-size 16 --no-enable-prefix-caching)
  fi
  cmd+=("${EPLB_FLAGS[@]}" "${EXTRA[@]}")
  serve_check vllm "$model" "$MODEL_PRESET" || exit 2
  serve_run "${cmd[@]}"
}
