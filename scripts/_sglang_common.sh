# Shared by scripts/serve_sglang_*.sh (sourced, not run): DP-attention + EP launch of `sglang serve`, MoE
# layers through --moe-a2a-backend megamoe_ep (or, with BACKEND=default, SGLang's own MoE path). The caller
# sets MODEL_DEFAULT, MODEL_PRESET (the `megamoe info` preset of that checkpoint) and KV_DEFAULT, then calls
# megamoe_serve "$@". Variables (the same as the vLLM scripts'): scripts/_serve_common.sh, or --help.
# SGLANG_PLUGINS is passed on only when set (it whitelists *all* general plugins); PYTHON: the interpreter
# whose sglang the check reads the version of.
#
# SGLang's --chunked-prefill-size and --max-running-requests are totals over the DP ranks (SGLang divides
# them by --attn-dp-size), so PRESET=reference passes 8192 x N and 512 x N: every rank then runs what
# vLLM's per-engine --max-num-batched-tokens 8192 / --max-num-seqs 512 run.
source "$(dirname "${BASH_SOURCE[0]}")/_serve_common.sh"

megamoe_serve() {
  serve_parse_args "$@"
  serve_resolve sglang || exit 2
  [[ -n ${SGLANG_PLUGINS:-} ]] && MEGA_ENV+=("SGLANG_PLUGINS=$SGLANG_PLUGINS")
  local model=$SERVE_MODEL
  local cmd=(sglang serve --model-path "$model" --trust-remote-code
             --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}"
             --tp "$N" --attn-dp-size "$N" --ep-size "$N")
  [[ $BACKEND == megamoe ]] && cmd+=(--moe-a2a-backend megamoe_ep)
  ((GRAPHS)) || cmd+=(--disable-cuda-graph)
  [[ -n $MAX_LEN ]] && cmd+=(--context-length "$MAX_LEN")
  [[ $KV == fp8 ]] && cmd+=(--kv-cache-dtype fp8_e4m3)
  if [[ $PRESET == reference ]]; then
    cmd+=(--chunked-prefill-size $((8192 * N)) --max-running-requests $((512 * N)) --page-size 16 --disable-radix-cache)
  fi
  cmd+=("${EPLB_FLAGS[@]}" "${EXTRA[@]}")
  serve_check sglang "$model" "$MODEL_PRESET" || exit 2
  serve_run "${cmd[@]}"
}
