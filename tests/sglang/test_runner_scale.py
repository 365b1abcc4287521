"""The megamoe_ep runner hands SGLang's routed_scaling_factor to the layer as ``output_scale``, so the
scale is applied to the fp32 sum before the one bf16 rounding (as SGLang's own Triton runner does),
not as a second rounding after it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402

from megamoe_sglang.runner import MegaMoEQuantInfo, MegaMoERunnerCore  # noqa: E402


class RecordingRuntime:
    def forward(self, x, topk_ids, topk_weights, output_scale=1.0):
        self.output_scale = output_scale
        return (x.float() * output_scale).to(torch.bfloat16)


@pytest.mark.parametrize("factor, expected", [(None, 1.0), (1.0, 1.0), (2.5, 2.5)])
def test_routed_scaling_factor_becomes_output_scale(factor, expected):
    config = MoeRunnerConfig(routed_scaling_factor=factor)
    runtime = RecordingRuntime()
    x = torch.randn(3, 8).to(torch.bfloat16)
    topk = SimpleNamespace(topk_ids=torch.zeros(3, 2, dtype=torch.int64), topk_weights=torch.ones(3, 2))
    out = MegaMoERunnerCore(config).run_from_dispatch(SimpleNamespace(hidden_states=x, topk_output=topk),
                                                      MegaMoEQuantInfo(runtime=runtime), config)
    assert runtime.output_scale == expected
    assert torch.equal(out.hidden_states, (x.float() * expected).to(torch.bfloat16))  # scaled once, not twice
