"""Which bound a device P2P forward's peer waits take: MEGA_P2P_TIMEOUT_S, or the start-up one.

Why two bounds: a forward's first launch of each Triton kernel compiles it on the host, and the
ranks of an EP group compile at different speeds (8 ranks of one host share its cores). A rank
still compiling its dispatch is, to a peer already waiting at the barrier, indistinguishable from a
dead one; with the steady 30 s bound a slow compile ended the whole group with exit 70 at start-up.
The start-up forwards therefore wait up to MEGA_P2P_STARTUP_TIMEOUT_S (default 600 s): still
bounded, so a peer that dies during start-up is still found, later.

Which forwards are start-up forwards (``takes_startup_bound``): every eager forward before the
engine's first CUDA-graph capture when the engine captures (vLLM's profile run and warm-up compile
every shape it will replay); in an engine that never captures, the workspace's first forward (it
compiles the kernels; later first-time shapes compile one or two specialisations each, well inside
the steady bound). A forward being captured takes the steady bound: it is baked into the graph and
every replay waits with it.

And any eager forward that launches GEMM kernels no earlier forward of its workspace launched
(``new_kernels``: the experts provider's ``kernel_key`` for the forward's token bound is new). Under
an engine's bound the tile config follows the DP-padded batch, so the first mid-sized batch after
capture (vLLM captures decode sizes and profiles at the largest batch) compiles its GEMMs on every
rank while the first rank done already waits at the combine barrier: the ranks' compile times
differ by seconds on a loaded host. Every rank holds the same bound, so every rank decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WaitFacts:
    capturing: bool  # this forward is being captured into a CUDA graph
    forwards_done: int  # forwards this workspace completed before this one
    engine_captures: bool  # the engine will capture the layer (LayerPlan.engine_graphs == "captured")
    captured_before: bool  # the workspace was captured at least once already
    new_kernels: bool = False  # this forward launches GEMM kernels no earlier forward of the workspace launched


def takes_startup_bound(facts: WaitFacts) -> bool:
    """True: this forward's waits take MEGA_P2P_STARTUP_TIMEOUT_S (module docstring says why)."""
    if facts.capturing:
        return False
    if facts.forwards_done == 0 or facts.new_kernels:
        return True
    return facts.engine_captures and not facts.captured_before
