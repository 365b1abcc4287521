"""One vLLM engine on the GPU, one configuration, one JSON line out (the GPU engine tests' probe).

Each configuration runs in its own process: vLLM keeps per-process state (parallel groups, the
compilation config, CUDA graphs), so the driver (``run_matrix.py``) starts one of these per
(model, MoE backend, graph mode). Output: the last stdout line, ``RESULT {json}`` with

- ``tokens`` / ``top2``: greedy generation, 4 prompts x ``--max-tokens``, one prompt per call;
- ``forced``: teacher-forced prompt logprobs of 8 fixed 64-token sequences (504 positions), the
  quantity the derived bound holds (tests/vllm/logprob_bound.py);
- ``rhos``: per MoE layer, |MoE output| / |MoE input| over the eager calls (the bound's rho), read
  on the device by a wrapper around the plugin's op body (eager runs only; the captured graphs
  replay kernels, not Python);
- ``op_calls``: how often the plugin's op body ran eagerly and under stream capture (a captured
  layer runs its Python only at capture, then only its kernels replay);
- ``padding``: rows vLLM marked as padding that reached the layer, and how many of their route ids
  were still live (must be 0): counted by device ops recorded into the captured graphs too, so
  every replay adds to them; ``batch_tokens``: 3 prompts in one call (decode pads 3 -> 4 rows);
- ``init_s`` / ``total_s``, ``cudagraph_mode``.

Engine settings the device needs (the bundle's README, ../shared/engine-gpu): MLA decode on
TRITON_MLA with the torch ("CPU") MLA prefill backend, no torch.compile (mode NONE), the engine
core in-process. Graph modes: ``eager`` (--enforce-eager), ``full_decode_only`` (FULL graphs of
every decode step, prefill eager), ``breakable`` (VLLM_USE_BREAKABLE_CUDAGRAPH=1,
FULL_AND_PIECEWISE: vLLM 0.34's default for DeepSeek V3.2 / V4).

Usage: python tests/gpu_engine/serve_one.py MODEL_DIR --graphs eager|full_decode_only|breakable
       [--moe-backend megamoe_ep] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))  # engine_run's prompts and sequences

from engine_run import PROMPTS, score_sequences  # noqa: E402

GRAPH_MODES = ("eager", "full_decode_only", "breakable")
ATTENTION = {"backend": "TRITON_MLA", "mla_prefill_backend": "CPU"}


def engine_kwargs(model: str, graphs: str, moe_backend: str | None, gpu_memory_utilization: float) -> dict:
    """vLLM ``LLM(...)`` arguments for one graph mode (the environment part is set by ``graph_env``)."""
    if graphs not in GRAPH_MODES:
        raise ValueError(f"--graphs {graphs!r}; expected one of {GRAPH_MODES}")
    kwargs = dict(model=model, dtype="bfloat16", gpu_memory_utilization=gpu_memory_utilization, max_model_len=256,
                  max_num_batched_tokens=256, max_num_seqs=8, seed=0, enforce_eager=graphs == "eager",
                  attention_config=dict(ATTENTION))
    if graphs == "full_decode_only":
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                        "cudagraph_capture_sizes": [1, 2, 4, 8]}
    elif graphs == "breakable":
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_AND_PIECEWISE",
                                        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}
    if moe_backend:
        kwargs["moe_backend"] = moe_backend
    return kwargs


def bundle_workarounds() -> None:
    """What the device bundle lacks, stepped around in this process (docs/vllm.md, "On a GPU").

    vLLM 0.34's ``kernel_warmup`` imports its MiniMax-M3 MSA warm-up on every CUDA start, whose
    modules import the CuTe DSL (``cutlass``), which the bundle does not carry; that warm-up does
    nothing for other models, so an empty one stands in its place."""
    import types

    name = "vllm.model_executor.warmup.minimax_m3_msa_warmup"
    stub = types.ModuleType(name)
    stub.minimax_m3_msa_warmup = lambda worker: None
    sys.modules.setdefault(name, stub)


def graph_env(graphs: str) -> dict[str, str]:
    return {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1" if graphs == "breakable" else "0"}


class OpProbe:
    """Counts the plugin's op-body calls (eager / under capture) and the MoE norm ratio per layer.

    Wraps ``MegaMoEMethod.forward_tokens`` in this process (the engine core runs in-process). The
    norms stay on the device until the run ends (a list of 0-d tensors), so the probe adds no host
    synchronisation to the forward it watches."""

    def __init__(self) -> None:
        self.eager = 0
        self.captured = 0
        self.norms: dict[str, list] = {}
        self.pad_counts = None  # int64 [2] on the device: padded rows seen, live ids among them

    def count_padding(self, x, topk_ids) -> None:
        import torch
        from megamoe_vllm.padding import padding_rows

        mask = padding_rows(x.shape[0])
        if mask is None:
            return
        if self.pad_counts is None:  # the first call is vLLM's eager profile run, before any capture
            self.pad_counts = torch.zeros(2, dtype=torch.int64, device=x.device)
        self.pad_counts[0] += mask.sum()
        self.pad_counts[1] += ((topk_ids >= 0) & mask[:, None]).sum()

    def padding(self) -> dict:
        counts = [0, 0] if self.pad_counts is None else self.pad_counts.tolist()
        return {"padded_rows": counts[0], "live_ids_on_padded_rows": counts[1]}

    def install(self) -> None:
        import torch
        from megamoe_backend.layer import MegaMoELayer
        from megamoe_vllm.method import MegaMoEMethod

        layer_forward = MegaMoELayer.forward

        def counted_forward(layer, x, topk_ids, topk_weights, *args, **kwargs):
            self.count_padding(x, topk_ids)
            return layer_forward(layer, x, topk_ids, topk_weights, *args, **kwargs)

        MegaMoELayer.forward = MegaMoELayer.__call__ = counted_forward

        inner = MegaMoEMethod.forward_tokens
        probe = self

        def forward_tokens(method, x, topk_ids, topk_weights):
            out = inner(method, x, topk_ids, topk_weights)
            if torch.cuda.is_current_stream_capturing():
                probe.captured += 1
            else:
                probe.eager += 1
                probe.norms.setdefault(method.layer_name, []).append(
                    torch.stack([out.float().pow(2).sum(), x.float().pow(2).sum()]))
            return out

        MegaMoEMethod.forward_tokens = forward_tokens

    def rhos(self) -> dict[str, float]:
        import torch

        out = {}
        for name, pairs in sorted(self.norms.items()):
            total = torch.stack(pairs).sum(dim=0).tolist()
            out[name] = (total[0] / total[1]) ** 0.5 if total[1] > 0 else 0.0
        return out


def prepare_process(graphs: str, moe_backend: str | None) -> OpProbe:
    """What a probe process sets before vLLM starts: the graph mode's environment, the bundle's
    workarounds, and (MegaMoE runs) the op probe, which it returns."""
    for key, value in graph_env(graphs).items():
        os.environ.setdefault(key, value)
    bundle_workarounds()
    probe = OpProbe()
    if moe_backend == "megamoe_ep":
        probe.install()
    return probe


def generate_and_score(llm, prompts: list[str], max_tokens: int, sequences: list[list[int]]) -> dict:
    """Greedy ``prompts`` (one call: tokens, top-2 logprobs per step) and teacher-forced ``sequences``
    (one call: log p(token_i | tokens_<i), position 0 has none); either list may be empty."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = {"tokens": [], "top2": [], "forced": []}
    if prompts:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
        gen = llm.generate(prompts, sp, use_tqdm=False)
        out["tokens"] = [list(o.outputs[0].token_ids) for o in gen]
        out["top2"] = [[{str(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs]
                       for o in gen]
    if sequences:
        score = SamplingParams(max_tokens=1, prompt_logprobs=0)
        scored = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], score, use_tqdm=False)
        out["forced"] = [[float(pos[tok].logprob) for tok, pos in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
                         for o in scored]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--graphs", default="eager", choices=GRAPH_MODES)
    ap.add_argument("--moe-backend", default=None)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    args = ap.parse_args()
    probe = prepare_process(args.graphs, args.moe_backend)
    from vllm import LLM

    t0 = time.time()
    llm = LLM(**engine_kwargs(args.model, args.graphs, args.moe_backend, args.gpu_memory_utilization))
    t_init = time.time() - t0
    # one prompt / one sequence per call: a request's numerics do not depend on what shares its batch
    per_request = [generate_and_score(llm, [p], args.max_tokens, []) for p in PROMPTS]
    scored = [generate_and_score(llm, [], 1, [seq]) for seq in score_sequences()]
    batch = generate_and_score(llm, PROMPTS[:3], args.max_tokens, [])
    cfg = llm.llm_engine.vllm_config.compilation_config
    print("RESULT " + json.dumps({
        "tokens": [r["tokens"][0] for r in per_request], "top2": [r["top2"][0] for r in per_request],
        "forced": [r["forced"][0] for r in scored], "rhos": probe.rhos(), "batch_tokens": batch["tokens"],
        "op_calls": {"eager": probe.eager, "captured": probe.captured}, "padding": probe.padding(),
        "cudagraph_mode": str(cfg.cudagraph_mode), "init_s": round(t_init, 1), "total_s": round(time.time() - t0, 1),
    }), flush=True)
    sys.stderr.flush()
    os._exit(0)  # the result is out; skip engine teardown (its failures are not what this probe measures)


if __name__ == "__main__":
    main()
