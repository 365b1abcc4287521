"""The experts bench's figures as a serving engineer reads them: MegaMoE against what each engine runs by default.

    python -m benchmarks.engine_ratios RESULT.json [--markdown OUT.md] [--plot OUT.png]

Why a separate view: ``bench_experts --peers --humming`` writes every figure of one run (the project's
providers, the peers, naive torch, the floors), but the question a user asks is "against what my engine
runs, how much faster or slower": one row per bucket, one ratio per engine. The plot draws those ratios on a
linear axis around 1.0 (a log-log plot of µs hides 15 % gaps). Each peer is named by what it is and which
engine runs it by default (ENGINE_PEERS); a peer absent from the JSON is a column of dashes, never a guess.
"""

from __future__ import annotations

import argparse
import json
import math

# peer name in the bench JSON -> (column title, who runs it by default)
ENGINE_PEERS = {
    "vllm_humming": ("vLLM default", "vLLM 0.33 / 0.34 on Hopper: humming-kernels, FP8 activations at group 128"),
    "flashinfer_w4a16": ("SGLang default", "SGLang 0.5.23 on Hopper: FlashInfer CUTLASS MXFP4 x BF16 (W4A16)"),
    "flashinfer_humming": ("SGLang opt-in", "SGLang's --flashinfer-mxfp4-moe-precision fp8: FlashInfer CUTLASS MXFP4 x FP8"),
    "triton_kernels": ("triton_kernels", "OpenAI triton_kernels matmul_ogs (vLLM's Triton MXFP4 path)"),
    "flashinfer_megamoe_sm90": ("FlashInfer MegaMoE", "FlashInfer 0.7.4's fused SM90 MXFP4 x FP8 MegaMoE (moe_ep): "
                                "no engine enables it on Hopper yet"),
}
PROVIDERS = {"triton": "MegaMoE (Triton GEMMs)", "humming": "MegaMoE (humming-kernels GEMMs)"}


def rows(result: dict, scheme: str = "a8w4") -> list[dict]:
    """One dict per (experts, tokens): the project's µs per provider, each peer's µs, naive torch, floors."""
    table: dict[tuple[int, int], dict] = {}
    for r in result.get("results", []):
        key = (r["experts"], r["tokens"])
        row = table.setdefault(key, {"experts": key[0], "tokens": key[1], "peers": {}})
        if r.get("error"):
            continue
        if r["provider"] in PROVIDERS and r["scheme"] == scheme:
            row[r["provider"]] = r["us"]
            row.setdefault("floor_measured_us", r.get("floor_measured_us"))
            row.setdefault("floor_us", r.get("floor_us"))
        elif r["provider"] == "torch_grouped_mm":
            row["torch"] = r["us"]
    for p in result.get("peers", []):
        if p.get("ep_size", 1) == 1 and p.get("us") and not p.get("error"):
            table.setdefault((p["experts"], p["tokens"]), {"experts": p["experts"], "tokens": p["tokens"],
                                                           "peers": {}})["peers"][p["peer"]] = p["us"]
    return [table[k] for k in sorted(table)]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b and math.isfinite(a) and math.isfinite(b) else None


def markdown(result: dict, provider: str = "triton") -> str:
    """The table: µs of MegaMoE's experts (``provider``), each engine's default, naive torch, the floor; ratios."""
    peers = [p for p in ENGINE_PEERS if any(p in r["peers"] for r in rows(result))]
    head = ["local experts x tokens", PROVIDERS[provider]] + [ENGINE_PEERS[p][0] for p in peers] + \
           ["naive torch", "floor (measured)"] + [f"/ {ENGINE_PEERS[p][0]}" for p in peers]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    fr = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for r in rows(result):
        mine = r.get(provider)
        cells = [f"{r['experts']} x {r['tokens']}", fmt(mine)] + [fmt(r["peers"].get(p)) for p in peers] + \
                [fmt(r.get("torch")), fmt(r.get("floor_measured_us"))] + [fr(ratio(mine, r["peers"].get(p))) for p in peers]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(result: dict, path: str) -> None:
    """MegaMoE / peer per bucket (below 1: MegaMoE faster), one panel per expert count, linear axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(result)
    counts = sorted({r["experts"] for r in table})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.2), squeeze=False)
    for ax, n in zip(axes[0], counts):
        sub = [r for r in table if r["experts"] == n]
        xs = range(len(sub))
        for prov, label in PROVIDERS.items():
            for peer, (title, _) in ENGINE_PEERS.items():
                ys = [ratio(r.get(prov), r["peers"].get(peer)) for r in sub]
                if any(y is not None for y in ys):
                    ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o" if prov == "triton" else "s",
                            linestyle="-" if prov == "triton" else "--", label=f"{label.split(' (')[1][:-1]} / {title}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs), [str(r["tokens"]) for r in sub])
        ax.set_xlabel("tokens")
        ax.set_ylabel("MegaMoE µs / peer µs (below 1: MegaMoE faster)")
        ax.set_title(f"{n} local experts, A8W4, {result.get('meta', {}).get('gpu', {}).get('name', '')}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--provider", choices=list(PROVIDERS), default="triton", help="whose figures the table shows")
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    result = json.load(open(args.json))
    text = markdown(result, args.provider)
    print(text)
    if args.markdown:
        open(args.markdown, "w").write(text + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
