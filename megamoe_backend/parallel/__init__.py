"""Process launching for multi-rank runs (demo, tests, GPU validation)."""

from .spawn import WorkerError, free_port, spawn_ranks

__all__ = ["WorkerError", "free_port", "spawn_ranks"]
