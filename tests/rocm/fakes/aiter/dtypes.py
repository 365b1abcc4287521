"""Fake aiter.dtypes (gfx950 / gfx1250 values: OCP fp8)."""

import torch

bf16 = torch.bfloat16
fp8 = torch.float8_e4m3fn
fp4x2 = torch.float4_e2m1fn_x2
fp8_e8m0 = torch.float8_e8m0fnu
i32 = torch.int32
