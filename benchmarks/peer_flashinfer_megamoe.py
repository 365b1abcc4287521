"""Peer ``flashinfer_megamoe_sm90``: FlashInfer 0.7.4's fused SM90 MegaMoE, MXFP4 weights x FP8 activations.

What it is: the ``sm90_fp8_mxfp4_bf16_pull_cutedsl`` mega kernel of ``flashinfer.moe_ep``
(``flashinfer/moe_ep/backends/mega/kernel/sm90/fp8_mxfp4_bf16_pull_cutedsl/``): one CuTe DSL kernel
(CUTLASS DSL 4.8) that pulls the token rows (dispatch), runs FC1, the clamped SwiGLU, FC2 and sends the
rows back (combine), then FlashInfer's top-k reduce sums them: one route-weighted bf16 row per token,
as the project's layer and the other peers. Its numbers, as its sources state them: weights prepared
"Humming style" at load (each expert's E8M0 exponents clamped to an 11-binade window, the FP4 payload
rewritten, offsets folded; the kernel forms E4M3 weights in registers), activations E4M3 with ONE fp32
scale per token row (the whole hidden), the route weight applied after SwiGLU, FC2's input re-quantised
per 64 columns inside the kernel, one FP32 accumulator (``1xacc``), a bf16 combine.

Who runs it by default: nobody yet. Neither vLLM 0.34 nor SGLang 0.5.23 enables FlashInfer's MoE-EP
mega kernels on Hopper (their Hopper MXFP4 defaults are the ``vllm_humming`` and ``flashinfer_w4a16``
peers); it is what a user would get by calling FlashInfer 0.7.4's ``MoEEpLayer`` directly, and what an
engine would run once it wires that API in. It answers: against FlashInfer's own fused MegaMoE, where
does the project stand.

How it is called, as FlashInfer's own test calls it (``tests/moe_ep/test_moe_ep_sm90_pull_mxfp4_mega_
multirank.py``; ``MoEEpLayer`` / ``MoEEpMegaLayer`` docstrings), with the public names of
``flashinfer.moe_ep``:

1. ``load``: the bench's MXFP4 bytes in FlashInfer's raw ABI (``peer_weights.to_flashinfer_megamoe``:
   ``PrequantizedMoEWeights``, FC1 rows [gate; up], bytes unchanged), then
   ``MoEEpLayer(BootstrapConfig(world_size=1, rank=0, device=...), FleetParams(num_experts=E,
   max_tokens_per_rank=..., token_hidden_size=H), weights, backend=MegaConfig(megakernel=
   Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig(intermediate_size=I, top_k=k, gate_up_clamp=limit),
   quantize_input=True, preprocess_weights=True))``: FlashInfer's own ``preprocess_weights`` runs there.
2. ``bind`` at T tokens: ``layer.create_workspace(T)`` (a workspace whose capacity is exactly the batch,
   as an engine capturing a graph per batch size would hold; FlashInfer's default tactic is chosen per
   capacity bucket), ``MoEEpTensors(x bf16, topk_ids int64, topk_weights fp32, output=bf16 [T, H])``;
   the timed call is ``layer.forward(tensors, workspace=ws)``: validation (host), the per-token FP8
   quantisation + staging, the fused kernel, the top-k reduce into ``output``.
3. ``warm``: ``layer.warmup(tensors, workspace=ws)`` (FlashInfer's documented step before a capture:
   ``cute.compile`` + one forward), then the bench captures the call in one CUDA graph (FlashInfer's
   graph test captures ``layer.forward`` the same way).

ep_size 1 on one GPU runs with ``MEGA_NO_DIST=1`` (set here unless the caller set it): FlashInfer's
single-rank mode ("Use MEGA_NO_DIST=1 for single-rank tuning", ``flashinfer/moe_ep/tune.py``), where the
workspace is plain CUDA memory instead of an NVSHMEM heap and no process group is made; the kernel, its
compile key and its launch are the ones an EP rank runs, with every peer offset 0. So nvshmem4py,
nccl4py, cuda-tile and cuDNN's frontend are not needed. Tactic: ``knobs=None``: FlashInfer's knob cache
(``FLASHINFER_MOE_EP_KNOB_CACHE``, empty on a fresh machine) else its per-token-bucket default table
(``hopper_mxfp4_default_tactic``); ``tactic`` says which ran. ``knobs="auto"`` (an online sweep compiling
~22 candidates, minutes per bucket; FlashInfer: "tune offline for serving") is not run. Not covered: EP
ranks (``load`` raises: FlashInfer's EP dispatch runs between processes over NVSHMEM; the bench's
emulated rank share is not this kernel's API).

Needs (the bundle benchmarks/research/flashinfer074_bundle.py builds, flashinfer074_setup.sh installs):
flashinfer-python 0.7.4 (trimmed to this path), apache-tvm-ffi, nvidia-cutlass-dsl 4.8.1 (libs base /
core / cu13) with its ``dsl_packages`` on PYTHONPATH, FlashInfer's prebuilt ``fused_moe_90`` module (only
its ``interleave_moe_weights_for_sm90_mixed_gemm`` op runs, at weight load), the device image's
cuda-bindings / numpy / nvidia-ml-py, a CUDA sm_90 GPU. The FlashInfer 0.7.2 peers (``flashinfer_humming``
/ ``flashinfer_w4a16``) import another ``flashinfer``: run this peer in its own process.

On the GPU machine (no network): each ``.fi074/partN`` carried in a call of its own (with SHA256 in the first) and
copied out of the tree there (``mkdir -p /tmp/fi074 && cp .fi074/* /tmp/fi074/``): a later call's carry replaces the
whole ``.fi074`` folder, so a part left in the tree is gone by the next call; /tmp stays while the machine is warm.
Then, on the same warm machine:

    eval "$(bash benchmarks/research/flashinfer074_setup.sh /tmp/fi074)"
    python3 -m benchmarks.peer_flashinfer_megamoe --out $OUT/fi_megamoe_smoke.json --tokens 8 1024
    python3 -m benchmarks.bench_experts --experts 48 --tokens 8 128 1024 8192 --schemes a8w4 \\
        --peers flashinfer_megamoe_sm90 --json $OUT/h100_experts_fi_megamoe.json
"""

from __future__ import annotations

import json
import os
import time

import torch

from . import peer_api as peers
from .peer_weights import to_flashinfer_megamoe
from .peer_api import Peer, PeerUnavailable, weights_key

PEER = "flashinfer_megamoe_sm90"
KERNEL = "sm90_fp8_mxfp4_bf16_pull_cutedsl"
BUNDLE_FIX = ("on the GPU machine: eval \"$(bash benchmarks/research/flashinfer074_setup.sh /tmp/fi074)\" "
              "(FlashInfer 0.7.4 + CUTLASS DSL bundle: benchmarks/research/flashinfer074_bundle.py)")
DROP = "flashinfer.moe_ep.kernel_src.sm90.pull_style_cutedsl_megakernel"


def _unavailable(reason: str) -> PeerUnavailable:
    return PeerUnavailable(f"{PEER}: {reason}")


def _import_stack() -> dict:
    """FlashInfer 0.7.4's public MoE-EP names, the kernel drop's tactic resolvers and the CuTe DSL this
    peer needs; PeerUnavailable naming the first one missing."""
    try:
        import flashinfer
        from flashinfer.moe_ep import (
            BootstrapConfig,
            FleetParams,
            MegaConfig,
            MoEEpLayer,
            MoEEpTensors,
            PrequantizedMoEWeights,
            Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
        )
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to skip
        raise _unavailable(f"import flashinfer.moe_ep (FlashInfer 0.7.4's SM90 MXFP4 MegaMoE) failed "
                           f"({type(exc).__name__}: {str(exc)[:200]}); {BUNDLE_FIX}") from None
    try:
        import cutlass
        import cutlass.cute  # noqa: F401 - the kernel is CuTe DSL: compiled at the first forward
    except Exception as exc:  # noqa: BLE001
        raise _unavailable(f"import cutlass (nvidia-cutlass-dsl, the CuTe DSL the kernel is written in) failed "
                           f"({type(exc).__name__}: {str(exc)[:200]}); {BUNDLE_FIX}") from None
    try:
        import importlib

        drop = importlib.import_module(DROP)
        resolve, default = drop.resolve_hopper_mxfp4_knobs, drop.hopper_mxfp4_default_tactic
    except Exception as exc:  # noqa: BLE001
        raise _unavailable(f"FlashInfer's SM90 kernel drop ({DROP}) did not import ({type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None
    return {"flashinfer": flashinfer, "cutlass": cutlass, "BootstrapConfig": BootstrapConfig,
            "FleetParams": FleetParams, "MegaConfig": MegaConfig, "MoEEpLayer": MoEEpLayer,
            "MoEEpTensors": MoEEpTensors, "PrequantizedMoEWeights": PrequantizedMoEWeights,
            "Config": Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig, "resolve_knobs": resolve,
            "default_tactic": default}


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - a tree on PYTHONPATH without its dist-info
        return "?"


def make_peer():
    """The peer, or PeerUnavailable: imports first (the reason a CPU box gives), then the GPU. Any other
    failure while making it is a skip with its reason too: the bench must not stop."""
    try:
        return _make_peer()
    except PeerUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _unavailable(f"could not be made ({type(exc).__name__}: {str(exc)[:300]})") from None


def _make_peer():
    stack = _import_stack()
    device = peers.require_cuda(PEER)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise _unavailable(f"sm_{major}{minor}: the {KERNEL} kernel is compiled for sm_90 (Hopper) only")
    return FlashInferMegaMoE(stack, device)


class FlashInferMegaMoE(Peer):
    """FlashInfer 0.7.4's ``MoEEpLayer`` on its SM90 MXFP4 x FP8 mega kernel, at ep_size 1 (module docstring)."""

    name = PEER
    weights_fmt = "mxfp4"

    def __init__(self, stack: dict, device: torch.device) -> None:
        super().__init__()
        self.s, self.device = stack, device
        self.version = (f"flashinfer-python {stack['flashinfer'].__version__} + nvidia-cutlass-dsl "
                        f"{getattr(stack['cutlass'], '__version__', None) or _dist_version('nvidia-cutlass-dsl-libs-base')}")
        self.config = ""
        self.scope = ("whole MoE call: MoEEpMegaLayer.forward = input validation + FP8 per-token quantisation and "
                      "staging + fused dispatch / FC1 / SwiGLU(limit) / FC2 / combine kernel + top-k reduce "
                      "(bf16 token rows in, one bf16 row per token out)")
        self.layer = None
        self.workspaces: dict[int, object] = {}  # tokens -> MoEEpMegaWorkspace (the one bound last only)
        self.tactics: dict[int, str] = {}
        self.shape = None

    def _describe(self, shape) -> str:
        mode = "MEGA_NO_DIST=1: plain CUDA workspace, no NVSHMEM" if os.environ.get("MEGA_NO_DIST") == "1" else \
            f"MEGA_NO_DIST={os.environ.get('MEGA_NO_DIST')!r}: torch.distributed + NVSHMEM bootstrap"
        return (f"MoEEpLayer(MegaConfig({self.s['Config'].__name__}(intermediate_size={shape.intermediate}, "
                f"top_k={shape.topk}, gate_up_clamp={shape.swiglu_limit}, knobs=None), quantize_input=True, "
                f"preprocess_weights=True)), ep_size 1 ({mode}); one workspace per token count "
                "(create_workspace(T)); FP8 e4m3 activations, one fp32 scale per token row; Humming MXFP4 weights "
                "(E8M0 range 11); route weight before FC2; bf16 combine; warmup() then one CUDA graph")

    def load(self, weights, shape, *, max_tokens, ep_size=1, ep_rank=0):
        if ep_size != 1:
            raise RuntimeError(f"{PEER}: EP ranks not covered (FlashInfer's EP dispatch runs between processes "
                               "over NVSHMEM; the bench's emulated rank share is not this kernel's API)")
        key = weights_key(weights)
        self.experts, self.ep_size, self.ep_rank = weights.num_experts, 1, 0
        if key == self.loaded_key and self.layer is not None and shape == self.shape:
            return
        self.release()
        torch.cuda.empty_cache()
        os.environ.setdefault("MEGA_NO_DIST", "1")  # FlashInfer reads it at call time (module docstring)
        s = self.s
        raw = to_flashinfer_megamoe(weights.to(self.device))
        pack = s["PrequantizedMoEWeights"](w13=raw.w13, w2=raw.w2, w13_scale=raw.w13_scale, w2_scale=raw.w2_scale)
        del raw
        config = s["Config"](intermediate_size=shape.intermediate, top_k=shape.topk,
                             gate_up_clamp=None if shape.swiglu_limit is None else float(shape.swiglu_limit))
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.layer = s["MoEEpLayer"](
            bootstrap=s["BootstrapConfig"](world_size=1, rank=0, device=index),
            fleet_params=s["FleetParams"](num_experts=weights.num_experts, max_tokens_per_rank=max(1, int(max_tokens)),
                                          token_hidden_size=shape.hidden),
            weights=pack,
            backend=s["MegaConfig"](megakernel=config, quantize_input=True, preprocess_weights=True))
        del pack  # the layer keeps its transformed weights only (MoEEpMegaLayer's memory invariant)
        self.shape, self.loaded_key, self.config = shape, key, self._describe(shape)

    def _workspace(self, tokens: int):
        """The workspace of capacity ``tokens`` (made on first use); the previous token count's one is
        destroyed first (FlashInfer: synchronise and retire its graphs before; the bench's graph of the
        previous case is gone by the next bind)."""
        if tokens in self.workspaces:
            return self.workspaces[tokens]
        for other in list(self.workspaces):
            torch.cuda.synchronize()
            self.workspaces.pop(other).destroy()
        ws = self.layer.create_workspace(tokens)
        self.workspaces[tokens] = ws
        self.tactics[tokens] = self._tactic_of(tokens)
        return ws

    def _tactic_of(self, tokens: int) -> str:
        """The tactic FlashInfer resolves for this capacity, with ``knobs=None`` as the layer does, and
        where it came from (its knob cache, or its per-token-bucket default)."""
        sh = self.shape
        try:
            tactic = self.s["resolve_knobs"](None, world_size=1, hidden=sh.hidden, intermediate=sh.intermediate,
                                             num_total_experts=self.experts, num_topk=sh.topk, num_max_tokens=tokens,
                                             gate_up_clamp=sh.swiglu_limit)
            source = ("default table" if tactic == self.s["default_tactic"](tokens) else "knob cache / first legal")
            return f"{source}: {json.dumps(tactic, default=str, sort_keys=True)}"
        except Exception as exc:  # noqa: BLE001 - a report, never a reason to stop
            return f"? ({type(exc).__name__}: {str(exc)[:120]})"

    def bind(self, x, ids, weights):
        t = x.shape[0]
        ws = self._workspace(t)
        out = torch.empty(t, self.shape.hidden, dtype=torch.bfloat16, device=x.device)
        tensors = self.s["MoEEpTensors"](hidden_states=x.to(torch.bfloat16).contiguous(),
                                         topk_ids=ids.to(torch.int64).contiguous(),
                                         topk_weights=weights.to(torch.float32).contiguous(), output=out)
        layer = self.layer

        def call():
            return layer.forward(tensors, workspace=ws)  # writes ``out`` (the caller's output) and returns it

        call.tensors, call.workspace = tensors, ws  # warm's FlashInfer warmup takes the same inputs
        return call

    def warm(self, call):
        tensors = getattr(call, "tensors", None)
        if tensors is None:
            return call()
        self.layer.warmup(tensors, workspace=call.workspace)  # cute.compile + one forward, then a sync
        return tensors.output

    def tactic(self, tokens):
        return self.tactics.get(tokens, "")

    def release(self):
        if self.layer is not None:
            torch.cuda.synchronize()
            for ws in self.workspaces.values():
                ws.destroy()
            self.layer.destroy()
        self.layer, self.workspaces, self.tactics = None, {}, {}
        self.loaded_key = None


# ----------------------------------------------------------------------------------- smoke run
IMPORT_PROBES = ("torch", "tvm_ffi", "flashinfer", "flashinfer.moe_ep", "cuda.bindings.driver", "cutlass",
                 "cutlass.cute", DROP, "flashinfer.fused_moe.prepare")


def probe_imports() -> dict:
    """Each module the path needs, imported in order: ok + version + file, or the error with its traceback
    (what the device run must say when an import or a JIT fails)."""
    import importlib
    import traceback

    out = {}
    for name in IMPORT_PROBES:
        try:
            mod = importlib.import_module(name)
            out[name] = {"ok": True, "version": str(getattr(mod, "__version__", "")),
                         "file": str(getattr(mod, "__file__", ""))}
        except BaseException as exc:  # noqa: BLE001 - recorded, including SystemExit from a broken import
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
    fi = out.get("flashinfer", {})
    if fi.get("ok"):
        from pathlib import Path

        aot = Path(fi["file"]).parent / "data" / "aot" / "fused_moe_90" / "fused_moe_90.so"
        out["fused_moe_90 AOT module"] = {"ok": aot.is_file(), "file": str(aot)}
    return out


def main(argv: list[str] | None = None) -> int:
    """Smoke run of this peer alone: ``python -m benchmarks.peer_flashinfer_megamoe --out X.json
    [--experts 48] [--tokens 8 1024]``; DSV4-Pro expert shapes, the bench's weights / routing / per-token
    relL2 (bench experts' TokenCheck), timed by peers.time_peer (warm, relL2, CUDA graph). Writes the JSON
    after every step; each step's failure is recorded with its traceback, never raised."""
    import sys
    import traceback
    from dataclasses import asdict


    ap = peers.smoke_parser("peer_flashinfer_megamoe")
    args = ap.parse_args(argv)
    t0 = time.time()
    rec: dict = {"args": vars(args), "steps": [], "results": []}

    def save():
        rec["wall_s"] = round(time.time() - t0, 1)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1, default=str)

    def step(name: str, fn):
        """Run one step, record its seconds and result or its error + traceback; True when it passed."""
        s = time.time()
        entry = {"step": name}
        rec["steps"].append(entry)
        try:
            got = fn()
            if got is not None:
                entry["result"] = got
            entry["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - recorded
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-4000:])
            if isinstance(exc, KeyboardInterrupt):
                raise
        entry["s"] = round(time.time() - s, 2)
        save()
        return entry["ok"]

    env_keys = ("PYTHONPATH", "MEGA_NO_DIST", "FLASHINFER_DISABLE_JIT", "FLASHINFER_WORKSPACE_BASE",
                "FLASHINFER_CUDA_ARCH_LIST", "FLASHINFER_MOE_EP_KNOB_CACHE", "LD_LIBRARY_PATH", "CUDA_HOME")
    step("environment", lambda: {"python": sys.version, "torch": torch.__version__,
                                 "cuda": torch.cuda.is_available() and torch.cuda.get_device_name(0),
                                 "env": {k: os.environ.get(k) for k in env_keys}})
    step("imports", lambda: probe_imports())
    state: dict = {}

    def select():
        try:
            ready, skipped = [make_peer()], []
        except PeerUnavailable as exc:
            ready, skipped = [], [peers.Skipped(PEER, str(exc))]
        rec["peers"] = peers.describe(ready, skipped)
        state["peer"] = ready[0] if ready else None
        return rec["peers"]

    step("make the peer", select)
    peer = state.get("peer")
    if peer is None:
        save()
        print(json.dumps({k: v for k, v in rec.items() if k != "steps"}, default=str)[:6000])
        return 0
    from .bench_data import TokenCheck, make_routing, make_weights
    from .references import check_tokens

    dev = torch.device("cuda", torch.cuda.current_device())
    shape = peers.PeerShape(args.hidden, args.intermediate, args.topk, args.swiglu_limit)

    def weights():
        state["fp4"], state["bf16"] = make_weights(args.experts, args.hidden, args.intermediate, dev, 0)

    def load():
        peer.load(state["fp4"], shape, max_tokens=max(args.tokens))
        torch.cuda.synchronize()
        return {"config": peer.config, "memory_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}

    if step("make weights", weights) and step("load (FlashInfer preprocess_weights)", load):
        for tokens in args.tokens:
            x, pairs = make_routing(tokens, args.experts, args.topk, args.hidden, dev, tokens)
            check = TokenCheck(x, pairs, state["bf16"], args.swiglu_limit,
                               check_tokens(tokens, peers.CHECK_TOKENS, 0, dev))
            ids, w = pairs.slot.view(tokens, args.topk), pairs.weight.view(tokens, args.topk)

            def warm(x=x, ids=ids, w=w, check=check, tokens=tokens):
                call = peer.bind(x, ids, w)
                y = peer.warm(call)
                torch.cuda.synchronize()
                return {"tactic": peer.tactic(tokens), "relL2": float(check.of_tokens(y))}

            if step(f"bind + warmup (cute.compile) at {tokens} tokens", warm):
                rec["results"].append(asdict(peers.time_peer(peer, x, ids, w, check.of_tokens)))
                save()
    step("release", peer.release)
    save()
    print(json.dumps({k: v for k, v in rec.items() if k != "steps"}, default=str)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
