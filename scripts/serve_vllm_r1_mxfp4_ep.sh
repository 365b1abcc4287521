#!/usr/bin/env bash
# DeepSeek-R1 Quark MXFP4 (A4W4 routed experts) on vLLM with MegaMoE: DP attention + EP.
#   WIRE=fp4 DP=8 scripts/serve_vllm_r1_mxfp4_ep.sh [--dry-run] [-- extra vllm serve flags]
# WIRE must match the checkpoint's A operand (fp4 for A4W4, fp8 for A8W4) or be bf16; a mismatch
# stops the server at startup with the reason. See scripts/serve_vllm_common.sh for the other knobs.
MODEL_DEFAULT=amd/DeepSeek-R1-0528-MXFP4
WIRE_DEFAULT=fp4
SERVE_EXTRA=(--trust-remote-code --max-num-batched-tokens 8192)
source "$(dirname "${BASH_SOURCE[0]}")/serve_vllm_common.sh"
