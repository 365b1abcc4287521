#!/usr/bin/env bash
# The project beside the MoE kernels a user would run instead (FlashInfer CUTLASS Humming / W4A16,
# triton_kernels matmul_ogs, naive torch), in ONE device call on one H200, same run, same routing
# (issues 45 item 1, 48 item 4): `megamoe bench experts --peers` and `megamoe bench layer --peers`.
#
# Before the call, on the machine with the checkout (once):
#     mkdir -p .peers && cp -r ../shared/peers/* .peers/ && echo /.peers/ >> .git/info/exclude
# Device call (carry [".peers"]), one of:
#     bash benchmarks/run_peers_h200.sh --smoke      # one bucket of each bench, all peers: checks it all runs (~2 min)
#     bash benchmarks/run_peers_h200.sh              # 192 and 48 local experts x 8 / 128 / 1024 / 8192 tokens,
#                                                    #   A8W4 + A4W4: experts + ep_size-1 layer (<= 9 min)
#     bash benchmarks/run_peers_h200.sh --emulated   # the emulated EP 8 / EP 2 rank with the peers on its share
#     bash benchmarks/run_peers_h200.sh --experts-only | --layer-only   # one half of the default run
# Environment: OUT (default out/peers), PY (python3), DEADLINE_S (530), PEER_LIST (default: all peers,
# e.g. "flashinfer_humming triton_kernels"), EMU_EP (--emulated: one EP size, e.g. 2, its files named
# *_ep2_*; default EP 8 and EP 2 in one file), EXPERTS / TOKENS (the default and --experts-only /
# --layer-only grid, default "48 192" / "8 128 1024 8192"; a narrower grid names its files
# *_e192_t8192_* so it never overwrites the full run's), TUNE_SEED (a tactic cache an earlier call returned as
# $OUT/flashinfer_autotune.json: the buckets it holds are not tuned again, as with a user's persisted
# cache; default benchmarks/results/<card>_flashinfer_autotune.json where one is committed).
# FlashInfer's tactic cache lives in /tmp (kept while the device stays warm) and is copied to $OUT.
# Writes JSON + PNG + logs to $OUT, named by the card (h200_* on an H200, h100_* on an H100).
# Each step runs under the time left of DEADLINE_S (default 530 s):
# a bench starts no new case past its --budget-s (the JSON lists what did not run, meta.not_run) and
# is stopped by `timeout` past the deadline; every JSON is rewritten after each case and a missing PNG
# is redrawn from it. Peers that cannot be imported are listed in meta.peers.skipped with the reason.
set -u
MODE=full
case "${1:-}" in
  --smoke) MODE=smoke ;;
  --emulated) MODE=emulated ;;
  --experts-only) MODE=experts ;;
  --layer-only) MODE=layer ;;
  "" ) ;;
  -h|--help) sed -n '2,/^set -u/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
  *) echo "run_peers_h200.sh: unknown argument '$1' (expected --smoke, --emulated, --experts-only, --layer-only or nothing; --help)" >&2
     exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-out/peers}
PY=${PY:-python3}
DEADLINE_S=${DEADLINE_S:-530}
mkdir -p "$OUT"
T0=$SECONDS

if [ -f .peers/flashinfer/setup_device.sh ]; then
  # shellcheck disable=SC1091
  . .peers/flashinfer/setup_device.sh .peers/flashinfer || echo "FlashInfer setup failed (rc $?): its peers will be listed as skipped" >&2
else
  echo "no .peers/flashinfer (copy ../shared/peers into .peers and carry it): FlashInfer peers will be listed as skipped" >&2
fi
export PYTHONPATH="$PWD/.peers/triton_kernels:$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "setup $((SECONDS - T0)) s; mode $MODE; out $OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1 || true
# result files are named by the card that made them (h200_*, h100_*): an H100 run never passes for an H200 one
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E 'H[0-9]{3}' | tr 'H' 'h')
GPU=${GPU:-gpu}

TUNE=/tmp/megamoe_flashinfer_autotune.json  # FlashInfer's tactic cache: a later bench reuses the first one's tuning
# default seed: the committed cache of this card (FlashInfer ignores one whose metadata names another GPU)
[ -z "${TUNE_SEED:-}" ] && [ -f "benchmarks/results/${GPU}_flashinfer_autotune.json" ] && TUNE_SEED="benchmarks/results/${GPU}_flashinfer_autotune.json"
if [ -n "${TUNE_SEED:-}" ] && [ ! -f "$TUNE" ]; then
  cp "$TUNE_SEED" "$TUNE" || { echo "TUNE_SEED=$TUNE_SEED: cannot copy it to $TUNE (a JSON a previous call left in \$OUT)" >&2; exit 2; }
fi
# shellcheck disable=SC2206
PEERS=(--peers ${PEER_LIST:-} --peer-tune-cache "$TUNE")
EXPERTS=${EXPERTS:-48 192}
TOKENS=${TOKENS:-8 128 1024 8192}
GRID=""  # file-name tag of a grid narrower than the default one
[ "$EXPERTS" != "48 192" ] || [ "$TOKENS" != "8 128 1024 8192" ] && GRID="_e${EXPERTS// /-}_t${TOKENS// /-}"
status=0

# step NAME SHARE CMD...: run CMD with --budget-s (SHARE % of the time left, minus a margin for the last
# case) under `timeout` of the time left; log to $OUT/NAME.log
step() {
  local name=$1 share=$2; shift 2
  local left=$((DEADLINE_S - (SECONDS - T0)))
  if [ "$left" -le 30 ]; then echo "$name: no time left, not run" | tee "$OUT/$name.log"; status=1; return; fi
  local budget=$(( left * share / 100 - 90 )); [ "$budget" -lt 20 ] && budget=20
  local limit=$(( left * share / 100 )); [ "$share" -ge 100 ] && limit=$left
  echo "== $name: budget $budget s, limit $limit s"
  timeout -k 20 -s INT "$limit" "$PY" -u "$@" --budget-s "$budget" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && { echo "$name: rc $rc" >&2; status=1; }
}

# a PNG the bench did not get to draw (stopped by timeout) is drawn from its JSON
replot() {  # replot MODULE JSON
  local png=${2%.json}.png
  [ -f "$2" ] && [ ! -f "$png" ] && "$PY" -m "$1" --replot "$2" --plot "$png" || true
}

if [ "$MODE" = smoke ]; then
  step experts_smoke 45 -m benchmarks.bench_experts --experts 48 --tokens 128 --schemes a8w4 a4w4 "${PEERS[@]}" \
    --json "$OUT/smoke_experts.json" --plot "$OUT/smoke_experts.png"
  step layer_smoke 50 -m benchmarks.bench_layer --experts 48 --tokens 128 --schemes a8w4 --combine-wires bf16 \
    --no-chain "${PEERS[@]}" --json "$OUT/smoke_layer.json" --plot "$OUT/smoke_layer.png"
  step emulated_smoke 100 -m benchmarks.bench_layer --emulate --ep 2 --experts-total 96 --tokens 128 \
    --routings uniform --schemes a8w4 --combine-wires bf16 "${PEERS[@]}" --json "$OUT/smoke_emulated.json" \
    --plot "$OUT/smoke_emulated.png"
elif [ "$MODE" = emulated ]; then
  # shellcheck disable=SC2046
  step emulated 100 -m benchmarks.bench_layer --emulate $([ -n "${EMU_EP:-}" ] && echo --ep "$EMU_EP") \
    --tokens 8 128 1024 8192 --routings uniform \
    --schemes a8w4 a4w4 --combine-wires bf16 "${PEERS[@]}" --json "$OUT/${GPU}_layer_ep_emulated${EMU_EP:+_ep$EMU_EP}_peers.json" \
    --plot "$OUT/${GPU}_layer_ep_emulated${EMU_EP:+_ep$EMU_EP}_peers.png"
  replot benchmarks.bench_layer "$OUT/${GPU}_layer_ep_emulated${EMU_EP:+_ep$EMU_EP}_peers.json"
else
  # 48 experts first: one EP 8 rank's share of DSV4-Pro, the issues' headline figures
  share=62; [ "$MODE" = experts ] && share=100
  if [ "$MODE" != layer ]; then
    # shellcheck disable=SC2086
    step experts $share -m benchmarks.bench_experts --experts $EXPERTS --tokens $TOKENS \
      --schemes a8w4 a4w4 "${PEERS[@]}" --json "$OUT/${GPU}_experts${GRID}_peers.json" --plot "$OUT/${GPU}_experts${GRID}_peers.png"
    replot benchmarks.bench_experts "$OUT/${GPU}_experts${GRID}_peers.json"
  fi
  if [ "$MODE" != experts ]; then
    # shellcheck disable=SC2086
    step layer 100 -m benchmarks.bench_layer --experts $EXPERTS --tokens $TOKENS --schemes a8w4 a4w4 \
      --combine-wires bf16 --no-chain "${PEERS[@]}" --json "$OUT/${GPU}_layer${GRID}_peers.json" --plot "$OUT/${GPU}_layer${GRID}_peers.png"
    replot benchmarks.bench_layer "$OUT/${GPU}_layer${GRID}_peers.json"
  fi
fi
[ -f "$TUNE" ] && cp "$TUNE" "$OUT/flashinfer_autotune.json"
echo "done in $((SECONDS - T0)) s (status $status); $OUT:"
ls -la "$OUT"
exit $status
