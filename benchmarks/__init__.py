"""The benchmarks behind ``megamoe bench ...`` and the research probes' shared tools: the lab, outside the
installed package (megamoe_backend never imports them). Each bench module exposes add_arguments(parser) and
run(args) -> int; run from the repository root, ``python3 -m benchmarks.bench_layer ...``."""
