"""SGLang's contiguous expert layout (with EPLB physical replicas) as a MegaMoE placement."""

from __future__ import annotations

import pytest

from megamoe_sglang.runtime import sglang_placement
from megamoe_sglang.selection import MegaMoEConfigError, check_ep_divides, sglang_version_supported


def test_contiguous_physical_layout():
    p = sglang_placement(8, 2)
    assert p.local_experts(0) == [0, 1, 2, 3] and p.local_experts(1) == [4, 5, 6, 7]


def test_eplb_redundant_experts_keep_their_logical_ids():
    # 6 logical experts + 2 redundant replicas = 8 physical over 4 ranks
    p = sglang_placement(8, 4, physical_to_logical=[0, 1, 2, 3, 4, 5, 0, 3])
    assert p.num_physical == 8 and p.num_logical == 6
    assert p.owner[6] == 3 and p.slot[6] == 0


def test_eplb_map_of_wrong_size_and_uneven_split_are_clear_errors():
    with pytest.raises(MegaMoEConfigError, match="EPLB expert map has 6"):
        sglang_placement(8, 2, physical_to_logical=[0, 1, 2, 3, 4, 5])
    with pytest.raises(MegaMoEConfigError, match="--ep-size 3 does not divide"):
        check_ep_divides(256, 3)
    with pytest.raises(MegaMoEConfigError, match="--ep-size 4 does not divide the model's 10 routed experts"):
        sglang_placement(10, 4, physical_to_logical=[0, 1, 2, 3, 4, 5, 6, 7, 0, 1], num_logical=8, layer_id=3)


def test_logical_expert_without_replica_names_the_map():
    with pytest.raises(MegaMoEConfigError, match=r"SGLang's expert-location physical_to_logical_map \(layer 3\): "
                                                 r"logical experts \[7\] have no physical replica"):
        sglang_placement(8, 2, physical_to_logical=[0, 1, 2, 3, 4, 5, 6, 0], num_logical=8, layer_id=3)


def test_placement_from_sglangs_trivial_map_shows_the_replicas():
    # ExpertLocationMetadata.init_trivial: physical p holds logical p % num_logical (the worker test
    # builds it with SGLang itself; here its rule, to pin the placement's summary)
    p = sglang_placement(10, 2, physical_to_logical=[p % 8 for p in range(10)], num_logical=8, layer_id=3)
    assert p.describe() == "experts=10 logical=8 redundant/rank=0,2"


def test_version_pin():
    assert sglang_version_supported("0.5.23")
    assert not sglang_version_supported("0.5.24")
