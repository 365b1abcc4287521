"""vLLM serving figures on one GPU: ``--moe-backend megamoe_ep`` against vLLM's default MoE backend.

The model has DeepSeek-V4-Pro's MoE shapes (hidden 7168, 384 routed experts of 3072, top-6, MXFP4
experts: Quark's A8W4 layout, the layout vLLM reads for DeepSeek MXFP4 checkpoints) on the
DeepSeek-V3 architecture vLLM serves on this device (V4's own attention needs FlashMLA's sparse
kernels, which the device bundle lacks: docs/vllm.md), with few layers and random weights. vLLM
0.34's default for these experts on Hopper is humming-kernels (``Mxfp4MoeBackend.HUMMING``, ahead
of Marlin on sm_90: ``quantization/utils/humming/priority.py``); the run records which backend
vLLM logged.

Each backend runs in its own process (``--backend``), the same workloads in the same order, FULL
decode graphs: ``decode``: 64 requests of 128 prompt tokens generating 256 each (output tokens/s);
``latency``: one request, 128 in / 128 out (ms per output token); ``prefill``: 16 requests of 2048
prompt tokens, 1 output token each (prompt tokens/s). ``--compare`` runs both backends in turn
and writes JSON (+ PNG with ``--plot``).

Usage: python benchmarks/vllm_serving.py --compare --out results.json [--plot results.png] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, INTER, EXPERTS, TOPK = 7168, 3072, 384, 6
WORKLOADS = {"decode": dict(requests=64, prompt=128, output=256), "latency": dict(requests=1, prompt=128, output=128),
             "prefill": dict(requests=16, prompt=2048, output=1)}
VOCAB = 512


def build_checkpoint(out_dir: Path, layers: int = 2) -> Path:
    """A DeepSeek-V3-architecture checkpoint with DSV4-Pro's MoE shapes, random MXFP4 experts.

    The expert bytes are drawn directly as e2m1 pairs (every nibble value equally likely) with E8M0
    scales around 2^-7, so that an expert row has the scale of 1/sqrt(hidden): building 25 G
    parameters in fp32 to quantise them would not fit this budget. Layer 0 is dense (DeepSeek's
    first_k_dense_replace=1), the rest MoE."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
    from tiny_model import TinyDeepseekConfig, _write_tokenizer, build_state_dict

    cfg = TinyDeepseekConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * INTER,
                             moe_intermediate_size=INTER, num_hidden_layers=layers, first_k_dense_replace=1,
                             num_attention_heads=16, num_key_value_heads=16, n_routed_experts=EXPERTS,
                             num_experts_per_tok=TOPK, n_group=8, topk_group=4, max_position_embeddings=4096)
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)

    def mxfp4_experts(g: torch.Generator, cfg, prefix: str) -> dict[str, torch.Tensor]:
        experts = {}
        for e in range(EXPERTS):
            q = f"{prefix}.mlp.experts.{e}"
            for name, (rows, cols) in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                                       ("down_proj", (HIDDEN, INTER))):
                experts[f"{q}.{name}.weight"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
                experts[f"{q}.{name}.weight_scale"] = torch.randint(119, 122, (rows, cols // 32), dtype=torch.uint8,
                                                                    generator=g)
                experts[f"{q}.{name}.input_scale"] = torch.tensor(8.0 / 448.0, dtype=torch.float32)
        return experts

    sd = build_state_dict(cfg, seed=0, routed_experts=mxfp4_experts)
    keep = ("e_score_correction_bias", "input_scale")
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() and not k.endswith(keep) else v).contiguous()
          for k, v in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.hf_config("a8w4"), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _write_tokenizer(out, VOCAB)
    return out


def weight_stream_floor_ms(requests: int, bandwidth_tb_s: float) -> float:
    """One decode step's floor: the MXFP4 experts the step's ``requests`` x top-k uniform routes touch
    (expected distinct experts), read once (e2m1 nibbles + one E8M0 byte per 32), at ``bandwidth_tb_s``."""
    touched = EXPERTS * (1 - (1 - 1 / EXPERTS) ** (requests * TOPK))
    expert_bytes = 3 * INTER * HIDDEN * (0.5 + 1 / 32)
    return touched * expert_bytes / (bandwidth_tb_s * 1e12) * 1e3


def floor_record(sheet_tb_s: float) -> dict:
    """The decode workloads' MoE floors at the card's datasheet bandwidth (H100 SXM: 3.35 TB/s), and what
    this bench does not measure (it times engines, not kernels: no naive-torch layer, no copy ceiling)."""
    return {"sheet_tb_s": sheet_tb_s,
            "moe_ms_per_decode_step": {name: round(weight_stream_floor_ms(w["requests"], sheet_tb_s), 3)
                                       for name, w in WORKLOADS.items() if w["output"] > 1},
            "not_measured": "naive torch and the measured copy ceiling (the layer benches measure both)"}


def run_backend(model: str, backend: str) -> dict:
    """Every workload in one engine (this process), FULL decode graphs; figures per workload."""
    import random

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu_engine"))
    from serve_one import ATTENTION, bundle_workarounds

    bundle_workarounds()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=model, dtype="bfloat16", gpu_memory_utilization=0.85, max_model_len=4096,
                  max_num_batched_tokens=8192, max_num_seqs=64, seed=0, attention_config=dict(ATTENTION),
                  compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                      "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]})
    if backend != "default":
        kwargs["moe_backend"] = backend
    t0 = time.time()
    llm = LLM(**kwargs)
    out = {"backend": backend, "init_s": round(time.time() - t0, 1), "workloads": {}}
    rng = random.Random(0)
    for name, w in WORKLOADS.items():
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(4, VOCAB) for _ in range(w["prompt"])])
                   for _ in range(w["requests"])]
        sp = SamplingParams(temperature=0.0, max_tokens=w["output"], ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm
        start = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - start
        fig = {"seconds": round(seconds, 3), **w}
        fig["output_tok_s"] = round(w["requests"] * w["output"] / seconds, 1)
        fig["prompt_tok_s"] = round(w["requests"] * w["prompt"] / seconds, 1)
        fig["ms_per_output_token"] = round(1000 * seconds / w["output"], 3) if w["requests"] == 1 else None
        out["workloads"][name] = fig
        print(f"{backend} {name}: {fig}", flush=True)
    return out


def compare(model: str, timeout_s: float) -> dict:
    """Both backends in turn, each in its own process; the log lines naming vLLM's MoE backend kept."""
    result = {"model": {"hidden": HIDDEN, "inter": INTER, "experts": EXPERTS, "topk": TOPK, "quant": "a8w4 (Quark MXFP4)"},
              "runs": {}}
    for backend in ("megamoe_ep", "default"):
        env = dict(os.environ, MEGA_DISPATCH_WIRE="fp8")
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--backend", backend, "--model-dir", model],
                              capture_output=True, text=True, env=env, timeout=timeout_s)
        log = proc.stdout + proc.stderr
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
        run = json.loads(line[len("RESULT "):]) if line else {"error": log[-4000:]}
        run["wall_s"] = round(time.time() - t0, 1)
        run["moe_log"] = [x for x in log.splitlines() if "MoE backend" in x or "Created MegaMoE" in x
                          or "umming" in x][:8]
        result["runs"][backend] = run
        print(json.dumps({backend: run.get("workloads") or run.get("error", "")[-2000:]}), flush=True)
    return result


def plot(result: dict, path: str, card: str) -> None:
    """Bars of MegaMoE / default per workload (a ratio plot: 15 % gaps stay visible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mega, base = result["runs"]["megamoe_ep"].get("workloads", {}), result["runs"]["default"].get("workloads", {})
    metric = {"decode": "output_tok_s", "latency": "ms_per_output_token", "prefill": "prompt_tok_s"}
    names, ratios = [], []
    for name, key in metric.items():
        if name in mega and name in base and mega[name][key] and base[name][key]:
            better_high = key != "ms_per_output_token"
            ratios.append(mega[name][key] / base[name][key] if better_high else base[name][key] / mega[name][key])
            names.append(f"{name}\n({key})")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(names, ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    ax.axhline(1.0, color="black", lw=1)
    for i, r in enumerate(ratios):
        ax.text(i, r, f"{r:.2f}x", ha="center", va="bottom")
    default = next((x.split("Using ")[-1] for x in result["runs"]["default"].get("moe_log", []) if "Using " in x
                    and "backend" in x), "vLLM's default")
    ax.set_ylabel("megamoe_ep / vLLM default (>1: faster)")
    ax.set_title(f"vLLM 0.34 offline on one {card}\nDSV4-Pro MoE shapes (384 x 3072, top-6, MXFP4), 1 MoE layer;"
                 f" default: {default}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=None, help="run one backend in this process (megamoe_ep | default)")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--model-dir", default="/tmp/dsv4_shaped")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--replot", default=None, help="draw --plot from this JSON (no GPU)")
    ap.add_argument("--timeout-s", type=float, default=400)
    args = ap.parse_args()
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        plot(result, args.plot, result.get("card", "GPU"))
        return
    if args.backend:
        print("RESULT " + json.dumps(run_backend(args.model_dir, args.backend)), flush=True)
        os._exit(0)
    if args.compare:
        t0 = time.time()
        build_checkpoint(Path(args.model_dir), args.layers)
        import torch

        built_s = round(time.time() - t0, 1)
        result = compare(args.model_dir, args.timeout_s)
        result.update(card=torch.cuda.get_device_name(0), checkpoint_build_s=built_s,
                      date=time.strftime("%Y-%m-%d"), floor=floor_record(3.35))
        Path(args.out).write_text(json.dumps(result, indent=1))
        if args.plot:
            plot(result, args.plot, result["card"])


if __name__ == "__main__":
    main()
