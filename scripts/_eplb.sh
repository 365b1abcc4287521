# Shared by scripts/serve_{vllm,sglang}_*.sh (sourced, not run): EPLB=rN -> each engine's EPLB flags.
#
#   EPLB              unset/off: no EPLB (default) | rN: EPLB with N redundant experts (upstream: r0, r64)
#   EPLB_WINDOW=200   steps of expert load the rebalance looks at
#   EPLB_INTERVAL=200 rebalance every this many steps
#   EPLB_THRESHOLD=2.0  rebalance only when the busiest rank's load exceeds THRESHOLD x the mean
#
#   vLLM 0.32:   --enable-eplb --eplb-config {"num_redundant_experts":N,"window_size":W,"step_interval":I}
#                (vLLM has no balancedness threshold: it rebalances every interval; said on stderr)
#   SGLang:      --enable-eplb --ep-num-redundant-experts N --expert-distribution-recorder-buffer-size W
#                --eplb-rebalance-num-iterations I --expert-balancedness-report-mode server_log
#                --eplb-min-rebalancing-utilization-threshold 1/THRESHOLD (SGLang's balancedness is
#                mean/max load and it skips a rebalance above the threshold; the report mode makes it
#                measure that)
#
# eplb_flags vllm|sglang  fills the array EPLB_FLAGS; returns 2 (message on stderr) on a bad value.

eplb_flags() {
  EPLB_FLAGS=()
  local engine=$1 mode=${EPLB:-off}
  [[ $mode == off ]] && return 0
  if ! [[ $mode =~ ^r([0-9]+)$ ]]; then
    echo "error: EPLB=$mode is not valid; allowed: off | r<redundant experts>, e.g. r0 or r64" >&2; return 2
  fi
  local redundant=${BASH_REMATCH[1]} window=${EPLB_WINDOW:-200} interval=${EPLB_INTERVAL:-200}
  local threshold=${EPLB_THRESHOLD:-2.0}
  local name value
  for name in EPLB_WINDOW EPLB_INTERVAL; do
    value=${!name:-200}
    if ! [[ $value =~ ^[1-9][0-9]*$ ]]; then
      echo "error: $name=$value must be a positive number of steps" >&2; return 2
    fi
  done
  if ! [[ $threshold =~ ^[0-9]+(\.[0-9]+)?$ ]] || ! awk "BEGIN { exit !($threshold >= 1) }"; then
    echo "error: EPLB_THRESHOLD=$threshold must be a number >= 1 (max/mean rank load)" >&2; return 2
  fi
  case $engine in
    vllm)
      EPLB_FLAGS=(--enable-eplb --eplb-config
                  "{\"num_redundant_experts\":$redundant,\"window_size\":$window,\"step_interval\":$interval}")
      echo "note: vLLM has no EPLB balancedness threshold; EPLB_THRESHOLD=$threshold is not passed (it rebalances every $interval steps)" >&2
      ;;
    sglang)
      EPLB_FLAGS=(--enable-eplb --ep-num-redundant-experts "$redundant"
                  --expert-distribution-recorder-buffer-size "$window" --eplb-rebalance-num-iterations "$interval"
                  --expert-balancedness-report-mode server_log
                  --eplb-min-rebalancing-utilization-threshold "$(awk "BEGIN { printf \"%.4g\", 1 / $threshold }")")
      ;;
    *) echo "eplb_flags: unknown engine $engine" >&2; return 2 ;;
  esac
}
