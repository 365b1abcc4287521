"""Benchmarks behind `megamoe bench ...` (each module exposes add_arguments(parser) and run(args) -> int)."""
