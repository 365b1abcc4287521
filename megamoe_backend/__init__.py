"""megamoe-backend: MegaMoE expert-parallel MoE for vLLM and SGLang.

Layers (each a subpackage): spec -> knobs -> plan -> formats / transport / experts -> layer.
Core never imports vllm or sglang; the plugins (megamoe_vllm, megamoe_sglang) adapt it.
"""

__version__ = "0.1.0"
