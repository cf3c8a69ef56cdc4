"""Acceptance checks of a built machine, kept out of the package (pyproject.toml lists no ``checks``).

They run from the repository's root with the machine's own ``python3`` (``make gpu-check``, docs/gpu.md) and may
import any of pdserve's packages; nothing in pdserve imports them (tests/test_layers.py).
"""
