#!/usr/bin/env bash
# Serve DeepSeek V4 Pro on SGLang with DP-attention + EP, MoE layers through MegaMoE:
#   scripts/serve_sglang_dsv4_pro_ep.sh [--dry-run] [extra sglang serve args]
#   MODEL=/models/DeepSeek-V4-Pro N=8 WIRE=fp4 scripts/serve_sglang_dsv4_pro_ep.sh
# V4's routed experts are fp4 (A4W4 by default, AITER_FORCE_A8W4=1 for A8W4); WIRE=fp4 (or fp8
# with A8W4) quantises the dispatch once on the sender. Variables: see scripts/_sglang_common.sh.
set -euo pipefail
source "$(dirname "$0")/_sglang_common.sh"
megamoe_serve "${MODEL:-deepseek-ai/DeepSeek-V4-Pro}" "$@"
