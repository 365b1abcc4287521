#!/usr/bin/env bash
# DeepSeek-V4-Pro (MXFP4 routed experts, SwiGLU limit 10) on SGLang with MegaMoE: DP attention + EP.
#   scripts/serve_sglang_dsv4_pro_ep.sh [--help] [--dry-run] [extra sglang serve args]
#   MODEL=/models/DeepSeek-V4-Pro PRESET=reference scripts/serve_sglang_dsv4_pro_ep.sh
#   BACKEND=default ...: the same command with SGLang's own MoE path (the A/B)
# WIRE unset: the checkpoint's own scheme (A4W4) on bf16; WIRE=fp4 quantises the dispatch once on the
# sender; WIRE=fp8 needs AITER_FORCE_A8W4=1 (A8W4).
set -euo pipefail
MODEL_DEFAULT=deepseek-ai/DeepSeek-V4-Pro
MODEL_PRESET=dsv4-pro
KV_DEFAULT=fp8
source "$(dirname "${BASH_SOURCE[0]}")/_sglang_common.sh"
megamoe_serve "$@"
