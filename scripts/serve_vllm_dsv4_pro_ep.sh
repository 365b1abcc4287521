#!/usr/bin/env bash
# DeepSeek-V4-Pro (MXFP4 routed experts, SwiGLU limit 10) on vLLM with MegaMoE: DP attention + EP.
#   scripts/serve_vllm_dsv4_pro_ep.sh [--help] [--dry-run] [extra vllm serve flags]
#   MODEL=/models/DeepSeek-V4-Pro PRESET=reference scripts/serve_vllm_dsv4_pro_ep.sh
#   BACKEND=default ...: the same command with vLLM's own MoE backend (the A/B)
# WIRE unset: the plugin follows vLLM's reading (0.33+: A8W4 on the fp8 wire; 0.32: A4W4 on bf16).
set -euo pipefail
MODEL_DEFAULT=deepseek-ai/DeepSeek-V4-Pro
MODEL_PRESET=dsv4-pro
KV_DEFAULT=fp8
source "$(dirname "${BASH_SOURCE[0]}")/serve_vllm_common.sh"
serve_vllm "$@"
