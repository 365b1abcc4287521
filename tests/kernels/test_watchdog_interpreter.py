"""The status word's stream-ordered clear and the watchdog over a real device forward, under the
Triton interpreter (CPU). On a GPU: tests/kernels/test_gpu_watchdog.py (graphs, a dead peer).

- the publish kernel (status_publish_kernel.py: ack in, the clear, the words out to the host copy in one
  launch) follows the rule of status.clear_reported (zero the word and bump seq iff seq == ack, else
  touch nothing) and leaves what InputStatus.publish's CPU steps leave;
- a bad expert id in a device forward is reported once by a watchdog (layer, token, value), the
  next forward neither raises it again nor keeps it in the word, and the problem after it is seen.
"""

from __future__ import annotations

import logging

import pytest
import torch

from interpreter_guard import require_interpreter  # noqa: E402

require_interpreter("tests/kernels/test_gpu_watchdog.py")

from megamoe_backend.experts.triton import TritonExperts  # noqa: E402
from megamoe_backend.knobs import Knobs  # noqa: E402
from megamoe_backend.layer import MegaMoELayer  # noqa: E402
from megamoe_backend.layer.device.status import InputStatus  # noqa: E402
from megamoe_backend.layer.device.status_publish_kernel import publish_kernel  # noqa: E402
from megamoe_backend.layer.device.watchdog import Watchdog  # noqa: E402
from megamoe_backend.plan import build_plan  # noqa: E402
from megamoe_backend.spec import preset  # noqa: E402
from megamoe_backend.transport import clear_transport_cache  # noqa: E402
from megamoe_backend.workload import ProblemConfig, make_problem  # noqa: E402

SPEC = preset("dsv4-pro").scaled(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8)
K = SPEC.num_experts_per_tok


@pytest.mark.parametrize("words,ack", [([2, 1, 999, 3, 5, -1], 5), ([2, 1, 999, 3, 6, 5], 5), ([0, 0, 0, 0, 0, -1], -1),
                                       ([0, 0, 0, 0, 4, -1], 4), ([4, 7, 0, 2, 3, -1], 2)])
def test_the_publish_kernel_does_what_publish_does_on_the_host(words, ack):
    """The kernel against InputStatus.publish's CPU steps (copy ack in, clear_reported, copy out). A planted
    mutation, the kernel writing the host copy before the clear, fails the cases that clear (run once)."""
    st = InputStatus(torch.device("cpu"), 8)
    st._words.copy_(torch.tensor(words)), st._ack.fill_(ack)
    st.publish()
    dev, ack_host, host = torch.tensor(words, dtype=torch.int64), torch.tensor([ack]), torch.full((6,), -7)
    publish_kernel[(1,)](dev, ack_host, host, WORDS=4, PAD=8, num_warps=1)
    assert dev.tolist() == st._words.tolist() and host.tolist() == st._host_words.tolist() == dev.tolist()
    seq = words[4]
    assert dev.tolist() == ([0, 0, 0, 0, seq + 1, ack] if seq == ack else words[:4] + [seq, ack])


def test_a_bad_id_in_a_device_forward_is_reported_once_and_cleared():
    clear_transport_cache()
    problem = make_problem(ProblemConfig(SPEC, 5, 1, seed=3, masked_fraction=0.0))
    plan = build_plan(SPEC, Knobs(max_tokens_per_rank=8), quant="bf16")
    layer = MegaMoELayer(plan, problem.expert_weights("bf16"), provider=TritonExperts(capacity=8 * K), device_path=True,
                         name="layer 5")
    dog, lines = Watchdog(), []
    dog.watch(layer.workspace.status)
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megamoe").addHandler(handler)
    try:
        ids = problem.topk_ids.clone()
        ids[2, 4] = 8
        layer(problem.x, ids, problem.topk_weights)
        dog.poll(), dog.poll()
        assert len(lines) == 1 and "layer 5: topk_ids holds 8 at token 2" in lines[0]
        layer(problem.x, problem.topk_ids, problem.topk_weights)  # the eager check: already reported, no raise
        assert layer.workspace.status.word.tolist() == [0, 0, 0, 0]  # cleared in stream order by that forward
        ids[2, 4], ids[4, 0] = 0, -3
        layer(problem.x, ids, problem.topk_weights)
        dog.poll(), dog.poll()
        assert dog.counts == {("layer 5", "bad_expert_id"): 2}  # the next problem was recorded and seen
    finally:
        logging.getLogger("megamoe").removeHandler(handler)
        clear_transport_cache()
