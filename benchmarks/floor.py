"""The floor of one experts forward: the time no kernel can beat, and which limit sets it.

    floor = max(bytes of the weights of the experts hit / HBM bandwidth, FLOPs / MMA peak)

Why one module: every bench printed a floor, and they all divided the FLOPs by the bf16 MMA peak.
With MX activations (A8W4, A4W4) both GEMMs run FP8 MMA on Hopper (frag8: the A rows re-scaled to
e4m3, the e2m1 weights widened to e4m3 in registers), so their tensor-core limit is the FP8 peak,
twice the bf16 one: against bf16, the 8192-token bucket read 1.23x its floor while it was 2.5x
(issue 35). The peak now follows the operands: FP8 when the activations are MX and the weights are
MXFP4 (Hopper has no FP4 MMA: e2m1 A rows run as e4m3), bf16 otherwise (bf16 activations, or bf16
weights, which an FP8 MMA cannot take as they are). It is the floor of the operands, not of the
decoder that ran: an A8W4 forward on a bf16-MMA decoder (frag, split) is still held to the FP8 one.

What the floor counts, and why it is a lower bound:
- weights: each expert with at least one pair reads its whole W1 (2I x H) and W2 (H x I) once, in the
  checkpoint's format (MXFP4: 4 bits + one E8M0 byte per 32; frag8 re-lays the same bytes, plus an
  fp32 scale per row). The activation and output rows are left out: small beside the weights at
  decode, and under the MMA at prefill (DSV4-Pro, 8192 tokens: ~1.4 GB, 290 µs at 4.8 TB/s, against
  3282 µs of FP8 MMA), so counting them would not move the bound that decides.
- FLOPs: 2 x P x H x 2I (GEMM1) + 2 x P x I x H (GEMM2) = 6 P H I for P (token, expert) pairs.
- HBM and MMA are taken as overlapping perfectly: the max, not the sum.

Ceilings are inputs (bytes/s, FLOP/s per MMA kind): the datasheet of the card the run is on
(``datasheet_for``: H200, H100; recorded in meta.ceilings and read back from there by
``datasheet_of``), or what a run measured (``bench_experts.measure_ceilings``: a copy, a bf16 GEMM, an
FP8 ``torch._scaled_mm``). Why per card: an H100 run once printed floors at the H200's 4.8 TB/s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megamoe_backend.formats import MX_BLOCK


@dataclass(frozen=True)
class Datasheet:
    """A card's datasheet ceilings (dense, no sparsity): the datasheet floor's inputs."""

    name: str
    hbm_bytes_per_s: float
    mma_flops_per_s: dict  # MMA kind ("bf16", "fp8") -> FLOP/s

    def ceilings(self) -> dict:
        """The fields meta.ceilings holds for it, in the units the JSON and tables print."""
        return {"datasheet": self.name, "hbm_tbs": self.hbm_bytes_per_s / 1e12,
                "bf16_tflops": self.mma_flops_per_s["bf16"] / 1e12, "fp8_tflops": self.mma_flops_per_s["fp8"] / 1e12}


H200_SXM = Datasheet("H200 SXM", 4.8e12, {"bf16": 989.4e12, "fp8": 1978.9e12})  # HBM3e
H100_SXM = Datasheet("H100 SXM", 3.35e12, {"bf16": 989.4e12, "fp8": 1978.9e12})  # HBM3
H100_PCIE = Datasheet("H100 PCIe", 2.0e12, {"bf16": 756.0e12, "fp8": 1513.0e12})  # HBM2e


def datasheet_for(gpu_name: str) -> Datasheet:
    """The datasheet of the card ``gpu_name`` (``torch.cuda.get_device_name``) names. Another card gets
    the H200 SXM's figures under a name that says so: its floor is then a lead, its measured floor
    (floor_measured_us) the figure to read."""
    upper = gpu_name.upper()
    if "H200" in upper:
        return H200_SXM
    if "H100" in upper:
        return H100_PCIE if "PCIE" in upper else H100_SXM
    return replace(H200_SXM, name=f"H200 SXM (no datasheet here for {gpu_name!r})")


def datasheet_ceilings(device: torch.device) -> dict:
    """meta.ceilings' datasheet fields for the card ``device`` is (the H200's off CUDA)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return datasheet_for(name).ceilings()


def datasheet_of(ceilings: dict | None) -> Datasheet:
    """The datasheet a run recorded in meta.ceilings (hbm_tbs, bf16_tflops, fp8_tflops: every bench JSON
    holds them; ``datasheet`` names the card since 2026-12-06, older files used the H200's figures); the
    H200's where no ceilings were recorded (a CPU run)."""
    c = ceilings or {}
    if not all(k in c for k in ("hbm_tbs", "bf16_tflops", "fp8_tflops")):
        return H200_SXM
    return Datasheet(c.get("datasheet", H200_SXM.name), c["hbm_tbs"] * 1e12,
                     {"bf16": c["bf16_tflops"] * 1e12, "fp8": c["fp8_tflops"] * 1e12})


WEIGHT_FORMATS = ("bf16", "mxfp4", "fp8_block")
ACTIVATION_FORMATS = (None, "fp8", "fp4", "fp8_g128")  # ExpertMath.a_format: None = bf16 rows


@dataclass(frozen=True)
class Floor:
    us: float  # max(hbm_us, mma_us)
    hbm_us: float  # weights of the experts hit / HBM bandwidth
    mma_us: float  # FLOPs / the peak of the MMA kind below
    mma: str  # the MMA kind whose peak was used: "fp8" or "bf16"
    bound: str  # what sets the floor: "hbm" or "mma"


def weight_bytes_per_expert(hidden: int, intermediate: int, fmt: str) -> int:
    """Bytes of one expert's W1 (2I x H) + W2 (H x I): bf16, MXFP4 (4-bit codes + a scale byte per 32), or block-FP8
    (e4m3 bytes + an fp32 scale per 128 x 128 block)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt!r}: expected one of {WEIGHT_FORMATS}")
    elems = 3 * hidden * intermediate
    if fmt == "fp8_block":
        return elems + 4 * (elems // (128 * 128))
    return elems * 2 if fmt == "bf16" else elems // 2 + elems // MX_BLOCK


def expert_flops(pairs: int, hidden: int, intermediate: int) -> int:
    """FLOPs of both GEMMs for ``pairs`` (token, expert) pairs: 4 P H I (GEMM1, gate + up) + 2 P H I (GEMM2)."""
    return 6 * pairs * hidden * intermediate


def mma_kind(weight_fmt: str, a_fmt: str | None) -> str:
    """The MMA a Hopper kernel can run the GEMMs on: FP8 for MX activations on MXFP4 weights, else bf16."""
    if weight_fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_fmt!r}: expected one of {WEIGHT_FORMATS}")
    if a_fmt not in ACTIVATION_FORMATS:
        raise ValueError(f"activation format {a_fmt!r}: expected one of {ACTIVATION_FORMATS}")
    return "fp8" if a_fmt is not None and weight_fmt in ("mxfp4", "fp8_block") else "bf16"


def expert_floor(*, experts_hit: int, pairs: int, hidden: int, intermediate: int, weight_fmt: str,
                 a_fmt: str | None, hbm_bytes_per_s: float, mma_flops_per_s: dict[str, float]) -> Floor:
    """The floor of one experts forward over ``pairs`` pairs that hit ``experts_hit`` experts (module doc).
    ``mma_flops_per_s`` maps an MMA kind ("bf16", "fp8") to its peak; the kind used is ``mma_kind``'s."""
    mma = mma_kind(weight_fmt, a_fmt)
    if mma not in mma_flops_per_s:
        raise ValueError(f"no {mma} MMA peak given (have {sorted(mma_flops_per_s)})")
    hbm_us = experts_hit * weight_bytes_per_expert(hidden, intermediate, weight_fmt) / hbm_bytes_per_s * 1e6
    mma_us = expert_flops(pairs, hidden, intermediate) / mma_flops_per_s[mma] * 1e6
    bound = "hbm" if hbm_us >= mma_us else "mma"
    return Floor(us=max(hbm_us, mma_us), hbm_us=hbm_us, mma_us=mma_us, mma=mma, bound=bound)


def experts_hit(slots: torch.Tensor) -> int:
    """How many distinct experts ``slots`` (expert ids of the pairs, any shape) routes to."""
    return int(torch.unique(slots).numel())


def experts_hit_by_rank(slots: torch.Tensor, experts_per_rank: int, ranks: int) -> list[int]:
    """Distinct experts hit on each of ``ranks`` ranks holding ``experts_per_rank`` consecutive global
    ids each (rank r: ids r*E .. r*E + E - 1): the per-rank weight reads of an EP step."""
    hit = torch.unique(slots.reshape(-1)) // experts_per_rank
    if hit.numel() and (int(hit.min()) < 0 or int(hit.max()) >= ranks):
        raise ValueError(f"expert ids outside 0 .. {ranks * experts_per_rank - 1} ({ranks} ranks x {experts_per_rank})")
    return torch.bincount(hit, minlength=ranks).tolist()
