"""The experiments behind docs/benchmarks*.md: measurements of pdserve's features (chaos, migration, KV tiers and
quantized KV, routing, model families, the detokenizer, the router's frontend, tensor parallelism and its hand-off,
transfer overlap, speculative decoding), kept out of the package (pyproject.toml lists no ``benchmarks``).

Each runs from the repository's root as ``python -m benchmarks.<module>`` or as ``pdserve bench <name>`` from a
source checkout (cli/main.py's ``EXPERIMENTS``, which imports this folder only when that subcommand runs). They may
import any of pdserve's packages; nothing in pdserve imports them but that one entry (tests/test_layers.py).
"""
