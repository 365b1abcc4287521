"""Shared test setup: deterministic seeds and the path to fixture config files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES
