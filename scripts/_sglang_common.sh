# Shared by scripts/serve_sglang_*.sh (sourced, not run). Turns the operator's short variables into
# the MEGA_* knobs and an `sglang serve` command line for DP-attention + EP with megamoe_ep.
#
#   N=8            GPUs on this node: --tp N --attn-dp-size N --ep-size N
#   WIRE=bf16      dispatch wire -> MEGA_DISPATCH_WIRE (bf16 | fp8 | fp4; must match the experts'
#                  A operand: fp4 for A4W4, fp8 for A8W4; bf16 always works)
#   COMBINE_WIRE   -> MEGA_COMBINE_WIRE (bf16 | fp8_blockwise_1x32)
#   TRANSPORT      -> MEGA_DISPATCH (auto | nccl | symm | ipc | mori | flydsl)
#   EPLB=off|rN    EPLB with N redundant experts (+ EPLB_WINDOW, EPLB_INTERVAL, EPLB_THRESHOLD): scripts/_eplb.sh
#   MTPR           -> MEGA_MAX_TOKENS_PER_RANK
#   PORT=30000     server port (binds 127.0.0.1 unless HOST is set)
#   CUDA_GRAPH     1: SGLang captures its CUDA graphs (MegaMoE's device forward is sync-free and capturable
#                  at ep_size 1 and over the peer transports symm | ipc, which MEGA_DISPATCH=auto picks on one
#                  host); 0: --disable-cuda-graph. Default: 1, except N>1 with TRANSPORT=nccl | mori | flydsl
#                  (their forward reads row counts on the host; with graphs on, the plugin refuses the start
#                  naming --disable-cuda-graph)
#   --dry-run      print the environment and command, run nothing
# Extra arguments after the options go to `sglang serve` unchanged.

megamoe_serve() {
  local model=$1; shift
  local dry_run=0 extra=()
  for arg in "$@"; do
    if [[ $arg == --dry-run ]]; then dry_run=1; else extra+=("$arg"); fi
  done
  local n=${N:-8}
  if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
    echo "error: N=$n must be a positive GPU count" >&2; return 2
  fi
  local wire=${WIRE:-${MEGA_DISPATCH_WIRE:-bf16}}
  case $wire in bf16|fp8|fp4) ;; *)
    echo "error: WIRE=$wire (MEGA_DISPATCH_WIRE) is not valid; allowed values: bf16 | fp8 | fp4" >&2; return 2;;
  esac
  source "$(dirname "${BASH_SOURCE[0]}")/_eplb.sh"
  eplb_flags sglang || return 2
  extra=("${EPLB_FLAGS[@]}" "${extra[@]}")
  local envs=("MEGA_DISPATCH_WIRE=$wire")
  [[ -n ${COMBINE_WIRE:-} ]] && envs+=("MEGA_COMBINE_WIRE=$COMBINE_WIRE")
  [[ -n ${TRANSPORT:-} ]] && envs+=("MEGA_DISPATCH=$TRANSPORT")
  [[ -n ${MTPR:-} ]] && envs+=("MEGA_MAX_TOKENS_PER_RANK=$MTPR")
  # SGLANG_PLUGINS is a whitelist of *all* general plugins: pass it on only when the operator set it
  [[ -n ${SGLANG_PLUGINS:-} ]] && envs+=("SGLANG_PLUGINS=$SGLANG_PLUGINS")
  local capturable=1
  [[ $n != 1 && ${TRANSPORT:-} =~ ^(nccl|mori|flydsl)$ ]] && capturable=0
  local cuda_graph=${CUDA_GRAPH:-$capturable}
  case $cuda_graph in 0|1) ;; *)
    echo "error: CUDA_GRAPH=$cuda_graph must be 0 or 1" >&2; return 2;;
  esac
  local graph=(--disable-cuda-graph)
  [[ $cuda_graph == 1 ]] && graph=()
  local cmd=(sglang serve --model-path "$model" --trust-remote-code
             --tp "$n" --attn-dp-size "$n" --ep-size "$n"
             --moe-a2a-backend megamoe_ep "${graph[@]}"
             --host "${HOST:-127.0.0.1}" --port "${PORT:-30000}" "${extra[@]}")
  echo "env ${envs[*]}"
  echo "${cmd[*]}"
  if (( dry_run )); then return 0; fi
  exec env "${envs[@]}" "${cmd[@]}"
}
