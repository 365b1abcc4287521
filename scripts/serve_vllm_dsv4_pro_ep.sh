#!/usr/bin/env bash
# DeepSeek-V4-Pro (MXFP4 routed experts, SwiGLU limit 10) on vLLM with MegaMoE: DP attention + EP.
#   WIRE=fp4 DP=8 scripts/serve_vllm_dsv4_pro_ep.sh [--dry-run] [-- extra vllm serve flags]
# WIRE defaults to fp4 (V4 experts run A4W4); WIRE=fp8 needs AITER_FORCE_A8W4=1 (A8W4), bf16 always works.
# See scripts/serve_vllm_common.sh for MODEL / DP / HOST / PORT / MAX_MODEL_LEN / VLLM.
MODEL_DEFAULT=deepseek-ai/DeepSeek-V4-Pro
WIRE_DEFAULT=fp4
SERVE_EXTRA=(--trust-remote-code --kv-cache-dtype fp8 --max-num-batched-tokens 8192)
source "$(dirname "${BASH_SOURCE[0]}")/serve_vllm_common.sh"
