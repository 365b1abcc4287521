# Shared by scripts/serve_vllm_*.sh (sourced, not run): DP-attention + EP launch of `vllm serve`
# with --moe-backend megamoe_ep. The caller sets MODEL_DEFAULT, WIRE_DEFAULT and SERVE_EXTRA
# (an array of model-specific flags) before sourcing.
#
# Environment: MODEL, WIRE (bf16|fp8|fp4 -> MEGA_DISPATCH_WIRE), DP (data-parallel size = EP size,
# default 8), HOST (127.0.0.1), PORT (8000), MAX_MODEL_LEN (9216: ISL 8192 + OSL 1024),
# VLLM (the vllm executable, default `vllm`), EPLB=off|rN (+ EPLB_WINDOW / EPLB_INTERVAL: see
# scripts/_eplb.sh). Flags: --dry-run prints the exact command and exits;
# anything after `--` is appended to `vllm serve`.

set -euo pipefail

DRY_RUN=0
PASSTHROUGH=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --) shift; PASSTHROUGH=("$@"); break ;;
    -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $1 (use --dry-run, or pass vllm flags after --)" >&2; exit 2 ;;
  esac
  shift
done

MODEL=${MODEL:-$MODEL_DEFAULT}
WIRE=${WIRE:-$WIRE_DEFAULT}
DP=${DP:-8}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-9216}
VLLM=${VLLM:-vllm}

case "$WIRE" in
  bf16|fp8|fp4) ;;
  *) echo "WIRE=$WIRE is not valid; allowed: bf16 | fp8 | fp4 (it becomes MEGA_DISPATCH_WIRE)" >&2; exit 2 ;;
esac
case "$DP" in
  ''|*[!0-9]*|0) echo "DP=$DP must be a positive integer (data-parallel size = EP size)" >&2; exit 2 ;;
esac
source "$(dirname "${BASH_SOURCE[0]}")/_eplb.sh"
eplb_flags vllm || exit 2

ENV_ASSIGN=("MEGA_DISPATCH_WIRE=$WIRE")
CMD=("$VLLM" serve "$MODEL"
     --host "$HOST" --port "$PORT"
     --data-parallel-size "$DP" --tensor-parallel-size 1 --enable-expert-parallel
     --moe-backend megamoe_ep "${EPLB_FLAGS[@]}"
     --max-model-len "$MAX_MODEL_LEN"
     "${SERVE_EXTRA[@]}" "${PASSTHROUGH[@]}")

if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' env "${ENV_ASSIGN[@]}" "${CMD[@]}"; echo
  exit 0
fi
exec env "${ENV_ASSIGN[@]}" "${CMD[@]}"
