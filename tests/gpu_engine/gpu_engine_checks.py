"""What the GPU engine runs must show, as functions of the driver's JSON (``run_matrix.py``).

Why apart from the runs: a device call has minutes, the checks need none. The same functions judge
a matrix just run on the GPU (``test_gpu_engine.py`` there) and the committed record of one
(``benchmarks/results/gpu_engine_*.json``, on any CPU), and a planted mutation of a record shows
each check can fail.

The numeric bound is the CPU engine tests' derivation (tests/vllm/logprob_bound.py): the mean
|d logprob| over the 504 teacher-forced positions between MegaMoE and vLLM's default MoE backend
stays under PROPAGATION x MARGIN x the first-order shift that the project's layer gate (bf16 1 %,
A8W4 10 %, A4W4 28 %) makes through MoE layers of the measured norm ratio rho, read off the
checkpoint's LM head. Nothing measured on a GPU enters the bound; the rhos are the model's (the
MoE output / input norms over the eager engine's own calls).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))

from layer_oracle import LAYER_GATES  # noqa: E402
from logprob_bound import mean_abs_diff, mean_shift_bound  # noqa: E402

STARTUP = "[megamoe] Created MegaMoE:"
SCORED_POSITIONS = 8 * 63


@dataclass(frozen=True)
class Comparison:
    """One engine run held against another: the mean shift, its bound, the greedy verdict."""

    label: str
    mean: float
    bound: float
    positions: int
    top: list[float]
    greedy_same: int
    greedy_ties: list

    @property
    def ok(self) -> bool:
        return self.positions >= 500 and self.mean < self.bound

    def line(self) -> str:
        return (f"{self.label}: mean |d logprob| {self.mean:.4f} over {self.positions} positions, bound {self.bound:.4f} "
                f"(largest {[round(x, 3) for x in self.top]}); greedy {self.greedy_same} identical steps, "
                f"splits at top-2 swaps {self.greedy_ties}")


def result_of(runs: dict, name: str) -> dict:
    rec = runs[name]
    if rec.get("result") is None:
        raise AssertionError(f"run {name} gave no result (rc={rec.get('rc')}):\n{rec.get('log_tail', '')[-3000:]}")
    return rec["result"]


def greedy_agreement(base: dict, other: dict) -> tuple[int, list]:
    """Tokens identical until a prompt's first split, which must be a top-2 swap (tests/vllm's rule:
    each run's token is the other run's runner-up); raises on any other split."""
    same, ties = 0, []
    for p, (ta, tb) in enumerate(zip(base["tokens"], other["tokens"], strict=True)):
        if len(ta) != len(tb):
            raise AssertionError(f"prompt {p}: {len(ta)} vs {len(tb)} generated tokens")
        for s, (a, b) in enumerate(zip(ta, tb)):
            if a == b:
                same += 1
                continue
            top_a, top_b = base["top2"][p][s], other["top2"][p][s]
            if not (str(b) in top_a and str(a) in top_b):
                raise AssertionError(f"prompt {p} step {s}: {a} vs {b} is not a top-2 swap (top-2 {top_a} vs {top_b})")
            ties.append((p, s))
            break
    return same, ties


def compare(runs: dict, reference: str, mega: str, rho_run: str, model_dir: Path, quant: str) -> Comparison:
    """``mega`` against ``reference``, bounded with the rhos of ``rho_run`` (an eager MegaMoE run of
    the same checkpoint) at ``quant``'s layer gate."""
    ref, run = result_of(runs, reference), result_of(runs, mega)
    rhos = list(result_of(runs, rho_run)["rhos"].values())
    if not rhos:
        raise AssertionError(f"run {rho_run} recorded no MoE layer call (rhos empty): the plugin did not serve")
    bound, _ = mean_shift_bound(model_dir, rhos, LAYER_GATES[quant])
    mean, positions, top = mean_abs_diff(ref["forced"], run["forced"])
    if quant == "bf16":
        same, ties = greedy_agreement(ref, run)
    else:  # quantised activations legitimately change near-tie argmaxes: the mean shift is the check (as on CPU)
        same, ties = greedy_prefix(ref, run), ["not held: quantised wire"]
    return Comparison(f"{mega} vs {reference}", mean, bound, positions, top, same, ties)


def greedy_prefix(base: dict, other: dict) -> int:
    """Identical greedy steps before each prompt's first split (reported, not held)."""
    same = 0
    for ta, tb in zip(base["tokens"], other["tokens"], strict=True):
        for a, b in zip(ta, tb):
            if a != b:
                break
            same += 1
    return same


def served_inside_capture(rec: dict, graphs: str) -> list[str]:
    """What is wrong with how a MegaMoE run served under ``graphs`` (empty list: nothing).

    Eager: the op body ran on every MoE call, its startup line says ``graphs=eager``. Graph modes:
    the startup line says ``graphs=captured`` (the layer knew the engine would capture it), the op
    body ran under stream capture (vLLM captured the layer; a host synchronisation inside it would
    have failed that capture), and fewer times eagerly than in the eager run (decode replayed)."""
    problems = []
    lines = rec.get("startup_lines", [])
    if not lines:
        return ["no startup line: the plugin did not serve"]
    want = "graphs=eager" if graphs == "eager" else "graphs=captured"
    if not all(want in line for line in lines):
        problems.append(f"startup line lacks {want}: {lines[0]}")
    calls = (rec.get("result") or {}).get("op_calls", {})
    if graphs == "eager" and calls.get("captured", 0):
        problems.append(f"op body ran under capture in an eager engine: {calls}")
    if graphs != "eager" and not calls.get("captured"):
        problems.append(f"op body never ran under stream capture: {calls}")
    return problems


# The item-1 matrix: run name -> run_matrix spec (MODEL:BACKEND:GRAPHS[:ENV]). "twin" is the bf16
# checkpoint holding the MXFP4 checkpoints' weight values: vLLM's default backend on it is the
# reference for the quantised wires (it differs from MegaMoE's A8W4 / A4W4 only by the activations).
MATRIX = {
    "default-bf16-eager": "bf16:default:eager",
    "mega-bf16-eager": "bf16:megamoe_ep:eager",
    "default-bf16-fdo": "bf16:default:full_decode_only",
    "mega-bf16-fdo": "bf16:megamoe_ep:full_decode_only",
    "default-bf16-brk": "bf16:default:breakable",
    "mega-bf16-brk": "bf16:megamoe_ep:breakable",
    "default-twin-eager": "twin:default:eager",
    "mega-a8w4-eager": "a8w4:megamoe_ep:eager:MEGA_DISPATCH_WIRE=fp8",
    "mega-a8w4-fdo": "a8w4:megamoe_ep:full_decode_only:MEGA_DISPATCH_WIRE=fp8",
    "mega-a4w4-eager": "a4w4:megamoe_ep:eager:MEGA_DISPATCH_WIRE=fp4",
}
# (reference run, MegaMoE run, run whose rhos bound it, checkpoint, scheme whose layer gate applies)
COMPARISONS = [
    ("default-bf16-eager", "mega-bf16-eager", "mega-bf16-eager", "bf16", "bf16"),
    ("default-bf16-fdo", "mega-bf16-fdo", "mega-bf16-eager", "bf16", "bf16"),
    ("default-bf16-brk", "mega-bf16-brk", "mega-bf16-eager", "bf16", "bf16"),
    ("default-twin-eager", "mega-a8w4-eager", "mega-a8w4-eager", "a8w4", "a8w4"),
    ("default-twin-eager", "mega-a8w4-fdo", "mega-a8w4-eager", "a8w4", "a8w4"),
    ("default-twin-eager", "mega-a4w4-eager", "mega-a4w4-eager", "a4w4", "a4w4"),
]


def pending_of(record: dict) -> dict[str, str]:
    """The record's runs not judged, with why (``meta.pending``)."""
    return dict(record.get("meta", {}).get("pending", {}))


def graphs_of(run_name: str) -> str:
    return {"eager": "eager", "fdo": "full_decode_only", "brk": "breakable"}[run_name.rsplit("-", 1)[1]]


def verdicts(record: dict, model_dirs: dict[str, Path]) -> list[tuple[str, bool, str]]:
    """(label, ok, line) for every check of the item-1 matrix in ``record`` (run_matrix's JSON).

    A run the record lists under ``meta.pending`` (with why: e.g. it failed before a fix that was
    never re-run on a GPU) is not judged; its checks are reported as pending (``pending_of``)."""
    runs = record["runs"]
    pending = set(record.get("meta", {}).get("pending", {}))
    out = []
    for ref, mega, rho_run, model, quant in COMPARISONS:
        if {ref, mega, rho_run} & pending:
            continue
        try:
            c = compare(runs, ref, mega, rho_run, model_dirs[model], quant)
            out.append((c.label, c.ok, c.line()))
        except AssertionError as exc:
            out.append((f"{mega} vs {ref}", False, str(exc)[:2000]))
    for name in MATRIX:
        if name in pending:
            continue
        if name.startswith("mega-"):
            problems = served_inside_capture(runs[name], graphs_of(name))
            out.append((f"{name} served", not problems, "; ".join(problems) or "startup line and op calls as expected"))
        elif runs[name].get("startup_lines"):
            out.append((f"{name} inert", False, "the default backend logged a MegaMoE startup line"))
    return out


# humming-kernels' GEMMs inside the engine: asked for by name (eager), and picked by MEGA_EXPERTS_GEMM=auto under
# FULL decode graphs (no knob: gemm_choice's rule on the GPU's facts); each against the default backend on the twin.
# `bash tests/gpu_engine/run_on_device.sh runs OUT 380 $(specs HUMMING_RUNS)` with humming-kernels in .whl.
HUMMING_RUNS = {
    "default-twin-eager": "twin:default:eager",
    "hum-a8w4-eager": "a8w4:megamoe_ep:eager:MEGA_DISPATCH_WIRE=fp8,MEGA_EXPERTS_GEMM=humming",
    "hum-a8w4-fdo": "a8w4:megamoe_ep:full_decode_only:MEGA_DISPATCH_WIRE=fp8",
}


def humming_verdicts(record: dict, model_dirs: dict[str, Path]) -> list[tuple[str, bool, str]]:
    """(label, ok, line) for the HUMMING_RUNS record: each MegaMoE run within the A8W4 bound of the default
    backend, served as its graph mode says, and its startup line naming the humming provider."""
    return served_runs_verdicts(record, "default-twin-eager", ("hum-a8w4-eager", "hum-a8w4-fdo"), model_dirs["a8w4"],
                                "a8w4", ("on humming-kernels", "experts_provider=humming"))


# A DeepSeek V3 / R1-style block-FP8 checkpoint served (issue 61): MegaMoE on the fp8 checkpoint, eager and under
# FULL decode graphs, against vLLM's default backend on its bf16 twin (the same weight values, bf16 activations),
# bounded at the fp8_block layer gate; the startup line must name the block-FP8 scheme.
# `bash tests/gpu_engine/run_on_device.sh runs OUT 380 $(specs BLOCK_FP8_RUNS)`.
BLOCK_FP8_RUNS = {
    "default-fp8twin-eager": "fp8twin:default:eager",
    "mega-fp8-eager": "fp8:megamoe_ep:eager:MEGA_DISPATCH_WIRE=fp8",
    "mega-fp8-fdo": "fp8:megamoe_ep:full_decode_only:MEGA_DISPATCH_WIRE=fp8",
}


def block_fp8_verdicts(record: dict, model_dirs: dict[str, Path]) -> list[tuple[str, bool, str]]:
    """(label, ok, line) for the BLOCK_FP8_RUNS record: each MegaMoE run within the fp8_block bound of the default
    backend on the twin, served as its graph mode says, its startup line naming quant=fp8_block."""
    return served_runs_verdicts(record, "default-fp8twin-eager", ("mega-fp8-eager", "mega-fp8-fdo"), model_dirs["fp8"],
                                "fp8_block", ("on block-FP8 experts", "quant=fp8_block"))


def served_runs_verdicts(record: dict, reference: str, megas: tuple[str, ...], model_dir: Path, quant: str,
                         startup: tuple[str, str]) -> list[tuple[str, bool, str]]:
    """(label, ok, line) per MegaMoE run of ``megas`` (the first is eager: its rhos bound them all): within
    ``quant``'s bound of ``reference``, served as its graph mode says, and every startup line holding
    ``startup[1]`` (reported as ``startup[0]``)."""
    runs, out = record["runs"], []
    for name in megas:
        try:
            c = compare(runs, reference, name, megas[0], model_dir, quant)
            out.append((c.label, c.ok, c.line()))
        except AssertionError as exc:
            out.append((f"{name} vs {reference}", False, str(exc)[:2000]))
        problems = served_inside_capture(runs[name], graphs_of(name))
        out.append((f"{name} served", not problems, "; ".join(problems) or "startup line and op calls as expected"))
        lines = runs[name].get("startup_lines") or [""]
        out.append((f"{name} {startup[0]}", all(startup[1] in line for line in lines), lines[0][:300]))
    return out


# Start-up: the same engine with an empty Triton cache (cold: every kernel JIT-compiled) and with
# the cache the matrix left (warm); and a knob the engine cannot serve, refused at start-up.
STARTUP_RUNS = {
    "cold-default-bf16-eager": "bf16:default:eager:TRITON_CACHE_DIR=fresh",
    "cold-mega-bf16-eager": "bf16:megamoe_ep:eager:TRITON_CACHE_DIR=fresh",
    "badwire-a8w4-fdo": "a8w4:megamoe_ep:full_decode_only:MEGA_DISPATCH_WIRE=fp4",
}
BAD_WIRE_NEEDLE = "MEGA_DISPATCH_WIRE=fp4 does not match the experts: quant=a8w4"


def startup_table(record: dict) -> dict[str, dict]:
    """Per backend: cold and warm engine start-up (s) and the JIT share (cold - warm) / cold."""
    runs, out = record["runs"], {}
    for backend in ("default", "mega"):
        cold, warm = runs.get(f"cold-{backend}-bf16-eager", {}), runs.get(f"{backend}-bf16-eager", {})
        c, w = (cold.get("result") or {}).get("init_s"), (warm.get("result") or {}).get("init_s")
        out[backend] = {"cold_init_s": c, "warm_init_s": w,
                        "jit_share": None if not (c and w) else round((c - w) / c, 3)}
    return out


def refused_at_startup(rec: dict, needle: str) -> list[str]:
    """The engine did not start, and its log names the knob (empty list: as it should be)."""
    problems = []
    if rec.get("result") is not None or rec.get("rc") == 0:
        problems.append(f"the engine started (rc={rec.get('rc')})")
    if needle not in rec.get("log_tail", ""):
        problems.append(f"the log does not say {needle!r}")
    return problems


def dp_matches_ep1(record: dict) -> list[tuple[str, bool, str]]:
    """(label, ok, line) for serve_dp's record: every DP rank's output equals, bit for bit, the same
    work run by one ep_size-1 engine (the bf16 wire's sum is independent of the EP size:
    layer/megamoe_layer.py), the ranks ran the device P2P forward over ipc (graphs=captured where the
    engine captures), and a rank ran out of work before the other (vLLM's dummy steps then carried
    the EP forwards: the other rank could not have finished without them)."""
    out = []
    for mode, m in record["modes"].items():
        ep1 = m["ep1"]["results"]
        lengths = []
        for r in m["ranks"]:
            got, want = r["results"][str(r["rank"])], ep1[str(r["rank"])]
            diffs = [abs(a - b) for ga, gb in zip(got["forced"], want["forced"], strict=True)
                     for a, b in zip(ga, gb, strict=True)]
            same = got["tokens"] == want["tokens"] and max(diffs) == 0.0
            lengths.append(max(len(t) for t in got["tokens"]))
            out.append((f"dp {mode} rank {r['rank']} = ep 1", same,
                         f"{len(diffs)} teacher-forced positions, max |d logprob| {max(diffs)}, "
                         f"greedy tokens {'equal' if got['tokens'] == want['tokens'] else 'DIFFER'}"))
        graphs = "graphs=eager" if mode == "eager" else "graphs=captured"
        created = [line for rank_lines in m["startup_lines"] for line in rank_lines if "Created MegaMoE" in line]
        ok = len(created) == len(m["ranks"]) and all("ep_size=2" in x and "p2p over ipc" in x and graphs in x
                                                     for x in created)
        out.append((f"dp {mode} startup", ok, "; ".join(created) or "no startup line"))
        out.append((f"dp {mode} idle rank", len(set(lengths)) > 1, f"tokens generated per rank {lengths}"))
    return out


PEER_EXIT_NEEDLE = "exit status 70"  # layer/device/process_end.py: what a peer timeout logs as it ends the process
# what the engine's own host collectives (vLLM's per-step DP all-reduce over gloo) raise once a peer process is gone
ENGINE_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_kill_ended(record: dict) -> list[tuple[str, bool, str]]:
    """(label, ok, line) for serve_dp's fault test (``KILL`` record): a DP rank SIGKILLed while every
    rank replays FULL decode graphs; each survivor must end by itself within the record's bound,
    with a failing exit status and a log that says why: the plugin's peer timeout
    (PEER_EXIT_NEEDLE, docs/ep-device.md) or the engine's own collective failing on the lost rank
    (ENGINE_LOST_PEER). A survivor
    still serving (SURVIVED_LOOP, or killed by the launcher at the bound) missed the dead peer."""
    out = [("kill: every rank served before the kill", bool(record.get("ready_before_kill")),
            f"killed rank {record.get('killed_rank')} after {record.get('kill_after_s')} s of serving")]
    survivors = record.get("survivors") or {}
    if not survivors:
        return out + [("kill: survivors", False, "no survivor recorded")]
    for rank, s in survivors.items():
        lines = s.get("cause_lines", [])
        ended, rc = s.get("ended_after_s"), s.get("rc")
        in_time = ended is not None and ended <= record["bound_s"]
        said = [x for x in lines if PEER_EXIT_NEEDLE in x or any(k in x for k in ENGINE_LOST_PEER)]
        ok = in_time and rc not in (0, None) and bool(said) and not any("SURVIVED_LOOP" in x for x in lines)
        out.append((f"kill: rank {rank} ended by itself", ok,
                    f"rc {rc} after {ended} s (bound {record['bound_s']} s, MEGA_P2P_TIMEOUT_S "
                    f"{record.get('p2p_timeout_s')}); {said[-1][-300:] if said else 'no line says why'}"))
    return out
