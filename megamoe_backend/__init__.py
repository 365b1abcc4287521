"""megamoe-backend: MegaMoE expert-parallel MoE for vLLM and SGLang.

Layers (each a subpackage), each importing only those before it, lazy imports included
(tests/core/test_import_graph.py): formats, knobs -> platform, spec -> transport -> experts -> plan ->
layer -> parallel, workload -> cli, bench.
Core never imports vllm or sglang; the plugins (megamoe_vllm, megamoe_sglang) adapt it.
"""

__version__ = "0.1.0"
