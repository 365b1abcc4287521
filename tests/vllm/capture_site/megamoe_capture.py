"""Test-only vLLM general plugin: record every MegaMoE layer call of an engine (or its token bound) to files.

Why a plugin of its own (and not code in megamoe_vllm): the exact-oracle test must see what vLLM's
MoE runner hands the plugin and what the plugin hands back, inside the real engine processes,
without the product carrying a recorder. vLLM loads every ``vllm.general_plugins`` entry point in
each of its processes; this directory's ``megamoe_capture-0.dist-info`` declares one, and the test
harness puts the directory on the engine's PYTHONPATH only when it wants a capture
(``vllm_test_env.engine_env(capture_dir=...)``), so no other engine run sees it.

What is recorded: ``MegaMoEMethod.apply`` is the plugin's boundary with vLLM (the runner calls it
with the hidden states and the router's top-k ids and weights; everything MegaMoE does happens
below it). Each call writes ``{pid}-{n:06d}.pt`` into ``$MEGAMOE_TEST_CAPTURE_DIR`` at once (the
engine core is stopped, not shut down cleanly, so nothing may wait for exit) holding the layer
name, copies of the three inputs and of the returned tensor, and the plugin's quant scheme and
dispatch wire, for ``layer_oracle.py`` to recompute with the core ``MegaMoELayer``.

Token bound (``$MEGAMOE_TEST_BOUND_DIR``): a pass-through around ``MegaMoELayer.forward`` that
appends, for every call, (EP rank, layer, tokens on this rank, the ``max_tokens_across_ranks`` the
layer received, which forward ran it, whether vLLM's ``_dummy_run`` — warm-up, profiling, idle DP
ranks, CUDA-graph capture on a GPU — is on the stack) to ``{pid}.jsonl``, AFTER the real forward
returned. It changes no argument and no result: the plugin decides on its own whether to pass a
bound (``token_bound.takes_token_bound``), and the layer's own forward uses it (on CPU the torch
forward checks it against every rank's in the dispatch header and would refuse a wrong one on
both ranks), so a record is a bound the real forward took and accepted.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

ENV = "MEGAMOE_TEST_CAPTURE_DIR"
BOUND_ENV = "MEGAMOE_TEST_BOUND_DIR"
_counter = itertools.count()  # per-process call number, for the file names (the only state kept)


def register() -> None:
    if os.environ.get(BOUND_ENV):
        _record_bounds(Path(os.environ[BOUND_ENV]))
    out_dir = os.environ.get(ENV)
    if not out_dir:
        return
    from megamoe_vllm.method import MegaMoEMethod

    if getattr(MegaMoEMethod.apply, "_megamoe_capture", False):
        return  # idempotent: vLLM may load general plugins more than once per process
    inner_apply = MegaMoEMethod.apply

    def apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs):
        out = inner_apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs)
        _save(Path(out_dir), {
            "layer": self.layer_name, "quant": self.fmt.quant, "wire": self.knobs.dispatch_wire,
            "combine": self.knobs.combine_wire, "x": x.detach().clone(), "topk_ids": topk_ids.detach().clone(),
            "topk_weights": topk_weights.detach().clone(), "out": out.detach().clone(),
        })
        return out

    apply._megamoe_capture = True
    MegaMoEMethod.apply = apply


def _save(out_dir: Path, record: dict) -> None:
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{os.getpid()}-{next(_counter):06d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.rename(path)  # a reader never sees half a file


def _in_dummy_run() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_dummy_run":
            return True
        frame = frame.f_back
    return False


def _record_bounds(out_dir: Path) -> None:
    from megamoe_backend.layer import MegaMoELayer

    if getattr(MegaMoELayer.forward, "_megamoe_bound", False):
        return  # idempotent
    inner = MegaMoELayer.forward
    path = out_dir / f"{os.getpid()}.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)

    def forward(self, x, topk_ids, topk_weights, output_scale=1.0, out=None, max_tokens_across_ranks=None):
        dummy_run = _in_dummy_run()
        result = inner(self, x, topk_ids, topk_weights, output_scale, out, max_tokens_across_ranks)
        record = {"ep_rank": self.plan.ep_rank, "layer": self.name, "tokens": int(x.shape[0]),
                  "bound": max_tokens_across_ranks, "forward": type(self.path).__name__, "dummy_run": dummy_run}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    forward._megamoe_bound = True
    MegaMoELayer.forward = forward
