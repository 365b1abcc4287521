"""Platform capability detection and backend selection (CUDA / ROCm / CPU).

``detect_facts()`` gathers what the machine offers; ``select_backends(facts, knobs, math)`` is the
pure decision; plan.selection turns a device kind into facts and calls it.
The AMD path follows aiter's and mori's published APIs and has not been run on AMD hardware.
"""

from .facts import AiterCaps, PackageInfo, PlatformFacts, detect_facts, probe_aiter_caps
from .rocm_probes import MoEShape, RocmProbes, V2Plan, V2Runtime
from .rocm_rules import PlatformError, aiter_reads_force_a8w4, next_power_of_two
from .select import RocmAsk, Selection, select_backends, selection_report

__all__ = [
    "AiterCaps",
    "MoEShape",
    "PackageInfo",
    "PlatformError",
    "PlatformFacts",
    "RocmAsk",
    "RocmProbes",
    "Selection",
    "V2Plan",
    "V2Runtime",
    "aiter_reads_force_a8w4",
    "detect_facts",
    "next_power_of_two",
    "probe_aiter_caps",
    "select_backends",
    "selection_report",
]
