#!/usr/bin/env bash
# DeepSeek-R1 Quark MXFP4 (A4W4 routed experts) on SGLang with MegaMoE: DP attention + EP.
#   scripts/serve_sglang_r1_mxfp4_ep.sh [--help] [--dry-run] [extra sglang serve args]
#   MODEL=/models/DeepSeek-R1-0528-MXFP4 WIRE=fp4 PRESET=reference scripts/serve_sglang_r1_mxfp4_ep.sh
#   BACKEND=default ...: the same command with SGLang's own MoE path (the A/B)
# WIRE must carry the checkpoint's activations (fp4 for A4W4, fp8 for A8W4: AITER_FORCE_A8W4=1) or be
# bf16; the check (`megamoe info`) refuses a mismatch before anything starts.
set -euo pipefail
MODEL_DEFAULT=amd/DeepSeek-R1-0528-MXFP4
MODEL_PRESET=r1-mxfp4
KV_DEFAULT=auto
source "$(dirname "${BASH_SOURCE[0]}")/_sglang_common.sh"
megamoe_serve "$@"
