#!/usr/bin/env bash
# Serve DeepSeek R1 MXFP4 (Quark: A4W4, or A8W4) on SGLang with DP-attention + EP via MegaMoE:
#   scripts/serve_sglang_r1_mxfp4_ep.sh [--dry-run] [extra sglang serve args]
#   MODEL=/models/DeepSeek-R1-MXFP4 N=8 WIRE=fp4 scripts/serve_sglang_r1_mxfp4_ep.sh
# WIRE must match the checkpoint's activation format (fp4 for A4W4, fp8 for A8W4) or be bf16;
# a mismatch is refused at startup by the plugin. Variables: see scripts/_sglang_common.sh.
set -euo pipefail
source "$(dirname "$0")/_sglang_common.sh"
megamoe_serve "${MODEL:-amd/DeepSeek-R1-MXFP4-Preview}" "$@"
