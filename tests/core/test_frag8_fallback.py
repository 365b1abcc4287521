"""decoder="auto" re-lays MXFP4 weights for frag8 (the fastest decoder) where it can and falls back to
frag where it cannot; the fallback costs 2.7-3.4 vs 1.74-2.0 instructions per weight (docs/triton.md),
so it is logged: one WARNING on the "megamoe" logger naming the tensor, expert, row and binade spread.
CPU only: prepare_weights is torch (experts/fragments.py)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton", reason="TritonExperts imports triton (pip install -e .[test,triton]; scripts/test.sh does)")

from megamoe_backend.experts import ExpertMath, ExpertWeights, quantize_expert_weights  # noqa: E402
from megamoe_backend.experts.fragments import FoldSpanError  # noqa: E402
from megamoe_backend.experts.triton import TritonExperts  # noqa: E402

A8W4 = ExpertMath("a8w4", 10.0)


def _weights(seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(2, 256, 256, generator=g), torch.randn(2, 256, 128, generator=g)
    return quantize_expert_weights(w1, w2, "mxfp4")


def _one_block_40_binades_down(w: ExpertWeights, expert: int, row: int, block: int) -> ExpertWeights:
    """One 32-wide block of one w1 row 40 binades below the rest of its row (same codes, scale byte - 40)."""
    s1 = w.w1_scale.clone()
    s1[expert, row, block] -= 40
    return ExpertWeights(w.w1, w.w2, w.fmt, w.gate_up_layout, s1, w.w2_scale)


@pytest.fixture
def warnings_seen(caplog):
    """The "megamoe" logger's WARNING lines (its handler is attached directly: the layer module turns the
    logger's propagation off once imported, so the root handler caplog installs would miss them)."""
    logger = logging.getLogger("megamoe")
    logger.addHandler(caplog.handler)
    with caplog.at_level(logging.WARNING, logger="megamoe"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "megamoe" and r.levelno == logging.WARNING]
    logger.removeHandler(caplog.handler)


def test_weights_frag8_holds_take_frag8_without_a_word(warnings_seen):
    got = TritonExperts().prepare_weights(_weights(), A8W4)
    assert got.storage == "fragments_fp8" and warnings_seen() == []


def test_a_block_frag8_cannot_fold_falls_back_to_frag_with_one_warning(warnings_seen):
    w = _one_block_40_binades_down(_weights(), expert=1, row=5, block=2)
    spread = int(w.w1_scale[1, 5].to(torch.int32).max()) - int(w.w1_scale[1, 5, 2])
    got = TritonExperts().prepare_weights(w, A8W4)
    assert got.storage == "fragments"  # the bf16 fragments: the frag decoder runs these experts
    lines = warnings_seen()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"megamoe: frag8 cannot hold these MXFP4 weights exactly: w1 expert 1 row 5 has block "
                               f"scales {spread} binades apart (block 2: ")
    assert "the frag decoder" in lines[0] and spread >= 40
    with pytest.raises(FoldSpanError) as err:  # an explicit decoder="frag8" raises instead, naming the same block
        TritonExperts(decoder="frag8").prepare_weights(w, A8W4)
    assert (err.value.tensor, err.value.expert, err.value.row, err.value.block, err.value.spread) == ("w1", 1, 5, 2, spread)
