"""vLLM serving figures on one GPU: ``--moe-backend megamoe_ep`` against vLLM's default MoE backend.

The model has DeepSeek-V4-Pro's MoE shapes (hidden 7168, 384 routed experts of 3072, top-6, MXFP4
experts: Quark's A8W4 layout, the layout vLLM reads for DeepSeek MXFP4 checkpoints) on the
DeepSeek-V3 architecture vLLM serves on this device (V4's own attention needs FlashMLA's sparse
kernels, which the device bundle lacks: docs/vllm.md), with few layers and random weights. vLLM
0.34's default for these experts on Hopper is humming-kernels (``Mxfp4MoeBackend.HUMMING``, ahead
of Marlin on sm_90: ``quantization/utils/humming/priority.py``); the run records which backend
vLLM logged.

Each backend runs in its own process (``--backend``) with an empty Triton cache of its own (kernels
another library caches elsewhere, such as humming-kernels' NVRTC builds, stay as they are), the same
workloads in the same order, each PASSES times (the last pass is the figure, the first shows what
compiling on first use costs), FULL decode graphs: ``decode``: 64 requests of 128 prompt tokens
generating 256 each (output tokens/s); ``latency``: one request, 128 in / 128 out (ms per output
token); ``prefill``: 16 requests of 2048 prompt tokens, 1 output token each (prompt tokens/s).
``--compare`` runs both backends in turn and writes JSON (+ PNG with ``--plot``); ``--profile`` adds
each backend's decode-step kernels (profile_decode) and hand-stepped decode runs (step_profile).

Usage: python benchmarks/vllm_serving.py --compare --out results.json [--plot results.png] [--model-dir DIR] [--profile]
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
# Each workload runs PASSES times in its engine, the figures are the last pass's: the first pays for the
# Triton kernels (vLLM's and the MoE backend's) that start-up did not compile. Each backend's process gets
# an empty Triton cache of its own (compare), so neither inherits the other's compiled kernels.
PASSES = 2


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


def profile_decode(llm, rng, requests: int = 64, steps: int = 16, top: int = 25) -> dict:
    """The GPU kernels of ``steps`` decode steps of ``requests`` requests (4-token prompts, so their one
    prefill step is small beside the decode steps), from torch.profiler (CUPTI sees the kernels a CUDA
    graph replays): per kernel name, calls and device microseconds per decode step, largest first."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(4, VOCAB) for _ in range(4)]) for _ in range(requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm: the same shapes once
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(ev.name[:160], [0, 0.0])
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    device_us = sum(v[1] for v in kernels.values())
    return {"requests": requests, "steps": steps, "wall_ms_per_step": round(1e3 * wall / steps, 3),
            "device_us_per_step": round(device_us / steps, 1),
            "kernels": [{"name": n, "calls_per_step": round(c / steps, 2), "us_per_step": round(t / steps, 1)}
                        for n, (c, t) in rows[:top]]}


class JitWatch:
    """Triton kernels this process compiles (or loads from Triton's disk cache) while it is on: name and
    seconds each, through Triton's jit_cache / jit_post_compile hooks (the hooks it had are put back)."""

    def __init__(self) -> None:
        self.compiles: list[dict] = []
        self._start: dict[str, float] = {}

    def __enter__(self) -> "JitWatch":
        import triton

        rt = triton.knobs.runtime
        self._saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)

        def before(**kwargs):
            self._start[str(kwargs["key"])] = time.perf_counter()
            return False  # compile as usual

        def after(**kwargs):
            name = getattr(kwargs.get("fn"), "name", "?")
            t0 = self._start.pop(str(kwargs["key"]), None)
            self.compiles.append({"kernel": name, "s": round(time.perf_counter() - t0, 3) if t0 else None})

        rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
        return self

    def __exit__(self, *exc) -> None:
        import triton

        triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = self._saved


def step_profile(llm, rng, requests: int = 64, prompt: int = 128, output: int = 64) -> dict:
    """The decode workload stepped by hand (LLMEngine.step): each step's wall time, and the Triton
    kernels compiled meanwhile (JitWatch). A step that stalls on a first-time compile stands out
    from the steady steps, which an average over the whole run hides."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(requests):
        engine.add_request(f"step-{i}", {"prompt_token_ids": [rng.randrange(4, VOCAB) for _ in range(prompt)]}, sp)
    steps, calls = [], {"eager": 0, "captured": 0}
    method = None
    try:
        import torch
        from megamoe_vllm.method import MegaMoEMethod as method

        inner = method.forward_tokens

        def counted(self, *a, **k):  # the plugin's op body runs in Python only when not replayed from a graph
            calls["captured" if torch.cuda.is_current_stream_capturing() else "eager"] += 1
            return inner(self, *a, **k)

        method.forward_tokens = counted
    except ImportError:
        calls = None
    try:
        with JitWatch() as jit:
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                steps.append(round(1e3 * (time.perf_counter() - t0), 3))
    finally:
        if method is not None:
            method.forward_tokens = inner
    ordered = sorted(steps)
    slow = sorted(range(len(steps)), key=lambda i: -steps[i])[:6]
    return {"requests": requests, "prompt": prompt, "output": output, "steps": len(steps),
            "median_ms": ordered[len(ordered) // 2] if steps else None, "total_ms": round(sum(steps), 1),
            "slowest": [{"step": i, "ms": steps[i]} for i in slow], "jit_compiles": jit.compiles[:40],
            "jit_compiles_total": len(jit.compiles), "plugin_op_calls": calls}


def run_backend(model: str, backend: str, profile: bool = False) -> dict:
    """Every workload in one engine (this process), FULL decode graphs; figures per workload (and, with
    ``profile``, the decode step's kernels: profile_decode)."""
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
        passes = []
        for _ in range(PASSES):  # the first pass compiles what start-up did not (JitWatch counts it)
            with JitWatch() as jit:
                start = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                passes.append((round(time.perf_counter() - start, 3), len(jit.compiles)))
        seconds = passes[-1][0]
        fig = {"seconds": seconds, **w, "passes_s": [x for x, _ in passes], "jit_compiles_per_pass": [n for _, n in passes]}
        fig["output_tok_s"] = round(w["requests"] * w["output"] / seconds, 1)
        fig["prompt_tok_s"] = round(w["requests"] * w["prompt"] / seconds, 1)
        fig["ms_per_output_token"] = round(1000 * seconds / w["output"], 3) if w["requests"] == 1 else None
        out["workloads"][name] = fig
        print(f"{backend} {name}: {fig}", flush=True)
    if profile:
        out["steps_fresh_shapes"] = step_profile(llm, rng, prompt=96)  # a prefill size no workload ran before
        out["steps_repeat"] = step_profile(llm, rng, prompt=96)
        out["decode_profile"] = profile_decode(llm, rng)
        print(f"{backend} decode profile: {json.dumps(out['decode_profile'])}", flush=True)
    return out


def compare(model: str, timeout_s: float, profile: bool = False, backends: tuple[str, ...] = ("megamoe_ep", "default")) -> dict:
    """Both backends in turn, each in its own process; the log lines naming vLLM's MoE backend kept."""
    result = {"model": {"hidden": HIDDEN, "inter": INTER, "experts": EXPERTS, "topk": TOPK, "quant": "a8w4 (Quark MXFP4)"},
              "runs": {}}
    import tempfile

    for backend in backends:
        env = dict(os.environ, MEGA_DISPATCH_WIRE="fp8", TRITON_CACHE_DIR=tempfile.mkdtemp(prefix=f"triton-{backend}-"))
        t0 = time.time()
        proc = subprocess.run([sys.executable, __file__, "--backend", backend, "--model-dir", model]
                              + (["--profile"] if profile else []),
                              capture_output=True, text=True, env=env, timeout=timeout_s)
        log = proc.stdout + proc.stderr
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
        run = json.loads(line[len("RESULT "):]) if line else {"error": log[-4000:]}
        run["wall_s"] = round(time.time() - t0, 1)
        run["moe_log"] = [x for x in log.splitlines() if "MoE backend" in x or "Created MegaMoE" in x
                          or "umming" in x][:8]
        run["kv_log"] = [x[-300:] for x in log.splitlines() if "KV cache" in x or "oncurrency" in x
                         or "reempt" in x or "Available" in x][:12]
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
    ap.add_argument("--backends", nargs="+", default=["megamoe_ep", "default"], help="with --compare: which to run")
    ap.add_argument("--profile", action="store_true", help="also record each backend's decode-step kernels (profile_decode)")
    args = ap.parse_args()
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        plot(result, args.plot, result.get("card", "GPU"))
        return
    if args.backend:
        print("RESULT " + json.dumps(run_backend(args.model_dir, args.backend, args.profile)), flush=True)
        os._exit(0)
    if args.compare:
        t0 = time.time()
        build_checkpoint(Path(args.model_dir), args.layers)
        import torch

        built_s = round(time.time() - t0, 1)
        result = compare(args.model_dir, args.timeout_s, args.profile, tuple(args.backends))
        result.update(card=torch.cuda.get_device_name(0), checkpoint_build_s=built_s,
                      date=time.strftime("%Y-%m-%d"), floor=floor_record(3.35))
        Path(args.out).write_text(json.dumps(result, indent=1))
        if args.plot and {"megamoe_ep", "default"} <= set(result["runs"]):  # a ratio needs both engines
            plot(result, args.plot, result["card"])


if __name__ == "__main__":
    main()
