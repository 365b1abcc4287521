"""What the interpreter tests of the layer share: a DSV4-Pro-shaped spec small enough for the Triton
interpreter, the accuracy gates, and a fresh transport / workspace cache around every test."""

from __future__ import annotations

import pytest

from megamoe_backend.spec import preset
from megamoe_backend.transport import clear_transport_cache

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)
K = SPEC.num_experts_per_tok
GATES = {"bf16": 0.01, "a8w4": 0.10, "a4w4": 0.28}  # relL2 vs fp32 on dequantised weights (project gates)


@pytest.fixture(autouse=True)
def fresh_transport_cache():
    """Workspaces are cached per shape: each test starts and ends without any."""
    clear_transport_cache()
    yield
    clear_transport_cache()
